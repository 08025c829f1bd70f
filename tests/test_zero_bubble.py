"""Zero-bubble Seq1F1B: schedules (exhaustively replayed), their bubble, and the runtime's
gradients against no-pipelining training."""

from __future__ import annotations

import os
import random

import pytest

from megatron_seq1f1b.schedules.schedule import (
    Action,
    B,
    F,
    ScheduleError,
    W,
    build_schedule,
    format_schedule,
    parse_schedule,
)
from megatron_seq1f1b.schedules.simulate import simulate
from megatron_seq1f1b.schedules.validate import validate

# The whole grid takes about 3 minutes; CI replays a corner of it (SEQ1F1B_FULL=1 for all).
FULL = os.environ.get("SEQ1F1B_FULL") == "1"
P, M, K = (range(1, 9), range(1, 17), range(1, 9)) if FULL else \
    ((1, 2, 3, 4, 6), (1, 2, 3, 5, 8, 12), (1, 2, 3, 4, 6))
IP, IV, IK, IM = (range(2, 9), range(2, 5), range(1, 7), range(1, 17)) if FULL else \
    ((2, 3, 4), (2, 3), (1, 2, 3, 4), (1, 2, 3, 4, 6, 8))


def zb_bound(p: int, m: int, k: int, v: int = 1) -> float:
    """Least bubble of any schedule with F = B = W: the last stage starts p-1 units late."""
    return (p - 1) / (3 * k * m * v + p - 1)


@pytest.mark.parametrize("variant", ["zb-h1", "zb-h2"])
def test_exhaustive_zero_bubble(variant):
    for p in P:
        for m in M:
            for k in K:
                schedule = build_schedule(p, m, k, schedule=variant)
                validate(schedule)
                result = simulate(schedule)
                seq1f1b = simulate(build_schedule(p, m, k))
                where = f"{variant} p={p} m={m} k={k}"
                assert result.bubble_fraction <= seq1f1b.bubble_fraction + 1e-9, where
                if m * k >= p + k - 1:  # the first stage reaches a steady state
                    assert result.bubble_fraction == pytest.approx(zb_bound(p, m, k)), where
                first_stage_peak = seq1f1b.peak_inflight[0]
                if variant == "zb-h1":  # the pipeline's memory high-water mark does not grow
                    assert max(result.peak_inflight) <= first_stage_peak, where
                    assert result.peak_inflight[0] == first_stage_peak, where
                else:
                    assert result.peak_inflight[0] <= min(first_stage_peak + p - 1, m * k), where


def test_exhaustive_interleaved_zero_bubble():
    for p in IP:
        for v in IV:
            for k in IK:
                for m in IM:
                    schedule = build_schedule(p, m, k, v, schedule="zb-h1")
                    validate(schedule)
                    result = simulate(schedule)
                    seq1f1b = simulate(build_schedule(p, m, k, v))
                    where = f"p={p} v={v} k={k} m={m}"
                    assert result.bubble_fraction <= seq1f1b.bubble_fraction + 1e-9, where
                    if m * k >= p + k - 1:
                        assert result.bubble_fraction == pytest.approx(zb_bound(p, m, k, v)), where
                    assert max(result.peak_inflight) <= seq1f1b.peak_inflight[0], where


def test_targets_of_the_issue():
    """A third of Seq1F1B's bubble (p=8, m=16, k=4: 9.9% -> 3.5%), under 4%."""
    seq1f1b = simulate(build_schedule(8, 16, 4)).bubble_fraction
    zb = simulate(build_schedule(8, 16, 4, schedule="zb-h1")).bubble_fraction
    assert zb < 0.04 and zb <= seq1f1b / 2.8


