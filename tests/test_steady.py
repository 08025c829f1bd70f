"""The steady-state shortcut (schedules/steady.py) against building and replaying everything.

Exactness on a grid over pipeline size, micro-batches, segments, model chunks, schedules,
partitions, costs and memory budgets: the repeated steps equal the built ones, the
extended makespan equals the full replay's, and the planner's answer (every candidate's
time, bubble and memory, and the plan chosen) equals the one it gives when it simulates
every micro-batch. The default grid is small (CI time); SEQ1F1B_FULL=1 runs a larger one.
Also here: the replay's timing models of the executor's transports.
"""

import os
import random
from types import SimpleNamespace

import pytest

from megatron_seq1f1b.planner import candidates as cand
from megatron_seq1f1b.planner import choose_plan
from megatron_seq1f1b.planner.footprint import ModelShape, Training
from megatron_seq1f1b.planner.memory_model import GIB, MemoryModel
from megatron_seq1f1b.runtime import executor_setup
from megatron_seq1f1b.schedules import steady
from megatron_seq1f1b.schedules.actions import B, F
from megatron_seq1f1b.schedules.plan import ACTIVATION, GRADIENT, Message, Step
from megatron_seq1f1b.schedules.replay import TIMINGS, replay

FULL = os.environ.get("SEQ1F1B_FULL") == "1"

UNEVEN = {1: ((1.0, 1.0, 1.0),), 2: ((0.8, 0.9, 0.7), (1.2, 1.5, 0.6)),
          3: ((0.7, 0.8, 0.6), (1.0, 1.2, 0.7), (1.3, 1.6, 0.9)),
          4: ((0.6, 0.7, 0.5), (0.9, 1.0, 0.6), (1.1, 1.3, 0.8), (1.4, 1.8, 1.0))}


def _builder(p, k, v, name):
    costs = UNEVEN[k] if name != "1f1b" else None
    return lambda m: steady.whole_plan(p, m, k, v, name, costs)


# ------------------------------------------------------------------ timing models


def _three_ranks():
    """Rank 0 sends to a busy rank 1, then receives from rank 2, which goes on to a long
    compute once its send is done."""
    a = Message(ACTIVATION, 0, 0, 0, 0, 1)
    g = Message(GRADIENT, 0, 0, 0, 2, 0)
    steps = [[Step((), (), (F(0),)), Step((a,), (), ()), Step((), (g,), (B(0),))],
             [Step((), (), (F(1),)), Step((), (a,), (F(2),))],
             [Step((), (), (F(3),)), Step((g,), (), ()), Step((), (), (B(3),))]]
    cost = {F(0): 1.0, B(0): 1.0, F(1): 10.0, F(2): 1.0, F(3): 1.0, B(3): 20.0}
    return steps, lambda action, rank: cost[action]


def test_timings_model_when_each_transport_posts():
    """NCCL posts rank 0's receive of g only once its send of a completed (rank 1 is busy
    until 10), so rank 2's next step starts at 10; gloo posted that receive a step ahead
    and slack never delays it: rank 2 goes on at 1; rendezvous holds rank 2's step until
    rank 0 reaches its receive (10)."""
    steps, cost = _three_ranks()
    ends = {t: replay(steps, cost, timing=t).makespan for t in TIMINGS}
    assert ends == {"rendezvous": 30.0, "nccl": 30.0, "slack": 21.0, "gloo": 21.0}
    assert replay(steps, cost, send_slack=1).makespan == ends["slack"]
    with pytest.raises(ValueError, match="give one of them"):
        replay(steps, cost, send_slack=1, timing="nccl")
    with pytest.raises(ValueError, match="unknown timing"):
        replay(steps, cost, timing="links")


