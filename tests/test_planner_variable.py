"""The planner for micro-batches of different lengths (planner/variable.py): pure, no processes.

Its cuts are the executor's, its times the replay of the executor's steps, its memory the
tokens a stage holds; Megatron's 1F1B is the candidate with one segment per micro-batch."""

import pytest

from megatron_seq1f1b.planner.costs import Calibration, Fit, StageCosts
from megatron_seq1f1b.planner.variable import (
    budgets, choose_variable_plan, cut_rows, peak_tokens, predict_rows, regroup,
)
from megatron_seq1f1b.schedules.partition import CostModel
from megatron_seq1f1b.schedules.schedule import build_schedule
from megatron_seq1f1b.schedules.simulate import simulate, uniform_cost
from megatron_seq1f1b.schedules.variable import cut_microbatches, segment_count

LENGTHS = [512, 4096, 256, 1024, 2048, 256, 3072, 768]  # 16x apart
MODEL = CostModel(1.0, 1.0 / 4096)


def _calibration(p, host=0.0, per_token=1.0):
    stage = StageCosts(Fit(per_token / p, 1.0 / 4096 / p, host), Fit(2 * per_token / p,
                                                                      2.0 / 4096 / p, host))
    return Calibration((stage,) * p, "causal_pairs")


def test_counts_by_budget_and_cap():
    assert segment_count(4096, 16, 1024) == 4
    assert segment_count(4000, 16, 1024) == 4   # ceil
    assert segment_count(256, 16, 1024) == 1    # shorter than the budget: whole
    assert segment_count(4096, 3, 1024) == 3    # num_splits caps the count
    assert segment_count(4096, 4) == 4          # a fixed count
    assert segment_count(6, 4, multiple_of=2) == 3  # at most one segment per multiple
    rows = cut_microbatches(LENGTHS, 16, "balanced", segment_tokens=1024, cost=MODEL,
                            multiple_of=16)
    assert [len(r) for r in rows] == [1, 4, 1, 1, 2, 1, 3, 1]
    assert [sum(r) for r in rows] == LENGTHS
    assert all(n % 16 == 0 for r in rows for n in r)
    assert rows[1][0] > rows[1][-1]  # balanced: earlier segments longer


def test_one_segment_each_is_megatrons_1f1b_with_uniform_units():
    """Equal lengths and unit costs: the textbook bubble (p-1)/(m+p-1) and Seq1F1B's formula."""
    calibration = Calibration((StageCosts(Fit(0.0, d=1.0), Fit(0.0, d=2.0)),) * 4,
                              "causal_pairs")
    time, bubble, peaks, _ = predict_rows(calibration, [(64,)] * 8, 4, send_slack=0)
    assert bubble == pytest.approx(3 / 11)
    assert peaks[0] == 4 * 64
    time_k, bubble_k, _, schedule = predict_rows(calibration, [(16,) * 4] * 8, 4,
                                                 send_slack=0)
    assert bubble_k == pytest.approx(3 / 35)
    assert time_k == pytest.approx(simulate(schedule, uniform_cost(1.0, 2.0)).makespan)


def test_peak_tokens_count_each_unit_its_own_length():
    rows = [(100,), (300, 200), (50,)]
    schedule = build_schedule(2, 3, [1, 2, 1])
    # rank 0: F0.0 F1.0 B0.0 F1.1 F2.0 holds 300 + 200 + 50; rank 1: F1.0 F1.1 before B1.1
    assert peak_tokens(schedule, rows) == (550, 500)


def test_budget_beats_megatron_on_uneven_lengths_and_saves_memory():
    """Faster on uneven lengths; the memory every stage must hold is the longest micro-batch
    whole (its last segment's backward comes first) plus what runs ahead of it: less than
    Megatron's p micro-batches where p is large or the cut is fixed."""
    def plan(p, k, tokens=None):
        rows = cut_rows(LENGTHS, k, "balanced", segment_tokens=tokens, cost=MODEL,
                        multiple_of=16)
        time, _, peaks, _ = predict_rows(_calibration(p), rows, p)
        return time, max(peaks)

    for p in (2, 4):
        megatron, budget, fixed = plan(p, 1), plan(p, 64, 1024), plan(p, 4)
        chosen, _ = choose_variable_plan(_calibration(p), LENGTHS, p, cost=MODEL, multiple_of=16)
        assert megatron[0] / budget[0] > 1.2
        assert chosen.time <= budget[0]
        assert fixed[1] < 0.95 * megatron[1]
        assert budget[1] >= max(LENGTHS)  # a stage holds its longest micro-batch whole
    assert budget[1] < 0.9 * megatron[1]  # p = 4


