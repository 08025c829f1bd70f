"""Interleaved Seq1F1B: schedule validity for any k, Megatron equivalence, gradients."""

import os

import pytest

import megatron_order
from gpt import DataSpec, ModelSpec, run_layout
from megatron_seq1f1b.schedules.interleaved import microbatch_groups, warmup_forwards
from megatron_seq1f1b.schedules.plan import plan_steps
from megatron_seq1f1b.schedules.schedule import build_schedule
from megatron_seq1f1b.schedules.simulate import simulate
from megatron_seq1f1b.schedules.validate import check_link_order, validate


# The whole grid (p 2..8, v 2..4, k 1..6, m 1..16) takes about a minute; CI validates
# p 2..4, v 2..3 (every k and m); SEQ1F1B_FULL=1 runs all of it.
FULL = os.environ.get("SEQ1F1B_FULL") == "1"


def test_exhaustive_validation_p2_8_v2_4_k1_6_m1_16():
    for p in range(2, 9 if FULL else 5):
        for v in range(2, 5 if FULL else 4):
            for k in range(1, 7):
                for m in range(1, 17):
                    steps = validate(build_schedule(p, m, k, v))
                    if p == 2:  # activations and gradients share both directions
                        check_link_order(steps, channel=lambda msg: (msg.src, msg.dst))


@pytest.mark.parametrize("p,m,k,v", [(2, 1, 3, 2), (8, 40, 3, 2), (4, 33, 5, 3), (3, 64, 2, 4)])
def test_forward_only_and_larger_m_validate(p, m, k, v):
    validate(build_schedule(p, m, k, v))
    validate(build_schedule(p, m, k, v, forward_only=True), forward_only=True)


def test_groups_hold_whole_microbatches_and_at_least_p_units():
    for p in range(2, 9):
        for k in range(1, 7):
            for m in range(1, 17):
                groups = microbatch_groups(p, m, k)
                assert [mb for g in groups for mb in g] == list(range(m))
                if m * k >= p:
                    assert all(len(g) * k >= p for g in groups)
                sizes = [len(g) for g in groups]
                assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


def _megatron_interleaved(p, m, v):
    return megatron_order.record_interleaved(p, m, v)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2), (4, 12, 2)])
def test_one_split_is_exactly_megatrons_interleaved_order(ranks, p, m, v):
    (orders,) = ranks.run(1, _megatron_interleaved, case=f"megatron-il-{p}-{m}-{v}", p=p, m=m, v=v)
    ours = [[f"{a.kind}{a.microbatch}c{a.chunk}" for a in rank] for rank in build_schedule(p, m, 1, v)]
    assert ours == orders


@pytest.mark.parametrize("p,m,v,k", [(4, 8, 2, 1), (4, 8, 2, 2), (4, 8, 2, 4), (8, 16, 2, 4)])
def test_simulated_bubble_and_memory(p, m, v, k):
    """Bubble tracks (p-1)/(v*k*m + p-1); rank-0 peak is the warm-up plus one unit."""
    result = simulate(build_schedule(p, m, k, v))
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * k * m + p - 1), abs=0.005)
    assert result.peak_inflight[0] == warmup_forwards(p, m, k, v, 0) + 1


def test_interleaved_steps_pair_forward_with_backward():
    steps = plan_steps(build_schedule(4, 8, 2, 2))
    sizes = {len(step.actions) for rank in steps for step in rank}
    assert sizes == {0, 1, 2}


ROPE8 = ModelSpec(num_layers=8)

GRID = [
    (pp, k, partition, mbs)
    for pp in (2, 4)
    for k in (1, 2, 3, 4)
    for partition in ("uniform", "balanced")
    for mbs in (1, 2)
    if not (k == 1 and partition == "balanced") and not (mbs == 2 and partition == "uniform" and k in (2, 4))
]


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results)


@pytest.mark.parametrize("pp,k,partition,mbs", GRID)
def test_interleaved_seq1f1b_equals_no_pipelining(ranks, pp, k, partition, mbs):
    results = ranks.run(pp, run_layout, case=f"il-pp{pp}-k{k}-{partition}-mbs{mbs}", model=ROPE8,
                        data=DataSpec(num_microbatches=3, micro_batch_size=mbs), pp=pp, vpp=2,
                        seq1f1b=dict(num_splits=k, partition=partition))
    _check(results)


def test_interleaved_tp2_pp2_vpp2_sequence_parallel(ranks):
    results = ranks.run(4, run_layout, case="il-tp2-pp2-vpp2-sp",
                        model=ModelSpec(num_layers=8, num_query_groups=2),
                        data=DataSpec(num_microbatches=2), tp=2, pp=2, vpp=2, sp=True,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


def test_interleaved_dp2_pp2_vpp2_ddp_overlap(ranks):
    results = ranks.run(4, run_layout, case="il-dp2-pp2-vpp2", model=ROPE8,
                        data=DataSpec(num_microbatches=3), pp=2, vpp=2,
                        ddp=dict(overlap_grad_reduce=True),
                        seq1f1b=dict(num_splits=2, partition="balanced"))
    _check(results)


def test_interleaved_sliding_window_with_full_attention_layers(ranks):
    model = ModelSpec(num_layers=8, extra=(("window_size", (6, 0)), ("window_attn_skip_freq", 4)))
    results = ranks.run(2, run_layout, case="il-window", model=model,
                        data=DataSpec(num_microbatches=2), pp=2, vpp=2,
                        seq1f1b=dict(num_splits=3, partition="balanced"))
    _check(results)


def test_interleaved_forward_only(ranks):
    results = ranks.run(4, run_layout, case="il-forward-only", model=ROPE8,
                        data=DataSpec(num_microbatches=3), pp=4, vpp=2, forward_only=True,
                        seq1f1b=dict(num_splits=3, partition="uniform"))
    _check(results)


def test_one_split_is_bit_identical_to_megatrons_interleaved(ranks):
    import pipeline_cases

    results = ranks.run(4, pipeline_cases.bit_identical_k1, case="il-bitwise", pp=4, vpp=2,
                        model=ROPE8, data=DataSpec(num_microbatches=4))
    assert not [p for r in results for p in r], results