def test_a_rank_ends_once_its_last_sends_completed():
    """The executor finishes a rank's last sends before it returns: on NCCL the sender waits
    until the busy receiver posts (at 5); gloo's receiver posted a step ahead (at 0)."""
    a = Message(ACTIVATION, 0, 0, 0, 0, 1)
    steps = [[Step((), (), (F(0),)), Step((a,), (), ())],
             [Step((), (), (F(1),)), Step((), (a,), (F(2),))]]
    cost = {F(0): 1.0, F(1): 5.0, F(2): 1.0}
    nccl = replay(steps, lambda action, rank: cost[action], timing="nccl")
    assert [(w.start, w.end, w.step) for w in nccl.waits[0]] == [(1.0, 5.0, 2)]
    gloo = replay(steps, lambda action, rank: cost[action], timing="gloo")
    assert gloo.waits[0] == [] and gloo.makespan == nccl.makespan == 6.0


@pytest.mark.parametrize("p,m,k,v,name", [(4, 6, 2, 1, "1f1b"), (3, 5, 2, 1, "zb-h1"),
                                          (2, 4, 2, 2, "1f1b"), (3, 5, 1, 1, "zb-h2")])
def test_timings_order_on_built_schedules(p, m, k, v, name):
    """Slack waits least, rendezvous most; NCCL's post-after-sends lies between them and
    gloo's receives posted ahead never make it slower than NCCL."""
    steps = _builder(p, k, v, name)(m)
    rnd = random.Random(p * 100 + m)
    table = {}

    def cost(action, rank):
        return table.setdefault((action.kind, action.segment, action.chunk, rank),
                                rnd.uniform(0.3, 3.0))

    got = {t: replay(steps, cost, 0.1, timing=t).makespan for t in TIMINGS}
    assert got["slack"] <= got["nccl"] + 1e-9 <= got["rendezvous"] + 2e-9
    assert got["gloo"] <= got["nccl"] + 1e-9


# ------------------------------------------------------------------ steps


STEP_GRID = [(p, k, v) for p in (2, 4) for k in (1, 3) for v in (1, 2)]
if FULL:
    STEP_GRID = [(p, k, v) for p in (2, 3, 4, 5, 8) for k in (1, 2, 3, 4, 5) for v in (1, 2, 3)]


@pytest.mark.parametrize("p,k,v", STEP_GRID)
def test_repeated_steps_equal_built_ones(p, k, v):
    """1F1B's and the interleaved plans of any count are the small count's with copies of
    the block: the executor's steps (:func:`steady.executor_plan`) equal the whole build's."""
    per = steady.period(p, k, v)
    for rest in ((0, 1) if per > 1 else (0,)):
        m = 60 * per + rest
        periodic = steady.executor_plan(p, m, k, v)
        assert periodic is not None, (p, k, v, rest)
        for copies in (range(0, 9) if FULL else (4, 7)):
            count = periodic.base + copies * periodic.period
            assert periodic.items(copies) == steady.whole_plan(p, count, k, v), (p, k, v, count)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_zero_bubble_with_equal_costs_repeats_what_the_scheduler_builds(name):
    costs = ((1.0, 1.0, 1.0),) * 2
    periodic = steady.executor_plan(4, 40, 2, 1, name, costs)
    for copies in (3, 9):
        count = periodic.base + copies * periodic.period
        assert periodic.items(copies) == steady.whole_plan(4, count, 2, 1, name, costs)


def test_zero_bubble_repeats_the_small_counts_pattern_and_stays_valid():
    """With uneven costs the list scheduler drifts between two placements of W for a dozen
    micro-batches before it settles: the executor runs (and the planner predicts) the small
    count's pattern repeated, which passes every check a plan built whole passes."""
    from megatron_seq1f1b.schedules.validate import check_units

    costs = UNEVEN[3]
    periodic = steady.executor_plan(2, 40, 3, 1, "zb-h1", costs)
    steps = periodic.items(30)
    count = periodic.base + 30 * periodic.period
    check_units([[a for step in rank for a in step.actions] for rank in steps], count, 3, 1)
    steady.check_plan(steps)
    assert steps != steady.whole_plan(2, count, 3, 1, "zb-h1", costs)  # the drift


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_a_late_cut_rolls_back_to_the_same_steps_with_a_short_prefix(name):
    """A placement cut late (its prefix holds copies of its block) is rolled back to the
    earliest base the floor allows: the same steps for every count from the late base on,
    and, with the prefix shorter, a makespan from fewer steps equal to the whole replay."""
    found = steady.executor_plan(2, 40, 3, 1, name, UNEVEN[3])
    per, sizes = found.period, [len(block) for block in found.blocks]
    late = steady.Periodic(found.base + 3 * per, per, found.items(3),
                           [cut + 3 * size for cut, size in zip(found.prefix, sizes)],
                           [[steady.shift_step(s, 3 * per) for s in block]
                            for block in found.blocks])
    back = steady._rolled_back(late, found.base)
    assert (back.base, back.prefix) == (found.base, found.prefix)
    for copies in (0, 2, 5):
        assert back.items(copies + 3) == late.items(copies) == found.items(copies + 3)
    assert steady._rolled_back(late, found.base + 2 * per).base == found.base + 2 * per
    m = late.base + 40 * per
    cost = _costs("segments", 5)
    assert steady.steady_makespan(back, m, cost, 0.1, "nccl") == pytest.approx(
        replay(late.items(late.copies(m)), cost, 0.1, timing="nccl").makespan, rel=1e-12)


