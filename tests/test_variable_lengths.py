"""Variable-length micro-batches (Megatron's ``variable_seq_lengths=True``) under Seq1F1B:
loss reports and every gradient equal Megatron's own schedule on the same micro-batches
(fp32, rel 1e-5), by a fixed segment count or a token budget per segment; the passes
post-training runs (log-probabilities, per-sequence losses); mismatched data refused on
every rank."""

import importlib.util
import os

import pytest

from gpt import ModelSpec
from varlen_cases import budget_rounding, run, run_auto, run_framework, run_mismatch, run_step

FULL = os.environ.get("SEQ1F1B_FULL") == "1"
HYBRID = importlib.util.find_spec("megatron.core.models.hybrid") is not None
ROPE = ModelSpec(num_layers=4, hidden_size=32, seq_length=32)
FLASH = ModelSpec(num_layers=4, hidden_size=32, seq_length=32, attention="flash")
MOE = ModelSpec(extra=(("num_moe_experts", 4), ("moe_router_topk", 2),
                       ("add_bias_linear", False), ("moe_aux_loss_coeff", 0.1),
                       ("moe_router_load_balancing_type", "aux_loss")))
MTP = ModelSpec(extra=(("mtp_num_layers", 1), ("mtp_loss_scaling_factor", 0.3)))
# lengths 16x apart within one iteration; 8 is shorter than every budget below
UNEVEN = [64, 8, 40, 16]
# packed THD micro-batches: documents crossing cuts, and one micro-batch of one document
PACKED = [48, 16, 32]
PACKED_DOCUMENTS = [(0, 5, 20, 41), (0,), (0, 11, 12)]


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def budget(tokens, k=16, **kw):
    return dict(num_splits=k, segment_tokens=tokens, **kw)


CASES = {  # name: (ranks, arguments); CI runs these, SEQ1F1B_FULL=1 the FULL ones too
    "pp1-budget": (1, dict(spec=ROPE, lengths=UNEVEN, pp=1, seq1f1b=budget(12))),
    "pp2-k2-bshd": (2, dict(spec=ROPE, lengths=UNEVEN, seq1f1b=dict(num_splits=2))),
    "pp2-budget-balanced": (2, dict(spec=ROPE, lengths=UNEVEN,
                                    seq1f1b=budget(12, partition="balanced"))),
    "pp2-thd-documents-budget": (2, dict(
        spec=FLASH, lengths=PACKED, documents=PACKED_DOCUMENTS, thd=True,
        seq1f1b=budget(12, partition="documents", documents="cu_seqlens"))),
    "pp2-vpp2-budget": (2, dict(spec=ROPE, lengths=UNEVEN, vpp=2, seq1f1b=budget(16))),
    "pp2-zb-h1-budget": (2, dict(spec=ROPE, lengths=UNEVEN,
                                 seq1f1b=budget(16, schedule="zb-h1", partition="balanced"))),
}
FULL_CASES = {
    "pp4-k3": (4, dict(spec=ROPE, lengths=[32, 8, 24, 16, 64, 8], pp=4,
                       seq1f1b=dict(num_splits=3, partition="balanced"))),
    "pp4-budget": (4, dict(spec=ROPE, lengths=[32, 8, 24, 16, 64, 8], pp=4, seq1f1b=budget(12))),
    "pp4-vpp2-budget": (4, dict(spec=ModelSpec(num_layers=8), lengths=[32, 8, 24, 16, 64, 8, 40, 16],
                                pp=4,
                                vpp=2, seq1f1b=budget(16))),
    "pp2-bshd-mbs2-budget": (2, dict(spec=ROPE, lengths=UNEVEN, micro_batch_size=2,
                                     seq1f1b=budget(16, partition="balanced"))),
    "pp2-per-token-loss": (2, dict(spec=ROPE, lengths=UNEVEN, per_token=True,
                                   seq1f1b=budget(12))),
    "pp2-vpp2-forward-only": (2, dict(spec=ROPE, lengths=UNEVEN, vpp=2, forward_only=True,
                                      seq1f1b=budget(12))),
    "pp2-zb-h2-k3": (2, dict(spec=ROPE, lengths=UNEVEN,
                             seq1f1b=dict(num_splits=3, schedule="zb-h2"))),
    "pp2-moe-alltoall": (2, dict(spec=MOE, lengths=UNEVEN, seq1f1b=budget(16))),
    "pp2-mtp": (2, dict(spec=MTP, lengths=UNEVEN, seq1f1b=budget(16))),
    "pp2-eod-documents": (2, dict(spec=ROPE, lengths=PACKED, documents=PACKED_DOCUMENTS,
                                  seq1f1b=budget(12, partition="documents",
                                                 documents=ROPE.vocab_size - 1))),
    "tp2-sp-pp2": (4, dict(spec=ROPE, lengths=UNEVEN, tp=2, sp=True, seq1f1b=budget(16))),
    "cp2-pp2": (4, dict(spec=ROPE, lengths=UNEVEN, cp=2, seq1f1b=budget(16))),
}
if HYBRID:
    FULL_CASES["pp2-hybrid-MG-thd"] = (2, dict(
        spec=ModelSpec(hybrid="M-G*|G-M*", attention="flash"), lengths=PACKED,
        documents=PACKED_DOCUMENTS, thd=True,
        seq1f1b=budget(16, partition="documents", documents="cu_seqlens")))
    CASES["pp2-hybrid-MG-bshd"] = (2, dict(spec=ModelSpec(hybrid="M-G*|G-M*"), lengths=UNEVEN,
                                           seq1f1b=budget(16)))
