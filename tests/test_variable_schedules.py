"""Schedules with a different number of segments per micro-batch (variable-length micro-batches).

Pure: no processes. Equal counts must give exactly the schedules of one count for all; any
counts must validate (every unit once, segment orders, link order, rendezvous replay).
"""

import random

import pytest

from megatron_seq1f1b.schedules import interleaved
from megatron_seq1f1b.schedules.order import counts_of, forwards_before, segment_counts
from megatron_seq1f1b.schedules.plan import plan_steps
from megatron_seq1f1b.schedules.replay import DeadlockError
from megatron_seq1f1b.schedules.schedule import build_schedule, format_schedule
from megatron_seq1f1b.schedules.simulate import segment_cost, simulate
from megatron_seq1f1b.schedules.partition import CostModel
from megatron_seq1f1b.schedules.validate import validate


@pytest.mark.parametrize("p,m,k,v,schedule", [
    (1, 3, 2, 1, "1f1b"), (4, 5, 3, 1, "1f1b"), (3, 4, 2, 1, "zb-h1"), (3, 4, 2, 1, "zb-h2"),
    (2, 3, 3, 2, "1f1b"), (4, 6, 2, 2, "zb-h1"), (3, 7, 1, 3, "1f1b"),
])
def test_equal_counts_per_microbatch_are_the_one_count_schedule(p, m, k, v, schedule):
    one = build_schedule(p, m, k, v, schedule=schedule)
    assert build_schedule(p, m, [k] * m, v, schedule=schedule) == one
    assert plan_steps(one, v) == plan_steps(build_schedule(p, m, (k,) * m, v, schedule=schedule), v)


def test_last_stage_forwards_a_longer_microbatch_whole_before_its_backward():
    # micro-batch 1 has 3 segments after one of 1: every stage runs ahead for it
    assert format_schedule(build_schedule(2, 3, [1, 3, 2])) == (
        "rank 0: F0.0 F1.0 B0.0 F1.1 F1.2 F2.0 B1.2 F2.1 B1.1 B1.0 B2.1 B2.0\n"
        "rank 1: F0.0 B0.0 F1.0 F1.1 F1.2 B1.2 F2.0 B1.1 F2.1 B1.0 B2.1 B2.0"
    )


def test_forwards_before_reduces_to_warmup_plus_one_per_backward():
    # k = 3, m = 2, p = 3, rank 0: warm-up p-1 + k-1 = 4, then one more per backward
    needs = [3, 3, 3, 6, 6, 6]
    assert forwards_before(needs, 2, 6) == [5, 6, 6, 6, 6, 6]
    assert forwards_before(needs, 0, 6) == [3, 4, 5, 6, 6, 6]


def test_counts_are_read_back_and_checked():
    schedule = build_schedule(3, 4, [2, 1, 4, 3])
    assert counts_of(schedule) == (2, 1, 4, 3)
    assert segment_counts(2, 3) == (3, 3)
    with pytest.raises(ValueError, match="2 entries for 3 micro-batches"):
        segment_counts(3, [1, 2])
    with pytest.raises(ValueError, match="positive integers"):
        build_schedule(2, 2, [1, 0])


def _random_cases(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        p = rng.randint(1, 6)
        v = rng.choice([1, 1, 2, 3]) if p > 1 else 1
        m = rng.randint(1, 9)
        schedule = rng.choice(["1f1b", "zb-h1", "zb-h2"] if v == 1 else ["1f1b", "zb-h1"])
        counts = [rng.choice([1, 1, 2, 3, 5, 8]) for _ in range(m)]
        costs = None
        if schedule != "1f1b" and rng.random() < 0.5:  # uneven (F, B, W) per unit
            costs = [[tuple(rng.uniform(0.3, 2.0) for _ in range(3)) for _ in range(c)]
                     for c in counts]
        yield p, m, counts, v, schedule, costs


@pytest.mark.parametrize("seed", range(4))
def test_random_counts_validate(seed):
    """Every unit once, orders, link order and a rendezvous replay that finishes."""
    for p, m, counts, v, schedule, costs in _random_cases(seed, 60):
        for forward_only in (False, True):
            built = build_schedule(p, m, counts, v, schedule=schedule, costs=costs,
                                   forward_only=forward_only)
            validate(built, m, counts, v, forward_only=forward_only)


def test_interleaved_pair_that_would_wait_on_itself_is_split():
    """A micro-batch with many more segments at the end: the last forward on rank 0 is one
    its backward waits for through the pipeline; one exchange for both would deadlock."""
    counts = [6, 8]
    built = build_schedule(2, 2, counts, 3)
    unpaired = interleaved.unpaired_backwards(2, 2, counts, 3)
    assert unpaired[0], "rank 0 has a pair to split"
    validate(built, 2, counts, 3)
    original = interleaved.unpaired_backwards
    try:  # the mutation: pair them anyway
        interleaved.unpaired_backwards = lambda p, m, c, v: [frozenset()] * p
        with pytest.raises(DeadlockError):
            validate(built, 2, counts, 3)
    finally:
        interleaved.unpaired_backwards = original


def test_simulated_cost_per_microbatch_segment():
    lengths = [[512, 512], [256], [1024, 512, 512]]
    model = CostModel(per_token=1000.0, per_pair=1.0)
    cost = segment_cost(lengths, model)
    counts = [len(row) for row in lengths]
    schedule = build_schedule(2, 3, counts)
    result = simulate(schedule, cost)
    forwards = [cost(a, 0) for a in schedule[0] if a.is_forward]
    assert sum(forwards) / len(forwards) == pytest.approx(1.0)  # the mean forward costs 1
    one = segment_cost([256], model)
    from megatron_seq1f1b.schedules.actions import F
    assert cost(F(1, 0), 0) < cost(F(2, 0), 0)  # a 256-token unit costs less than 1024
    assert one(F(0, 0), 0) == pytest.approx(1.0)
    assert result.makespan > 0 and 0 < result.bubble_fraction < 1