def test_late_starts_double_while_their_builds_stay_within_a_quarter_of_the_count():
    assert steady._late_starts(6, 1, 40) == [0, 1, 2, 4, 8, 16]
    assert steady._late_starts(6, 1, 256) == [0, 1, 2, 4, 8, 16, 32]
    assert steady._late_starts(6, 1, 1024) == [0, 1, 2, 4, 8, 16, 32, 64, 128]
    assert steady._late_starts(6, 2, 256) == [0, 1, 2, 4, 8, 16]


@pytest.mark.skipif(not FULL, reason="256 micro-batches at 32 stages: SEQ1F1B_FULL=1")
def test_a_placement_that_settles_after_thirty_microbatches_is_repeated_and_timed_exactly():
    """pp 32, k 25 (Llama-3-8B-like FLOP costs): the W placement cuts from 32 micro-batches on
    only. The late starts find it (before: built whole, 10 s here); the repeated plan (which,
    as the executor's for any late settler, is not the whole build's: that one drifts again
    later) passes the executor's checks, and its extended makespan is its full replay's."""
    from megatron_seq1f1b.bench.plan_cost import llama_costs
    from megatron_seq1f1b.planner.costs import CostModel, action_cost_table, placement_costs
    from megatron_seq1f1b.schedules.partition import split_sequence
    from megatron_seq1f1b.schedules.validate import check_units

    args, config, calibration = llama_costs(["--pp", "32", "--microbatches", "256"], 32)
    flops = CostModel.from_config(config, args.vocab_size, False)
    lengths = tuple(split_sequence(32768, 25, "balanced", cost=flops))
    costs = placement_costs(calibration, lengths, 32)
    periodic = steady.executor_plan(32, 256, 25, 1, "zb-h1", costs)
    assert periodic is not None and periodic.base > 6 + steady.LONGER_PERIODS_UNTIL
    steps = periodic.items(periodic.copies(256))
    actions = [[a for step in rank for a in step.actions] for rank in steps]
    check_units(actions, 256, 25, 1)
    steady.check_plan(steps)
    cost = cand.table_cost(action_cost_table(calibration, lengths, 32, 1, True), 32)
    assert steady.steady_makespan(periodic, 256, cost, 0.0, "nccl") == pytest.approx(
        replay(steps, cost, timing="nccl").makespan, rel=1e-12)


@pytest.mark.parametrize("p,k,v,name", [(4, 2, 1, "1f1b"), (3, 1, 2, "1f1b"),
                                        (4, 3, 1, "zb-h1"), (3, 2, 1, "zb-h2")])
def test_message_ends_placed_by_index_equal_the_built_steps(p, k, v, name):
    from megatron_seq1f1b.schedules.replay import message_partners

    periodic = steady.executor_plan(p, 80 * steady.period(p, k, v), k, v, name,
                                    UNEVEN[k] if name != "1f1b" else None)
    layout = periodic.layout()
    assert layout.rules is not None
    for copies in (layout.template, layout.template + 3):
        assert layout.partners(copies) == message_partners(periodic.items(copies))


def test_too_few_microbatches_have_no_periodic_form():
    assert steady.executor_plan(4, 5, 2, 1) is None  # warm-up and cool-down only