if FULL:
    CASES.update(FULL_CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_variable_lengths_equal_megatron(ranks, name):
    world, arguments = CASES[name]
    _check(ranks.run(world, run, case=f"varlen-{name}", **arguments))


# backward_by_documents: documents start where a cut falls (24 in micro-batch 0, 20 in 2), so
# each of those micro-batches is two runs of two segments; a document crosses a cut in each run
RUNS_LENGTHS = [48, 16, 40]
RUNS_DOCUMENTS = [(0, 5, 24, 41), (0,), (0, 7, 20, 33)]
RUNS = dict(lengths=RUNS_LENGTHS, documents=RUNS_DOCUMENTS, per_token=True, order=True)
RUNS_CASES = {
    "pp2-thd": (2, dict(spec=FLASH, thd=True, **RUNS, seq1f1b=budget(
        12, documents="cu_seqlens", backward_by_documents=True))),
    "pp2-eod-zb-h1": (2, dict(spec=ROPE, **RUNS, seq1f1b=budget(
        12, documents=ROPE.vocab_size - 1, schedule="zb-h1", backward_by_documents=True))),
}
RUNS_CASES["pp2-thd-documents-partition"] = (2, dict(
    spec=FLASH, thd=True, lengths=[48, 16, 40], documents=[(0, 5, 24, 41), (0,), (0, 7, 20, 33)],
    per_token=True, order=True, seq1f1b=budget(12, partition="documents", documents="cu_seqlens",
                                               backward_by_documents=True)))
RUNS_CASES["pp2-fixed-length-eod"] = (2, dict(  # every micro-batch seq_length long; the cut
    # packs documents into more segments than ceil(48 / 12) = 4 (the cap is num_splits)
    spec=ROPE, lengths=[48, 48, 48], documents=[(0, 5, 24, 41), (0, 20), (0, 7, 24, 33)],
    per_token=True, order=True, config_overrides=dict(variable_seq_lengths=False),
    seq1f1b=budget(12, partition="documents", documents=ROPE.vocab_size - 1,
                   backward_by_documents=True)))
RUNS_CASES["pp2-eod-mbs2-documents-partition"] = (2, dict(  # two samples, the same documents
    spec=ROPE, micro_batch_size=2, **RUNS, seq1f1b=budget(
        12, partition="documents", documents=ROPE.vocab_size - 1, backward_by_documents=True)))
if FULL:
    RUNS_CASES["pp4-thd"] = (4, dict(spec=FLASH, thd=True, pp=4, **RUNS, seq1f1b=budget(
        12, documents="cu_seqlens", backward_by_documents=True)))


@pytest.mark.parametrize("name", list(RUNS_CASES))
def test_runs_of_documents_go_backward_apart(ranks, name):
    """Exact against Megatron, and on every stage a micro-batch's first run goes backward
    before its last run (as a whole micro-batch its segment 0 goes backward last of all)."""
    world, arguments = RUNS_CASES[name]
    results = ranks.run(world, run, case=f"varlen-runs-{name}", **arguments)
    _check(results)
    for result in results:
        order = [tuple(event) for event in result["order"]]
        if name == "pp2-fixed-length-eod":  # cut at every document end: 6 segments
            assert max(segment for _, mb, segment in order if mb == 0) == 5, order
        for microbatch in (0, 2):  # two runs or more each
            final = max(segment for phase, mb, segment in order if mb == microbatch)
            assert order.index(("B", microbatch, 0)) < order.index(("B", microbatch, final)), \
                (result["rank"], order)


@pytest.mark.parametrize("form", ["mean", "triple"])
def test_log_probability_pass_returns_one_entry_per_microbatch(ranks, form):
    """forward_only with per-token tensors in the report (Megatron's 2-tuple included): one
    store entry per micro-batch, the segments' tokens joined in order, as Megatron's."""
    _check(ranks.run(2, run_step, case=f"varlen-logprobs-{form}", step="logprob", form=form,
                     spec=ROPE, lengths=UNEVEN, forward_only=True, seq1f1b=budget(12)))


def test_per_sequence_loss_as_weighted_token_sum(ranks):
    """A GRPO-style loss (a mean per sequence, then over sequences) written as a weighted
    token sum, weights from the whole micro-batch: exact under segments."""
    _check(ranks.run(2, run_step, case="varlen-weighted", step="weighted", spec=ROPE,
                     lengths=UNEVEN, micro_batch_size=2, seq1f1b=budget(12)))


@pytest.mark.parametrize("kind,line", [
    ("short", "pipeline stage 1's data iterator ended after 3 micro-batch(es); the iteration "
              "has 4 (micro-batch 3 is missing there)"),
    ("length", "micro-batch 1 has 16 tokens on pipeline stage 1 but 8 on stage 0"),
])
def test_mismatched_stage_data_stops_every_rank(ranks, kind, line):
    results = ranks.run(2, run_mismatch, case=f"varlen-mismatch-{kind}", kind=kind,
                        lengths=UNEVEN)
    for result in results:
        assert result["error"] is not None, f"rank {result['rank']} ran on"
        assert any(line in problem for problem in result["error"]), result["error"]


def test_auto_plans_a_budget_on_the_first_global_batch(ranks):
    results = ranks.run(2, run_auto, case="varlen-auto", lengths=[256, 32, 128, 64] * 2)
    _check(results)
    assert results[0]["plan"] == results[1]["plan"], results  # one plan on every rank


@pytest.mark.parametrize("via", ["install", "function"])
def test_post_training_framework_drop_in(ranks, via):
    """The path a post-training framework takes, as it calls it: install() and then Megatron's
    getter (or the function itself), its own forward step building PackedSeqParams per
    micro-batch from its 1-D cu_seqlens, micro_batch_size=1, seq_length the longest, a loss
    per token: loss reports and every gradient equal Megatron's own schedule. Through
    install(), a micro-batch's runs of documents go backward apart (the framework's loss is per
    token, which that needs)."""
    options = (dict(partition="documents", backward_by_documents=True) if via == "install"
               else dict(partition="balanced"))
    _check(ranks.run(2, run_framework, case=f"varlen-framework-{via}", via=via, lengths=PACKED,
                     documents=PACKED_DOCUMENTS,
                     seq1f1b=dict(num_splits=16, segment_tokens=12, documents="cu_seqlens",
                                  **options)))


def test_a_budget_rounds_by_the_segments_it_cuts(ranks):
    (result,) = ranks.run(1, budget_rounding, case="varlen-budget-rounding")
    assert result == {"budget": 64, "cap": 1}, result  # 64 segments of 32 tokens: no 64 blocks