def test_one_split_is_plain_zb_h1():
    """k=1: 1F1B's order of F and B; ZB-H1's bubble; the last stage lags W by p-1 units,
    as in the zero-bubble paper's ZB-H1 (its memory then equals the first stage's)."""
    schedule = build_schedule(4, 8, 1, schedule="zb-h1")
    plain = build_schedule(4, 8, 1)
    for zb, one_f_one_b in zip(schedule, plain):
        assert [a for a in zb if not a.is_weight] == one_f_one_b
    assert simulate(schedule).bubble_fraction == pytest.approx(3 / 27)
    assert format_schedule(schedule).splitlines()[3] == (
        "rank 3: F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 W0.0 F4.0 B4.0 W1.0 F5.0 B5.0 W2.0 "
        "F6.0 B6.0 W3.0 F7.0 B7.0 W4.0 W5.0 W6.0 W7.0")
    assert format_schedule(schedule).splitlines()[0] == (
        "rank 0: F0.0 F1.0 F2.0 F3.0 B0.0 W0.0 F4.0 B1.0 W1.0 F5.0 B2.0 W2.0 F6.0 B3.0 W3.0 "
        "F7.0 B4.0 W4.0 B5.0 W5.0 B6.0 W6.0 B7.0 W7.0")


def test_weight_actions_in_text_form_and_forward_only():
    schedule = build_schedule(2, 2, 2, schedule="zb-h2")
    assert parse_schedule(format_schedule(schedule)) == schedule
    assert Action.parse("W3.1c2") == W(3, 1, 2)
    assert build_schedule(2, 2, 2, schedule="zb-h1", forward_only=True) == \
        build_schedule(2, 2, 2, forward_only=True)


def test_interleaved_zb_h2_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="no interleaved form"):
        build_schedule(4, 8, 2, 2, schedule="zb-h2")


@pytest.mark.parametrize("text,message", [
    ("rank 0: F0.0 B0.0 W0.0 F1.0 B1.0", "weight gradients \\(W\\) missing"),
    ("rank 0: F0.0 W0.0 B0.0", "before the unit's backward"),
    ("rank 0: F0.0 F1.0 B0.0 B1.0 W1.0 W0.0", "order of the backwards"),
    ("rank 0: F0.0 B0.0 W0.0 W0.0", "order of the backwards"),
])
def test_validator_rules_for_weight_actions(text, message):
    with pytest.raises(ScheduleError, match=message):
        validate(parse_schedule(text))


def test_pending_weight_gradients_count_as_in_flight():
    split = simulate([[F(0), F(1), B(0), B(1), W(0), W(1)]])
    whole = simulate([[F(0), F(1), B(0), B(1)]])
    assert split.peak_inflight == [2] and whole.peak_inflight == [2]
    delayed = simulate([[F(0), B(0), F(1), B(1), W(0), W(1)]])
    assert delayed.peak_inflight == [2]
    prompt = simulate([[F(0), B(0), W(0), F(1), B(1), W(1)]])
    assert prompt.peak_inflight == [1]