def test_executor_steps_repeat_and_are_built_on_small_counts(monkeypatch):
    """pipeline_steps gives the executor's plan, builds no count near m, and rank_steps gives
    its rank's part."""
    built = []
    original, build = steady.whole_plan, steady.build_schedule

    def recording(num_stages, num_microbatches, *rest, **kw):
        built.append(num_microbatches)
        return build(num_stages, num_microbatches, *rest, **kw)

    monkeypatch.setattr(steady, "build_schedule", recording)
    steady.executor_plan.cache_clear()
    for args in [(4, 37, 3, 1, False, "1f1b", None), (4, 38, 3, 2, False, "1f1b", None),
                 (3, 25, 2, 1, False, "zb-h2", UNEVEN[2]), (4, 21, 2, 1, True, "1f1b", None)]:
        built.clear()
        steps = executor_setup.pipeline_steps(*args)
        assert max(built) < 20, (args, built)
        p, m, k, v, forward_only, name, costs = args
        periodic = steady.executor_plan(p, m, k, v, name, costs, forward_only)
        assert steps == tuple(tuple(r) for r in periodic.items(periodic.copies(m)))
        if costs is None:
            assert steps == tuple(tuple(r) for r in original(p, m, k, v, name, costs,
                                                             forward_only))
        assert executor_setup.rank_steps(*args[:5], 1, *args[5:]) == steps[1]
    steady.executor_plan.cache_clear()


# ------------------------------------------------------------------ makespan


TIME_GRID = [(4, 1, 1, "1f1b"), (4, 3, 1, "zb-h1"), (3, 2, 2, "1f1b"), (3, 2, 1, "zb-h2"),
             (2, 1, 2, "zb-h1")]
if FULL:
    TIME_GRID = [(p, k, v, name) for p in (2, 3, 4, 6) for k in (1, 2, 3) for v in (1, 2)
                 for name in ("1f1b", "zb-h1", "zb-h2") if not (v > 1 and name == "zb-h2")]


def _costs(kind: str, seed: int):
    """uniform: F 1, B 2 (W 1 of it); segments: attention-like growth along the sequence
    and a heavier first stage; random: any positive number per (kind, segment, chunk, rank)."""
    rnd = random.Random(seed)
    table = {}

    def cost(action, rank):
        if kind == "uniform":
            return {"F": 1.0, "B": 1.0, "W": 1.0}[action.kind]
        if kind == "segments":
            base = (1.0 + 0.4 * action.segment) * (1.3 if rank == 0 else 1.0)
            return base * {"F": 1.0, "B": 1.2, "W": 0.8}[action.kind]
        return table.setdefault((action.kind, action.segment, action.chunk, rank),
                                rnd.choice([0.5, 1.0, 1.7, 2.3]))
    return cost


@pytest.mark.parametrize("p,k,v,name", TIME_GRID)
def test_extended_makespan_equals_the_full_replay(p, k, v, name):
    m = 48 * steady.period(p, k, v) + 1  # well past the copies replayed before extending
    periodic = steady.executor_plan(p, m, k, v, name, UNEVEN[k] if name != "1f1b" else None)
    assert periodic is not None
    whole = periodic.items(periodic.copies(m))  # what the executor runs
    found = 0
    for kind in ("uniform", "segments", "random"):
        cost = _costs(kind, p * 7 + k)
        for timing in (TIMINGS if FULL else ("nccl", "gloo", "slack")):
            for latency in ((0.0, 0.25) if FULL else (0.1,)):
                got = steady.steady_makespan(periodic, m, cost, latency, timing)
                found += 1
                assert got == pytest.approx(replay(whole, cost, latency, timing=timing).makespan,
                                            rel=1e-12), (kind, timing, latency)
    assert found >= 2


# ------------------------------------------------------------------ the planner


CONFIG = SimpleNamespace(hidden_size=1024, num_layers=8, num_attention_heads=8, kv_channels=None,
                         num_query_groups=None, ffn_hidden_size=4096, gated_linear_unit=False)
SHAPE = ModelShape(num_layers=8, hidden_size=1024, num_attention_heads=8, vocab_size=32000)
MEMORY = MemoryModel(SHAPE, Training(dtype="bf16"))

