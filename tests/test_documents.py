"""Packed documents under Seq1F1B: segments by hand equal the full sequence with a dense
document mask, on every attention path (Megatron's local attention, the flash one on SDPA,
Transformer Engine's stand-in), for documents that cross no, one or several cuts."""

import dataclasses
import itertools

import pytest

from gpt import DataSpec, ModelSpec
from megatron_seq1f1b.segments.documents import Documents, chains, long_tailed, views_of
from segment_cases import compare_documents_by_hand

ROPE = ModelSpec()
GQA = ModelSpec(num_attention_heads=4, num_query_groups=2)
LEARNED = ModelSpec(position_embedding_type="learned_absolute")

CROSSING = ((0, 5, 20),)          # one document over segments 0-2, one over 2-3
AT_CUTS = ((0, 8, 16, 24),)       # segments made of whole documents
SPANNING = ((0, 30),)             # a document over every segment
MIXED = ((0, 3, 11, 12, 27),)     # short and long, several cuts crossed
TWO_SAMPLES = ((0, 5, 20), (0, 13))


def _data(documents, **kw):
    return DataSpec(num_microbatches=2, documents=(documents,), **kw)


CASES = {
    "local_eod_crossing": dict(model=ROPE, data=_data(CROSSING), backend="local"),
    "local_dense_mask": dict(model=ROPE, data=_data(MIXED, explicit_mask=True), backend="local"),
    "local_two_samples_window": dict(model=GQA, data=_data(TWO_SAMPLES, micro_batch_size=2),
                                     backend="local", overrides=dict(window_size=(6, 0))),
    "flash_eod_mixed": dict(model=GQA, data=_data(MIXED), backend="flash"),
    "flash_thd_crossing": dict(model=ROPE, data=_data(CROSSING, thd=True), backend="flash"),
    "flash_at_cuts": dict(model=LEARNED, data=_data(AT_CUTS), backend="flash"),
    "flash_two_samples": dict(model=ROPE, data=_data(TWO_SAMPLES, micro_batch_size=2),
                              backend="flash", lengths=(13, 10, 9)),
    "flash_window": dict(model=GQA, data=_data(MIXED), backend="flash",
                         overrides=dict(window_size=(5, 0), window_attn_skip_freq=2)),
    "te_thd_spanning": dict(model=GQA, data=_data(SPANNING, thd=True), backend="te-flash"),
    "te_thd_mixed": dict(model=ROPE, data=_data(MIXED, thd=True), backend="te-flash"),
    "te_eod_two_samples": dict(model=GQA, data=_data(TWO_SAMPLES, micro_batch_size=2),
                               backend="te-flash"),
    # A dense document mask (--reset-attention-mask) reaches TE over the keys each segment
    # sees, as it does unsegmented: TE's unfused backend ORs it in (its flash and fused
    # ones ignore it, unsegmented too: Megatron-LM refuses that combination under Seq1F1B).
    "te_unfused_dense_mask": dict(model=ROPE, data=_data(MIXED, explicit_mask=True),
                                  backend="te-unfused", documents=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_documents_by_hand_equal_full_sequence(ranks, name):
    (result,) = ranks.run(1, compare_documents_by_hand, case=name, **CASES[name])
    assert not result["problems"], "\n".join(result["problems"])


def test_views_and_chains():
    documents = Documents(((0, 5, 20),), 32)
    views = views_of((0, 8, 16, 24), (8, 8, 8, 8), documents, None)
    assert [v.key_start for v in views] == [0, 5, 5, 20]
    (chain,) = chains(views)
    assert (chain.head, chain.last, chain.base, chain.end) == (0, 3, 0, 32)
    whole = views_of((0, 8, 16, 24), (8, 8, 8, 8), Documents(((0, 8, 16, 24),), 32), None)
    assert chains(whole) == () and all(v.pieces is None for v in whole)
    assert Documents.from_eod([[1, 9, 2, 2, 9, 3]], eod=9).starts == ((0, 2, 5),)
    assert Documents.from_cu_seqlens([[0, 2, 6, 6, 6], [0, 6, 6, 6, 6]], 6).starts == (
        (0, 2), (0,))


# ----------------------------------------------------------- the schedule with documents

from gpt import run_layout  # noqa: E402

EOD = ROPE.vocab_size - 1  # tests/gpt.py ends documents with the last vocabulary id
PER_MICROBATCH = (CROSSING, MIXED, AT_CUTS)


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


PIPELINES = {
    "pp2_k3_local_eod_uniform": dict(
        model=ROPE, data=DataSpec(num_microbatches=3, documents=PER_MICROBATCH), pp=2,
        seq1f1b=dict(num_splits=3, partition="uniform", documents=EOD)),
    "pp2_k3_flash_thd_documents": dict(
        model=dataclasses.replace(GQA, attention="flash"),
        data=DataSpec(num_microbatches=3, documents=PER_MICROBATCH, thd=True), pp=2,
        seq1f1b=dict(num_splits=3, partition="documents", documents="cu_seqlens")),
    "pp2_vpp2_k2_flash_eod_documents": dict(
        model=dataclasses.replace(ROPE, attention="flash"),
        data=DataSpec(num_microbatches=4, documents=PER_MICROBATCH), pp=2, vpp=2,
        config_overrides=dict(overlap_p2p_comm=True, batch_p2p_comm=False),
        seq1f1b=dict(num_splits=2, partition="documents", documents=EOD)),
    "tp2_sp_k3_flash_documents": dict(
        model=dataclasses.replace(GQA, attention="flash"),
        data=DataSpec(num_microbatches=2, documents=PER_MICROBATCH), pp=1, tp=2, sp=True,
        seq1f1b=dict(num_splits=3, partition="documents", documents=EOD)),
    # through middle stages (pp 4): THD batches and per-sample documents
    "pp4_k3_flash_thd_documents": dict(
        model=dataclasses.replace(GQA, attention="flash"),
        data=DataSpec(num_microbatches=4, documents=PER_MICROBATCH, thd=True), pp=4,
        seq1f1b=dict(num_splits=3, partition="documents", documents="cu_seqlens")),
    "pp4_k2_local_eod_two_samples": dict(
        model=ROPE, data=DataSpec(num_microbatches=4, micro_batch_size=2,
                                  documents=(TWO_SAMPLES, ((0, 9, 22), (0, 16)))), pp=4,
        seq1f1b=dict(num_splits=2, partition="uniform", documents=EOD)),
    "pp2_zb_k3_local_two_samples": dict(
        model=ROPE, data=DataSpec(num_microbatches=2, micro_batch_size=2,
                                  documents=(TWO_SAMPLES, ((0, 9, 22), (0, 16)))), pp=2,
        seq1f1b=dict(num_splits=3, partition="documents", documents=EOD, schedule="zb-h1")),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_with_documents_equals_no_pipelining(ranks, name):
    layout = PIPELINES[name]
    _check(ranks.run(layout["pp"] * layout.get("tp", 1), run_layout, case=name, **layout))


# ------------------------------------------------------------------ the documents partition

from megatron_seq1f1b.schedules.partition import (  # noqa: E402
    CostModel, document_segment_cost, split_documents, split_sequence,
)


def _long_tailed(seed: int, seq_length: int = 4096) -> Documents:
    import random

    rng = random.Random(seed)
    starts = [0]
    while True:
        n = int(rng.lognormvariate(5.0, 1.3)) + 1
        if starts[-1] + n >= seq_length:
            return Documents((tuple(starts),), seq_length)
        starts.append(starts[-1] + n)


def _spread(documents, lengths, cost) -> float:
    segment = document_segment_cost(documents, cost)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    values = [segment(a, b) for a, b in zip(bounds, bounds[1:])]
    return max(values) / min(values)


@pytest.mark.parametrize("dense", [False, True], ids=["flash", "local"])
def test_documents_partition_balances_what_the_backend_computes(dense):
    cost = CostModel(per_token=2 * 12 * 256 * 256 * 4, per_pair=4 * 256 * 4,
                     dense_attention=dense)
    for seed in range(3):
        documents = _long_tailed(seed)
        for k in (2, 4, 8):
            lengths = split_documents(documents, k, cost, multiple_of=8)
            assert sum(lengths) == 4096 and all(n % 8 == 0 for n in lengths)
            assert _spread(documents, lengths, cost) <= 1.10
            if k > 2:  # balanced assumes one causal triangle: wrong for packed documents
                balanced = split_sequence(4096, k, "balanced", cost=cost, multiple_of=8)
                assert _spread(documents, balanced, cost) > 1.5
    # Unpacked data: one document per sample is the causal triangle balanced assumes.
    for length, multiple in ((4096, 8), (64, 1), (256, 1)):
        whole = Documents.whole(length, micro_batch_size=2)
        for k in (2, 4, 8):
            ours = split_documents(whole, k, cost, multiple_of=multiple)
            assert ours == split_sequence(length, k, "balanced", cost=cost,
                                          multiple_of=multiple), (length, k)


def test_documents_partition_on_local_attention_balances_across_cost_jumps():
    """Local attention's cost jumps where a segment starts inside another document; the
    continuous equal-cost solve lands beside the jump (spread 1.08 here) and the cuts then
    move until neighbouring segments cost the same."""
    cost = CostModel(per_token=2 * 12 * 256 * 256 * 4, per_pair=4 * 256 * 4,
                     dense_attention=True)
    documents = long_tailed(4096, 256, seed=1237)
    lengths = split_documents(documents, 4, cost)
    assert sum(lengths) == 4096 and _spread(documents, lengths, cost) <= 1.05


def test_documents_partition_cuts_at_document_ends_when_close():
    cost = CostModel(per_token=1000.0, per_pair=1.0)

    def cuts(documents, **kw):
        return set(itertools.accumulate(split_documents(documents, 4, cost, **kw)[:-1]))

    near = Documents(((0, 1034, 2059, 3082),), 4096)  # ends ~10 tokens from equal-cost cuts
    assert cuts(near, tolerance=0) == {1025, 2048, 3072}
    assert cuts(near) == {1034, 2059, 3082}
    # 40 tokens away the costs would spread by 1.11 (> 1.10): the documents are split.
    far = Documents(((0, 1004, 2068, 3052),), 4096)
    assert cuts(far) == cuts(far, tolerance=0) == {1044, 2049, 3092}
    assert max(split_documents(far, 4, cost, max_spread=2.0)) == 1064  # allowed: it moves


@pytest.mark.parametrize("backend,data", [
    ("flash", _data(MIXED)),
    ("flash", _data(TWO_SAMPLES, micro_batch_size=2)),
    ("flash", _data(CROSSING, thd=True)),
    ("te-flash", _data(MIXED, thd=True)),
    ("te-flash", _data(TWO_SAMPLES, micro_batch_size=2)),
])
def test_no_mask_tensor_on_the_flash_and_te_paths(ranks, backend, data):
    """No tensor of a segment's [queries, keys] size (or [s, s]) is made outside the kernels;
    the local backend, which needs its masks, shows that the recorder sees them."""
    from segment_cases import mask_shapes_by_hand

    model = dataclasses.replace(GQA, seq_length=40)  # no weight is [40, 40] or [s, keys]
    (result,) = ranks.run(1, mask_shapes_by_hand, case=f"masks-{backend}", model=model,
                          data=data, lengths=(16, 13, 11), backend=backend)
    assert result["created"] > 100 and not result["mask_shaped"], result
    (local,) = ranks.run(1, mask_shapes_by_hand, case="masks-local", model=model, data=data,
                         lengths=(16, 13, 11), backend="local")
    assert local["mask_shaped"], local


def test_flash_attention_takes_packed_batches_without_segments(ranks):
    """Megatron's own schedules give the flash attention THD batches (cu_seqlens) natively."""
    from segment_cases import flash_thd_full_sequence

    (result,) = ranks.run(1, flash_thd_full_sequence, case="flash-thd-full", model=GQA,
                          data=_data(MIXED, thd=True))
    assert not result["problems"], "\n".join(result["problems"])


def test_auto_plans_on_the_documents_and_trains_exactly(ranks):
    """--seq1f1b-splits auto with documents: the measured micro-batch's documents reach every
    rank, the documents partition is a candidate, and the chosen plan trains exactly."""
    import pipeline_cases as cases

    results = ranks.run(2, cases.auto_plan, case="auto-documents", pp=2, model=ROPE,
                        data=DataSpec(num_microbatches=3, documents=PER_MICROBATCH),
                        documents=EOD, time_every_candidate=True)
    problems = [p for r in results for p in r.get("problems", [r.get("error")])]
    assert not problems, "\n".join(map(str, problems))
    plans = [r["plan"] for r in results]
    assert all(p == plans[0] for p in plans), plans
    logged = [r["logged"] for r in results if r["rank"] == 0][0]
    assert " documents " in logged[0], logged[0]  # a candidate, timed


def test_cpu_thd_rope_stand_in_equals_megatrons_per_document_loop():
    """runtime.cpu's THD RoPE (every token's row gathered, one call) gives Megatron-Core's
    per-document result and gradient bit for bit (a fair baseline for packed batches)."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    import megatron_seq1f1b.runtime.cpu as cpu

    cpu.enable()
    stand_in = rope_utils._apply_rotary_pos_emb_thd
    assert getattr(stand_in, "seq1f1b_cpu", False)
    original = stand_in.__wrapped__

    class Group:
        def __init__(self, size):
            self.count = size

        def size(self):
            return self.count

        def rank(self):
            return 0

    generator = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 17, 18, 40], dtype=torch.int32)
    x = torch.randn(40, 3, 16, dtype=torch.float64, generator=generator)
    freqs = torch.randn(30, 1, 1, 16, dtype=torch.float64, generator=generator)
    weights = torch.randn(40, 3, 16, dtype=torch.float64, generator=generator)
    results = []
    for function in (original, stand_in):
        t = x.clone().requires_grad_()
        out = function(t, cu, freqs, cp_group=Group(1))
        (out * weights).sum().backward()
        results.append((out.detach(), t.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_document_runs_cut_where_a_document_starts_in_every_sample():
    from megatron_seq1f1b.segments.document_runs import document_runs

    rows = [(12, 12, 12, 12), (8, 8), (10, 10, 10, 10)]
    found = [Documents(((0, 5, 24, 41),), 48), Documents.whole(16),
             # 20 starts a document in both samples, 10 and 30 in one only
             Documents(((0, 10, 20), (0, 20, 30)), 40)]
    runs = document_runs(rows, found)
    assert runs.rows == ((12, 12), (12, 12), (8, 8), (10, 10), (10, 10))
    assert runs.owners == ((0, 0), (0, 2), (1, 0), (2, 0), (2, 2))
    assert runs.last_backward == (2, 0, 2)
    assert runs.offsets == (0, 24, 0, 0, 20)
    assert runs.documents(found) == (
        Documents(((0, 5),), 24), Documents(((0, 17),), 24), Documents.whole(16),
        Documents(((0, 10), (0,)), 20), Documents(((0,), (0, 10)), 20))
    assert document_runs(rows, [None] * 3).rows == tuple(rows)