def _list_scheduler(orders, caps, num_model_chunks, cost):
    """The placement rule of schedules/zero_bubble.py written the plain way: at every event
    every rank's next action is worked out afresh and the earliest runs (ties to the lower
    rank). The builder keeps each rank's next event and recomputes only a rank and its
    neighbours after an action; both must give the same schedule."""
    p, last_stage = len(orders), len(orders) * num_model_chunks - 1
    last_segment = {}
    for a in orders[0]:
        if a.kind == "F":
            last_segment[a.microbatch] = max(a.segment, last_segment.get(a.microbatch, 0))
    position, pending, out = [0] * p, [[] for _ in orders], [[] for _ in orders]
    free, held, done = [0.0] * p, [0] * p, {}

    def producer(a, r):
        stage = a.chunk * p + r
        if a.kind == "F":
            return None if stage == 0 else (a._replace(chunk=(stage - 1) // p), (stage - 1) % p)
        if stage == last_stage:
            return F(a.microbatch, last_segment[a.microbatch], a.chunk), r
        return a._replace(chunk=(stage + 1) // p), (stage + 1) % p

    def next_event(r):
        weight = pending[r][0] if pending[r] else None
        if position[r] == len(orders[r]):
            return (free[r], weight) if weight else None
        a = orders[r][position[r]]
        source = producer(a, r)
        ready = earliest = 0.0 if source is None else done.get(source)
        if source is not None and ready is None:
            earliest = free[source[1]] + cost(*source)
        full = a.kind == "F" and held[r] >= caps[r]
        if ready is not None and ready <= free[r] and not full:
            return free[r], a
        if weight and (full or earliest >= free[r] + cost(weight, r)):
            return free[r], weight
        return None if ready is None or full else (ready, a)

    while any(position[r] < len(orders[r]) or pending[r] for r in range(p)):
        events = [(e, r) for r in range(p) for e in [next_event(r)] if e is not None]
        if not events:
            return "deadlock"
        (start, a), r = min(events, key=lambda item: (item[0][0], item[1]))
        done[a, r] = free[r] = start + cost(a, r)
        out[r].append(a)
        if a.kind == "W":
            pending[r].pop(0)
            held[r] -= 1
        else:
            position[r] += 1
            held[r] += a.kind == "F"
            if a.kind == "B":
                pending[r].append(W(a.microbatch, a.segment, a.chunk))
    return out


def test_the_builder_places_w_as_the_plain_list_scheduler_does():
    """Random per-segment costs, interleaving, per-micro-batch segment counts and caps that
    deadlock: the same actions, or the same refusal."""
    from megatron_seq1f1b.schedules.schedule import forward_backward_orders
    from megatron_seq1f1b.schedules.zero_bubble import DeadlockError, build_zero_bubble

    rng = random.Random(5)
    compared = deadlocks = 0
    for _ in range(150 if FULL else 40):
        p, v = rng.choice((1, 2, 3, 4, 6)), rng.choice((1, 1, 2, 3))
        v = 1 if p == 1 else v
        m = rng.randint(1, 6)
        counts = rng.choice((rng.randint(1, 4), tuple(rng.randint(1, 4) for _ in range(m))))
        name = "zb-h2" if v == 1 and rng.random() < 0.3 else "zb-h1"
        orders, cap = forward_backward_orders(p, m, counts, v, name)
        table = {(a.microbatch, a.segment, r): (rng.choice((0.5, 1.0, 1.5, 2.25)),
                                                rng.choice((1.0, 2.0, 3.5)),
                                                rng.choice((0.25, 1.0, 1.75)))
                 for r, order in enumerate(orders) for a in order}
        cost = lambda a, r: table[a.microbatch, a.segment, r]["FBW".index(a.kind)]  # noqa: E731
        caps = [cap] * p if rng.random() < 0.8 else [rng.choice((cap, 1, 0)) for _ in range(p)]
        want = _list_scheduler(orders, caps, v, cost)
        if want == "deadlock":
            deadlocks += 1
            with pytest.raises(DeadlockError, match="cannot proceed"):
                build_zero_bubble(orders, caps, v, cost)
        else:
            assert build_zero_bubble(orders, caps, v, cost) == want
            compared += 1
    assert compared >= 20 and deadlocks >= 3


# ------------------------------------------------------------ the runtime, against no pipelining

import pipeline_cases as cases  # noqa: E402
from gpt import DataSpec, ModelSpec, run_layout  # noqa: E402

ROPE = ModelSpec()


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


ZB_GRID = [
    (pp, k, partition, schedule)
    for pp in (2, 4)
    for k in (1, 2, 3, 4)
    for partition in ("uniform", "balanced")
    for schedule in ("zb-h1", "zb-h2")
    if not (k == 1 and partition == "balanced") and (schedule == "zb-h1" or partition == "balanced")
]


@pytest.mark.parametrize("pp,k,partition,schedule", ZB_GRID)
def test_zero_bubble_equals_no_pipelining(ranks, pp, k, partition, schedule):
    results = ranks.run(
        pp, run_layout, case=f"zb-pp{pp}-k{k}-{partition}-{schedule}", model=ROPE,
        data=DataSpec(num_microbatches=3), pp=pp,
        seq1f1b=dict(num_splits=k, partition=partition, schedule=schedule),
    )
    _check(results)


def test_zero_bubble_micro_batch_size_2_and_forward_only(ranks):
    for forward_only in (False, True):
        results = ranks.run(2, run_layout, case=f"zb-mbs2-{forward_only}", model=ROPE,
                            data=DataSpec(num_microbatches=3, micro_batch_size=2), pp=2,
                            forward_only=forward_only,
                            seq1f1b=dict(num_splits=3, partition="balanced", schedule="zb-h1"))
        _check(results)


def test_zero_bubble_tp2_pp2_sequence_parallel(ranks):
    results = ranks.run(4, run_layout, case="zb-tp2-pp2-sp", model=ModelSpec(num_query_groups=2),
                        data=DataSpec(num_microbatches=3), tp=2, pp=2, sp=True,
                        seq1f1b=dict(num_splits=3, partition="balanced", schedule="zb-h1"))
    _check(results)


def test_zero_bubble_dp2_pp2_ddp_overlap(ranks):
    results = ranks.run(4, run_layout, case="zb-dp2-pp2-ddp", model=ROPE,
                        data=DataSpec(num_microbatches=3), pp=2,
                        ddp=dict(overlap_grad_reduce=True),
                        seq1f1b=dict(num_splits=2, partition="balanced", schedule="zb-h1"))
    _check(results)


@pytest.mark.parametrize("distributed", [False, True], ids=["ddp", "distributed-optimizer"])
def test_zero_bubble_optimizer_step(ranks, distributed):
    results = ranks.run(4, cases.optimizer_step, case=f"zb-optimizer-{distributed}", pp=2, k=2,
                        distributed=distributed, model=ROPE, data=DataSpec(num_microbatches=2),
                        schedule="zb-h1")
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("vpp,k", [(2, 1), (2, 3)])
def test_interleaved_zero_bubble_equals_no_pipelining(ranks, vpp, k):
    results = ranks.run(2, run_layout, case=f"zb-il-pp2-vpp{vpp}-k{k}",
                        model=ModelSpec(num_layers=4), data=DataSpec(num_microbatches=4), pp=2,
                        vpp=vpp, seq1f1b=dict(num_splits=k, partition="balanced",
                                              schedule="zb-h1"))
    _check(results)


# W twice as costly on the first segment as FLOPs say: its W moves to another slot
GIVEN_COSTS = ((1.3, 1.1, 2.4), (1.0, 1.2, 0.4), (0.7, 1.5, 0.3))


def test_given_segment_costs_place_w_and_stay_exact(ranks):
    """The planner's segment costs (not the FLOP model's) place W: the steps that run are
    the ones it simulated, and the gradients stay exact."""
    from megatron_seq1f1b.runtime.executor import pipeline_steps

    assert pipeline_steps(2, 3, 3, 1, False, "zb-h1", GIVEN_COSTS) != \
        pipeline_steps(2, 3, 3, 1, False, "zb-h1", ((1.0, 1.0, 1.0),) * 3)  # costs matter
    results = ranks.run(2, cases.zero_bubble_with_costs, case="zb-given-costs", pp=2, k=3,
                        costs=GIVEN_COSTS, model=ROPE, data=DataSpec(num_microbatches=3))
    _check(results)
    assert all(r["costs_used"] == [GIVEN_COSTS] for r in results), results


@pytest.mark.parametrize("costs,match", [
    (((1.0, 1.0, 1.0),), "1 entries but num_splits is 2"),
    (((1.0, 1.0, 1.0), (1.0, 0.0, 1.0)), r"segments \[1\] are not three positive"),
    (((1.0, 1.0), (1.0, 1.0, 1.0)), r"segments \[0\]"),
    ("fast", "one \\(F, B, W\\) triple"),
])
def test_bad_segment_costs_are_refused(costs, match):
    import megatron_seq1f1b as s1

    with pytest.raises(s1.ConfigError, match=match):
        s1.get_forward_backward_func(2, schedule="zb-h1", segment_costs=costs)


def test_weight_gradients_really_wait_for_w(ranks):
    """Each W runs the unit's linear weight GEMMs; a W that drops them breaks the gradients."""
    spec = ModelSpec()
    results = ranks.run(2, cases.zero_bubble_defers, case="zb-defers", pp=2, k=2,
                        drop_weight_grads=False, model=spec, data=DataSpec(num_microbatches=2))
    _check(results)
    per_stage = spec.num_layers // 2 * 4  # QKV, projection, fc1, fc2 per layer
    for r in results:
        output_layer = 1 if r["pp_rank"] == 1 else 0
        assert r["weight_gemms"] == [per_stage + output_layer] * 4, r
    broken = ranks.run(2, cases.zero_bubble_defers, case="zb-drops", pp=2, k=2,
                       drop_weight_grads=True, model=spec, data=DataSpec(num_microbatches=2))
    assert any("weight" in p for r in broken for p in r["problems"]), broken