PLAN_GRID = [  # (p, m, v, max k, attention, budget)
    (4, 40, 1, 4, True, None), (4, 44, 2, 3, True, "activations"), (2, 37, 1, 4, False, "total"),
]
if FULL:
    PLAN_GRID = [(p, m, v, kk, attention, budget) for p, m, v in
                 ((2, 37, 1), (8, 41, 1), (4, 40, 1), (4, 44, 2), (2, 47, 2), (8, 45, 1))
                 for kk in (3, 5) for attention in (True, False)
                 for budget in (None, "activations", "total")]


def _budget(p, m, v, max_k, attention, budget):
    """A budget half the candidates fit (their median memory)."""
    if budget is None:
        return {}
    every = _plan(p, m, v, max_k, attention, None, exhaustive=True).candidates
    if budget == "activations":
        return {"memory_budget": sorted(c.memory for c in every)[len(every) // 2]}
    return {"memory_budget_total_bytes": sorted(c.peak_stage_bytes for c in every)[len(every) // 2]}


def _plan(p, m, v, max_k, attention, budget, **kw):
    config = CONFIG if attention else SimpleNamespace(**{**vars(CONFIG), "num_layers": 8})
    kwargs = dict(num_model_chunks=v, config=config, vocab_size=32000,
                  dense_attention=False, min_segment_length=64, max_splits=max_k,
                  memory_model=MEMORY, **kw)
    if not attention:  # every segment costs the same: the linear layers only
        from megatron_seq1f1b.planner.costs import Calibration
        from megatron_seq1f1b.schedules.partition import CostModel

        kwargs["calibration"] = Calibration.from_cost_model(CostModel(1.0, 0.0), p * v)
    return choose_plan(4096, p, m, **kwargs, **(budget or {}))


def _whole(monkeypatch):
    """The planner with its shortcuts off: every micro-batch of the executor's plan replayed,
    and its memory counted on all of them."""
    def every_microbatch(periodic, m, cost, latency=0.0, timing="rendezvous", **kw):
        return replay(periodic.items(periodic.copies(m)), cost, latency, timing=timing).makespan

    def memory(p, m, k, v, name, costs):
        periodic = cand._periodic_schedule_steps(p, m, k, v, name, costs)
        if isinstance(periodic, steady.Periodic):
            steps = periodic.items(periodic.copies(m))
            return [[a for step in rank for a in step.actions] for rank in steps]
        return cand.full_schedule(p, m, k, v, name, costs)

    monkeypatch.setattr(cand, "steady_makespan", every_microbatch)
    monkeypatch.setattr(cand, "memory_schedule", memory)
    cand.clear_caches()


def _answer(choice):
    rows = sorted((c.num_splits, c.partition, c.schedule, c.lengths, c.time, c.bubble,
                   c.memory, c.within_budget, c.peak_stage_bytes) for c in choice.candidates)
    return choice.plan, rows


@pytest.mark.parametrize("p,m,v,max_k,attention,budget", PLAN_GRID)
def test_planner_answers_as_full_simulation(p, m, v, max_k, attention, budget, monkeypatch):
    cand.clear_caches()
    budget = _budget(p, m, v, max_k, attention, budget)
    shortcut = _plan(p, m, v, max_k, attention, budget, exhaustive=True)
    pruned = _plan(p, m, v, max_k, attention, budget, tie_tolerance=0.02)
    tolerant = _plan(p, m, v, max_k, attention, budget, tie_tolerance=0.02, exhaustive=True)
    with monkeypatch.context() as patch:
        _whole(patch)
        whole = _plan(p, m, v, max_k, attention, budget, exhaustive=True)
    cand.clear_caches()
    (plan, rows), (plan_whole, rows_whole) = _answer(shortcut), _answer(whole)
    assert (plan.num_splits, plan.partition, plan.schedule) == \
        (plan_whole.num_splits, plan_whole.partition, plan_whole.schedule)
    assert len(rows) == len(rows_whole)
    for got, want in zip(rows, rows_whole):
        assert got[:4] == want[:4] and got[7] == want[7]
        assert got[4:7] == pytest.approx(want[4:7], rel=1e-9)
        assert got[8] == pytest.approx(want[8], rel=1e-9)
    # pruning by bounds and memory picks what timing everything picks
    assert pruned.plan == tolerant.plan and pruned.untimed > 0



@pytest.mark.parametrize("schedules", [None, ["1f1b"]])
def test_few_microbatches_time_1f1bs_least_bound_first_and_leave_hopeless_robust_plans(
        schedules):
    """p 8, m 8: one segment idles most of the pipeline, so the most robust plan (k=1) cannot
    come within the tolerance of 1F1B's least bound, timed first: it goes untimed, and the
    answer is the one timing everything gives."""
    pruned = _plan(8, 8, 1, 8, True, None, tie_tolerance=0.02, schedules=schedules)
    every = _plan(8, 8, 1, 8, True, None, tie_tolerance=0.02, schedules=schedules,
                  exhaustive=True)
    assert pruned.plan == every.plan
    assert all(c.num_splits > 1 for c in pruned.candidates) and pruned.untimed > 0


BOUND_GRID = [(p, m, k, v, name) for p, m, v in ((2, 5, 1), (4, 9, 1), (4, 30, 2), (8, 12, 1))
              for k in (1, 3, 4) for name in ("1f1b", "zb-h1", "zb-h2")
              if not (v > 1 and name == "zb-h2")]


@pytest.mark.parametrize("p,m,k,v,name", BOUND_GRID)
def test_lower_bounds_hold_and_the_orders_bound_is_tighter(p, m, k, v, name):
    """The search skips a candidate whose bound loses, so no bound may exceed the time it
    predicts (every transport's timing, messages free or not); the orders' bound sees the
    stalls of uneven segments (a uniform cut of attention-heavy work) that the first one
    misses, and with zero bubble's cap the forwards that wait for a W."""
    from megatron_seq1f1b.planner.costs import (
        Calibration, action_cost_table, placement_costs,
    )
    from megatron_seq1f1b.planner.order_bound import order_lower_bound
    from megatron_seq1f1b.schedules.partition import CostModel, split_sequence
    from megatron_seq1f1b.schedules.schedule import forward_backward_orders

    calibration = Calibration.from_cost_model(CostModel(1.0, 0.002), p * v)
    lengths = tuple(split_sequence(2048, k, "uniform"))
    zero_bubble = name != "1f1b"
    table = action_cost_table(calibration, lengths, p, v, zero_bubble)
    costs = placement_costs(calibration, lengths, p * v) if zero_bubble else None
    first = cand.time_lower_bound(table, p, m, zero_bubble)
    orders, cap = forward_backward_orders(p, m, k, v, name)
    sharp = cand.order_graph(p, m, k, v, name).bound(table)
    uncapped = order_lower_bound(orders, table, p)
    assert sharp == order_lower_bound(orders, table, p, cap if zero_bubble else None)
    assert sharp >= uncapped >= first * (1 - 1e-12)
    for timing in TIMINGS:
        for latency in (0.0, 30.0):
            time = cand.predict_time(p, m, k, v, name, costs, cand.table_cost(table, p),
                                     latency, timing)
            assert time is not None and sharp <= time * (1 + 1e-12), (timing, latency)
    if v == 1 and k > 1:
        assert sharp > 1.02 * first
    if name == "zb-h1" and (p, k) in ((2, 3), (4, 4)):  # the cap: a forward waits for a W
        assert sharp > 1.01 * uncapped


def test_planner_shortcut_is_used_and_its_cost_does_not_grow_with_m(monkeypatch):
    """At many micro-batches no schedule of that many is built: only a few small counts."""
    counts = []
    original = cand.build_schedule

    def recording(p, m, *a, **kw):
        counts.append(m)
        return original(p, m, *a, **kw)

    monkeypatch.setattr(cand, "build_schedule", recording)
    cand.clear_caches()
    choice = _plan(4, 1000, 1, 4, True, {"memory_budget_total_bytes": 2 * GIB})
    assert choice.plan.num_splits >= 1 and max(counts) < 20
    cand.clear_caches()


def test_the_extension_is_what_is_checked(monkeypatch):
    """At many micro-batches the replay stops at a few copies and extends: the replays it runs
    hold far fewer copies than the target, and the answer equals the whole replay's."""
    periodic = steady.executor_plan(4, 400, 2, 1)
    sizes = []
    original = steady.replay_times

    def recording(steps, *a, partners=None, **kw):
        sizes.append(sum(len(rank) for rank in partners[0]))
        return original(steps, *a, partners=partners, **kw)

    monkeypatch.setattr(steady, "replay_times", recording)
    cost = _costs("segments", 3)
    got = steady.steady_makespan(periodic, 400, cost, 0.1, "nccl")
    whole = periodic.items(periodic.copies(400))
    assert max(sizes) < sum(len(rank) for rank in whole) / 10
    assert got == pytest.approx(replay(whole, cost, 0.1, timing="nccl").makespan, rel=1e-12)


def test_plan_cost_benchmark_runs_and_counts_what_it_timed(capsys):
    from megatron_seq1f1b.bench import plan_cost

    (result,) = plan_cost.main(["--pp", "4", "--microbatches", "32", "--vpp", "1",
                                "--zero-bubble", "off", "--max-splits", "4"])
    assert result["candidates"] == 7 and 1 <= result["timed"] <= 7  # k=1 once, k 2..4 twice
    assert result["steps"] > 0 and all(x >= 0 for x in result["choose_plan"])
    assert result["timing"] == "nccl"
    assert plan_cost.row(result) in capsys.readouterr().out
    # another transport's timing reaches the plan: receives posted a step ahead (gloo) let
    # zb-h2 run at its dataflow, and it wins where NCCL's posting makes zb-h1 the fastest
    nccl, gloo = (plan_cost.measure(4, 8, 4, 1, True, timing) for timing in (None, "gloo"))
    assert (nccl["timing"], gloo["timing"]) == ("nccl", "gloo")
    assert "zb-h1" in nccl["chosen"] and "zb-h2" in gloo["chosen"]
    assert gloo["time"] < nccl["time"]


@pytest.mark.skipif(not FULL, reason="a timing: SEQ1F1B_FULL=1")
def test_auto_plans_pp8_m256_in_under_two_seconds():
    """What --seq1f1b-splits auto adds to its measurement at pp 8, m 256: choose_plan on a
    calibration like a measured one (host floors, message time), as auto calls it."""
    import time

    from megatron_seq1f1b.planner.choice import TIE_TOLERANCE
    from megatron_seq1f1b.planner.costs import Calibration, Fit
    from megatron_seq1f1b.schedules.partition import CostModel

    model = CostModel.from_config(CONFIG, 32000)
    calibration = Calibration.from_cost_model(model, 8, flop_rate=100e12, host_seconds=2e-3)
    calibration = calibration.__class__(**{**calibration.__dict__,
                                           "message": Fit(2e-10, 0.0, 5e-5)})
    cand.clear_caches()
    start = time.process_time()
    choose_plan(4096, 8, 256, calibration=calibration, config=CONFIG, vocab_size=32000,
                min_segment_length=128, tie_tolerance=TIE_TOLERANCE, timing="nccl")
    assert time.process_time() - start < 2.0
    cand.clear_caches()


def test_transport_gap_separates_the_bounds_from_every_transport(capsys):
    """bench/transport_gap (docs/benchmarks.md, "Third pass"): the orders' bound is at most the
    placed plan's dataflow, which no transport's replay beats."""
    from megatron_seq1f1b.bench import transport_gap

    results = transport_gap.main(["--pp", "4", "--microbatches", "8", "--splits", "3",
                                  "--schedules", "zb-h2", "1f1b"])
    assert [r["schedule"] for r in results] == ["zb-h2", "1f1b"]
    out = capsys.readouterr().out
    for result in results:
        bound, dataflow, *times = result["values"]
        assert bound <= dataflow * (1 + 1e-9) and dataflow <= min(times) * (1 + 1e-9)
        assert transport_gap.row(result) in out
    assert results[1]["values"][0] == pytest.approx(results[1]["values"][-1])  # 1F1B: exact
