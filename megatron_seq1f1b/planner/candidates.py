"""One candidate of the planner's search, predicted as cheaply as its answer allows.

Three answers, cheapest first, none of them growing with the number of micro-batches
where the schedule has a steady state (:mod:`megatron_seq1f1b.schedules.steady`):

* :func:`time_lower_bound`: no schedule can beat its busiest rank's work plus the time
  its first input takes to reach it and its last gradient to leave it; the search skips a
  candidate whose bound already loses;
* :func:`schedule_memory`: peak activations counted on one copy of the steady state;
  zero bubble holds every unit at least as long as 1F1B does (same F/B order, released
  only at W), so 1F1B's memory is a floor for it, known without building it;
* :func:`predict_time`: the executor's steps replayed over a few copies of the steady
  state and extended exactly, or replayed whole where there is none.

The schedules, their steps and their periodic forms are kept in small caches keyed by
their configuration (the sizes, the schedule and its placement costs): a search reuses one
1F1B schedule for every partition of a ``k``.
"""

from __future__ import annotations

import functools

from megatron_seq1f1b.planner.order_bound import OrderGraph
from megatron_seq1f1b.schedules.replay import ScheduleError, message_partners, replay_times
from megatron_seq1f1b.schedules.schedule import (
    Action, Schedule, build_schedule, forward_backward_orders,
)
from megatron_seq1f1b.schedules.steady import (
    Periodic, check_plan, executor_plan, periodic_actions, steady_makespan, whole_plan,
)

__all__ = ["CostTable", "time_lower_bound", "busy_time", "memory_schedule",
           "predict_time", "order_graph", "clear_caches"]

#: ``{(virtual stage, segment): {"F": .., "B": .., "W": ..}}`` (:func:`~.costs.action_cost_table`)
CostTable = dict

Costs = tuple | None  # a zero-bubble schedule's placement costs, per segment (F, B, W)


def busy_time(table: CostTable, num_stages: int, num_microbatches: int) -> list[float]:
    """Each rank's compute time: every unit of every micro-batch once."""
    work = [0.0] * num_stages
    for (virtual, _), cost in table.items():
        work[virtual % num_stages] += cost["F"] + cost["B"] + cost["W"]
    return [num_microbatches * w for w in work]


def time_lower_bound(table: CostTable, num_stages: int, num_microbatches: int,
                     split_backward: bool) -> float:
    """No schedule of these costs ends sooner: for some rank, the first forward's chain
    through the stages before it (its first action needs that input), all of its work, and
    (without W) the last backward's chain back to the first stage (its last action is the
    backward of micro-batch ``m - 1``'s first segment on chunk 0, which the stages before it
    must then pass on). Messages cost nothing here, so it holds for every timing."""
    p = num_stages
    busy = busy_time(table, p, num_microbatches)
    bound, head, tail = 0.0, 0.0, 0.0
    for rank in range(p):
        bound = max(bound, head + busy[rank] + (0.0 if split_backward else tail))
        head += table[rank, 0]["F"]
        tail += table[rank, 0]["B"]
    return bound


# ------------------------------------------------------------------ schedules, cached


@functools.lru_cache(maxsize=8)
def full_schedule(p: int, m: int, k: int, v: int, name: str, costs: Costs) -> Schedule:
    return build_schedule(p, m, k, v, schedule=name, costs=costs)


@functools.lru_cache(maxsize=8)
def full_steps(p: int, m: int, k: int, v: int, name: str, costs: Costs) -> tuple[list, tuple]:
    """The executor's steps built whole (checked as it checks them), and their messages'
    partners (:func:`message_partners`: the check and the timing share them)."""
    steps = whole_plan(p, m, k, v, name, costs, check=False)
    partners = message_partners(steps)
    if costs is not None:
        check_plan(steps, partners)
    return steps, partners


@functools.lru_cache(maxsize=8)
def order_graph(p: int, m: int, k: int, v: int, name: str) -> OrderGraph:
    """The dataflow of ``name``'s forward/backward orders (with zero bubble's cap): what
    the orders' bound reads, the same for every partition of a ``k``."""
    orders, cap = forward_backward_orders(p, m, k, v, name)
    return OrderGraph(orders, p, cap if name != "1f1b" else None)


def periodic_schedule_steps(p: int, m: int, k: int, v: int, name: str,
                            costs: Costs) -> Periodic | None:
    """The executor's steps of ``m`` micro-batches in periodic form
    (:func:`~megatron_seq1f1b.schedules.steady.executor_plan`: what it runs; None: no steady
    state); ScheduleError where the executor would refuse them."""
    found = _periodic_schedule_steps(p, m, k, v, name, costs)
    if isinstance(found, ScheduleError):
        raise found
    return found


@functools.lru_cache(maxsize=64)
def _periodic_schedule_steps(p, m, k, v, name, costs) -> Periodic | ScheduleError | None:
    try:
        return executor_plan(p, m, k, v, name, costs)
    except ScheduleError as exc:  # kept, so that asking again does not build again
        return exc


@functools.lru_cache(maxsize=64)
def _periodic_actions(p: int, m: int, k: int, v: int, name: str) -> Periodic | None:
    return periodic_actions(lambda count: build_schedule(p, count, k, v, schedule=name),
                            p, m, k, v, name)


@functools.lru_cache(maxsize=64)
def memory_schedule(p: int, m: int, k: int, v: int, name: str, costs: Costs) -> Schedule:
    """Action lists with the same peak memory per rank as ``m`` micro-batches': one copy of
    the steady state where there is one (its blocks release what they forward), else all."""
    if name == "1f1b":
        periodic = _periodic_actions(p, m, k, v, name)
        if periodic is not None:
            return periodic.items(1)
    else:
        periodic = _periodic_schedule_steps(p, m, k, v, name, costs)
        if isinstance(periodic, Periodic):
            return [[a for step in rank for a in step.actions] for rank in periodic.items(1)]
        if periodic is None:  # built whole, as its timing builds it: not twice
            try:
                return [[a for step in rank for a in step.actions]
                        for rank in full_steps(p, m, k, v, name, costs)[0]]
            except ScheduleError:
                pass
    return full_schedule(p, m, k, v, name, costs)


def predict_time(p: int, m: int, k: int, v: int, name: str, costs: Costs,
                 action_cost, comm_latency: float = 0.0, timing: str = "nccl") -> float | None:
    """The makespan of the executor's steps (zero bubble placed with ``costs``) replayed with
    ``action_cost(action, rank)`` (independent of the micro-batch), or None where the
    executor would refuse them (deadlock, link order)."""
    try:
        periodic = periodic_schedule_steps(p, m, k, v, name, costs)
        if periodic is not None:
            return steady_makespan(periodic, m, action_cost, comm_latency, timing)
        steps, partners = full_steps(p, m, k, v, name, costs)
        return max(replay_times(steps, action_cost, comm_latency, timing=timing,
                                partners=partners).end)
    except ScheduleError:
        return None


_CACHES = (order_graph, full_schedule, full_steps, _periodic_schedule_steps,
           _periodic_actions, memory_schedule, executor_plan)


def clear_caches() -> None:
    """Forget every cached schedule (tests; long-lived processes planning many shapes)."""
    for cached in _CACHES:
        cached.cache_clear()


def table_cost(table: CostTable, num_stages: int):
    """cost(action, rank) from a :data:`CostTable`."""
    def cost(action: Action, rank: int) -> float:
        return table[action.chunk * num_stages + rank, action.segment][action.kind]
    return cost