def test_fixed_cost_per_unit_limits_the_budget():
    """With a large fixed cost per unit the smallest budgets lose: the choice is not simply
    the most segments."""
    calibration = _calibration(2, host=2000.0)
    chosen, _ = choose_variable_plan(calibration, LENGTHS, 2, cost=MODEL, multiple_of=16,
                                     min_segment_length=128)
    rows = cut_rows(LENGTHS, 64, "balanced", segment_tokens=128, cost=MODEL, multiple_of=16)
    smallest, *_ = predict_rows(calibration, rows, 2)
    assert chosen.time < smallest
    assert chosen.units < sum(len(r) for r in rows)


def test_plans_are_timed_with_the_transports_timing():
    """``timing`` reaches the replay (``--seq1f1b-splits auto`` passes the executor's, as the
    fixed-length planner does): zero bubble waiting for its own sends (rendezvous, Megatron's
    batched p2p) is slower than posting them a step later (the executor's NCCL links)."""
    calibration = _calibration(4)
    rows = cut_rows(LENGTHS, 64, "balanced", segment_tokens=1024, cost=MODEL, multiple_of=16)
    times = {timing: predict_rows(calibration, rows, 4, schedule="zb-h1", timing=timing)[0]
             for timing in ("rendezvous", "nccl")}
    assert times["rendezvous"] == predict_rows(calibration, rows, 4, schedule="zb-h1",
                                               send_slack=0)[0]
    assert times["rendezvous"] > 1.05 * times["nccl"]
    chosen = {}
    for timing in times:
        chosen[timing], _ = choose_variable_plan(calibration, LENGTHS, 4, cost=MODEL,
                                                 multiple_of=16, schedules=("zb-h1",),
                                                 timing=timing)
        assert chosen[timing].time == predict_rows(calibration, chosen[timing].rows, 4,
                                                   schedule="zb-h1", timing=timing)[0]
    assert chosen["rendezvous"].time > chosen["nccl"].time


def test_memory_budget_picks_a_plan_that_fits_or_says_the_smallest():
    calibration = Calibration(_calibration(2).stages, "causal_pairs", bytes_per_token=1000.0)
    chosen, ranked = choose_variable_plan(calibration, LENGTHS, 2, cost=MODEL, multiple_of=16,
                                          memory_budget_bytes=5.0e6)
    assert chosen.peak_bytes <= 5.0e6
    with pytest.raises(ValueError, match="no plan fits"):
        choose_variable_plan(calibration, LENGTHS, 2, cost=MODEL, multiple_of=16,
                             memory_budget_bytes=1.0e5)


def test_regroup_balances_tokens_and_keeps_every_sequence_once():
    lengths = LENGTHS + [128, 640]
    groups = regroup(lengths, 4)
    assert sorted(j for g in groups for j in g) == list(range(10))
    loads = [sum(lengths[j] for j in g) for g in groups]
    assert max(loads) == max(lengths)  # the longest sequence alone, the rest around it
    assert max(loads) - min(loads) <= 1280


def test_budgets_are_powers_of_two_below_the_longest():
    assert budgets([300, 5000], multiple_of=16, min_segment_length=128) == [
        128, 256, 512, 1024, 2048, 4096]
    assert budgets([100], multiple_of=1, min_segment_length=128) == []


def test_documents_cut_at_document_ends():
    from megatron_seq1f1b.segments.documents import Documents

    documents = [Documents(((0, 300),), 1024), Documents(((0,),), 256)]
    rows = cut_rows([1024, 256], 16, "documents", segment_tokens=512, cost=MODEL,
                    documents=documents)
    assert [sum(r) for r in rows] == [1024, 256] and len(rows[0]) == 2 and len(rows[1]) == 1


def test_pruned_search_chooses_what_timing_every_candidate_chooses(monkeypatch):
    """The bound only skips candidates that cannot win: with every candidate timed (bound
    0) the choice is the same, on random lengths, stage counts and fixed costs per unit."""
    import random

    from megatron_seq1f1b.planner import variable

    rng = random.Random(3)
    for _ in range(6):
        p = rng.choice([2, 3, 4])
        lengths = [rng.choice([256, 512, 1024, 2048, 4096]) for _ in range(rng.randint(3, 8))]
        calibration = _calibration(p, host=rng.choice([0.0, 50.0, 500.0]))
        chosen, timed = choose_variable_plan(calibration, lengths, p, cost=MODEL, multiple_of=16,
                                             schedules=("1f1b", "zb-h1"))
        with monkeypatch.context() as patch:
            patch.setattr(variable, "busy_bound", lambda *a, **k: 0.0)
            every, all_timed = choose_variable_plan(calibration, lengths, p, cost=MODEL,
                                                    multiple_of=16, schedules=("1f1b", "zb-h1"))
        assert (chosen.name, chosen.time) == (every.name, every.time)
        assert len(timed) <= len(all_timed)
        bound = variable.busy_bound(calibration, every.rows, p,
                                    split_backward=every.schedule != "1f1b")
        assert bound <= every.time * (1 + 1e-9)  # a bound, not an estimate
