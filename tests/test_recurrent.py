"""Mamba-2 (M) and gated delta net (G) layers under Seq1F1B: each segment starts from the
previous segment's convolution window and recurrent state (Megatron's own MambaMixer and
GatedDeltaNet, the project's reference kernels on CPU in both runs); loss and every gradient
equal no-pipelining training of the same pattern on the full sequence (fp32, rel. 1e-5)."""

import importlib.util
import os

import pytest

from gpt import DataSpec, ModelSpec, run_layout

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron.core.models.hybrid") is None,
                       reason="HybridModel is in megatron-core 0.18 and later"),
    pytest.mark.skipif(importlib.util.find_spec("einops") is None,
                       reason="Megatron's MambaMixer needs einops (the test extras)"),
]


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


FULL = os.environ.get("SEQ1F1B_FULL") == "1"  # CI runs the cases that cut differently
MOE = (("num_moe_experts", 4), ("moe_router_topk", 2), ("add_bias_linear", False),
       ("moe_aux_loss_coeff", 0.1), ("moe_router_load_balancing_type", "aux_loss"),
       ("moe_token_dispatcher_type", "alltoall"))

CASES = [
    # (pattern, pipeline stages, virtual stages, k, partition, schedule, micro-batch size,
    #  sequence length); Mamba's scan chunk (128) and GDN's (64) are longer than every
    #  segment; 12 tokens in 4 segments: each shorter than the convolution window (4)
    ("M-G*|G-M*", 2, None, 3, "uniform", "1f1b", 1, 32),
    ("MG|*-|GM|E*", 4, None, 4, "balanced", "1f1b", 2, 32),
    ("M-|G*|-M|*G", 2, 2, 2, "balanced", "1f1b", 1, 32),
    ("MG*-|GM-*", 2, None, 4, "uniform", "zb-h1", 1, 12),
] + ([("MG|*-", 2, None, 1, "uniform", "1f1b", 1, 32)] if FULL else [])


@pytest.mark.parametrize("pattern,pp,vpp,k,partition,schedule,mbs,seq", CASES,
                         ids=[f"{c[0]}-pp{c[1]}-vpp{c[2]}-k{c[3]}-{c[5]}-mbs{c[6]}-s{c[7]}"
                              for c in CASES])
def test_recurrent_pattern_equals_no_pipelining(ranks, pattern, pp, vpp, k, partition, schedule,
                                                mbs, seq):
    seq1f1b = dict(num_splits=k, partition=partition)
    if schedule != "1f1b":
        seq1f1b["schedule"] = schedule
    model = ModelSpec(hybrid=pattern, seq_length=seq, extra=MOE if "E" in pattern else ())
    results = ranks.run(max(pp, 1), run_layout, case=f"recurrent-{pattern}-{pp}-{vpp}-{k}",
                        model=model, data=DataSpec(num_microbatches=4, micro_batch_size=mbs),
                        pp=pp, vpp=vpp, seq1f1b=seq1f1b)
    _check(results)


def test_recurrent_tensor_parallel(ranks):
    """Tensor parallel 2 x pipeline 2: each rank holds its heads' part of every section of the
    mixers' packed in_proj and conv1d (and of A_log, D, dt_bias, Mamba's norm) and carries
    those heads' states from segment to segment (the harness shards by Megatron's sections)."""
    model = ModelSpec(hybrid="M-G*|G-M*")
    results = ranks.run(4, run_layout, case="recurrent-tp2-pp2", model=model,
                        data=DataSpec(num_microbatches=2), tp=2, pp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


# documents crossing no, one and several cuts (tests/test_documents.py's layouts)
DOCUMENTS = (((0, 5, 20),), ((0, 3, 11, 12, 27),), ((0, 8, 16, 24),))


@pytest.mark.parametrize("form,k,partition", [("thd-flash", 4, "uniform")] + (
    [("eod-local", 4, "uniform"), ("thd-flash", 3, "documents")] if FULL else []))
def test_recurrent_documents(ranks, form, k, partition):
    """Packed THD batches: the recurrent states restart at each document start, as Megatron's
    layers do (Mamba's seq_idx, the gated delta net's cu_seqlens), and only the document
    crossing a cut carries its state; end-of-document ids: Megatron's layers do not see the
    documents, so the states run on across them, in segments as in the whole sequence."""
    thd = form == "thd-flash"
    model = ModelSpec(hybrid="M-G*|G-M*", attention="flash" if thd else "local")
    results = ranks.run(2, run_layout, case=f"recurrent-documents-{form}-{k}", model=model,
                        data=DataSpec(num_microbatches=3, documents=DOCUMENTS, thd=thd), pp=2,
                        seq1f1b=dict(num_splits=k, partition=partition,
                                     documents="cu_seqlens" if thd else model.vocab_size - 1))
    _check(results)
