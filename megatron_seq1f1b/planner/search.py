"""The planner's search: every (k, partition, schedule) predicted as the executor would run
it, and the fastest within the memory budget chosen (:func:`choose_plan`).

Time is what the executor would do: the zero-bubble schedules are built and
their receives placed from the plan's per-segment costs
(:attr:`Plan.segment_costs`, as the executor's ``pipeline_steps`` does with
its costs), and every rank's steps are replayed with rendezvous messages
whose sends finish a step later (``send_slack=1``, what the executor's
transports do on gloo and NCCL, see :mod:`megatron_seq1f1b.runtime.p2p`; 0 models a
step that waits for all its transfers, as ``SEQ1F1B_P2P=batch`` on NCCL and
Megatron's own schedules do), a step that exchanges tensors paying the
calibration's message time. Plans the executor would refuse (deadlock, link
order) are left out.
"""

from __future__ import annotations

import math

from dataclasses import replace
from typing import Sequence

from megatron_seq1f1b.base.checks import segment_multiple
from megatron_seq1f1b.planner.choice import (
    Plan, PlanChoice, BudgetError, _memory_key, _pick, _rank_key, explain, need_text,
)
from megatron_seq1f1b.planner.costs import Calibration, action_cost, placement_costs
from megatron_seq1f1b.planner.memory_model import MemoryModel, activation_peak, bytes_text
from megatron_seq1f1b.schedules.partition import METHODS, CostModel, split_sequence
from megatron_seq1f1b.schedules.plan import plan_steps
from megatron_seq1f1b.schedules.replay import replay
from megatron_seq1f1b.schedules.schedule import SCHEDULES, Schedule, ScheduleError, build_schedule
from megatron_seq1f1b.schedules.simulate import CostFn
from megatron_seq1f1b.schedules.validate import check_link_order
from megatron_seq1f1b.schedules.zero_bubble import segment_cost_fn

#: The replay's ``send_slack`` of the executor's transports (gloo; NCCL's links transport).
RUNTIME_SEND_SLACK = 1

__all__ = ["RUNTIME_SEND_SLACK", "MAX_SPLITS", "predict", "split_counts", "choose_plan"]


def predict(schedule: Schedule, num_model_chunks: int, cost: CostFn,
            costs: Sequence[tuple[float, float, float]] | None = None,
            send_slack: int = 0, comm_latency: float = 0.0) -> tuple[float, float]:
    """(makespan, bubble) of the executor's steps: receives placed with ``costs`` (zero
    bubble) or unit costs, replayed with ``cost`` and ``comm_latency`` per exchanging
    step; ScheduleError where it would refuse."""
    steps = plan_steps(schedule, num_model_chunks,
                       cost=segment_cost_fn(costs) if costs is not None else None)
    if costs is not None:
        check_link_order(steps)
    timeline = replay(steps, cost, comm_latency=comm_latency, send_slack=send_slack)
    busy = sum(iv.end - iv.start for rank in timeline.compute for iv in rank)
    total = timeline.makespan * len(schedule)
    return timeline.makespan, (1.0 - busy / total if total else 0.0)



MAX_SPLITS = 16  # the most segments a plan tries (and the start-up measurement times)


def split_counts(seq_length: int, multiple_of: int, min_segment_length: int,
                 max_splits: int = MAX_SPLITS) -> list[int]:
    """The k a plan may use: 1 up to the most whose segments keep min_segment_length."""
    limit = min(max_splits, seq_length // max(min_segment_length, 1), seq_length // multiple_of)
    return list(range(1, max(limit, 1) + 1))


def choose_plan(
    seq_length: int,
    num_stages: int,
    num_microbatches: int,
    *,
    num_model_chunks: int = 1,
    micro_batch_size: int = 1,
    calibration: Calibration | None = None,
    config=None,
    vocab_size: int | None = None,
    dense_attention: bool = False,
    cost_model: CostModel | None = None,
    memory_budget: float | None = None,
    memory_budget_bytes: float | None = None,
    bytes_per_token: float | None = None,
    min_segment_length: int = 128,
    max_splits: int = MAX_SPLITS,
    multiple_of: int | None = None,
    splits: Sequence[int] | None = None,
    partitions: Sequence[str] | None = None,
    schedules: Sequence[str] | None = None,
    send_slack: int = RUNTIME_SEND_SLACK,
    tie_tolerance: float = 0.0,
    memory_model: MemoryModel | None = None,
    memory_budget_total_bytes: float | None = None,
    documents=None,
    context_parallel_size: int = 1,
) -> PlanChoice:
    """The fastest (k, partition, schedule) within the memory budget, and all candidates.

    Costs from ``calibration``, else the FLOP model (``cost_model``, or from
    ``config`` + ``vocab_size``), which the ``"balanced"`` partition needs
    too. ``memory_budget``: peak activations per stage in micro-batches of a
    stage; ``memory_budget_bytes`` needs ``bytes_per_token`` (activation bytes
    one token of one sample leaves on a stage; default: the calibration's). ``k`` runs from 1 to the
    largest with segments of at least ``min_segment_length`` tokens (at most
    ``max_splits``), or over ``splits``. ``send_slack``: 1, the executor's
    transports (0: steps that wait for their sends; see the module docstring). Deterministic: ties go to less
    memory, fewer splits, then METHODS and SCHEDULES order. ``tie_tolerance``
    (relative; default 0, the exact fastest; the command line, the start-up measurement and
    the benchmark pass :data:`~megatron_seq1f1b.planner.choice.TIE_TOLERANCE`, 2 %, for
    measured and FLOP costs alike): plans
    predicted within it of the fastest count as equally fast, and the one
    that leans least on the cost model wins (1F1B over zero bubble, then the
    balanced, measured, uniform partition, then the fewest splits). Raises
    :class:`BudgetError` if nothing fits. ``memory_model``: every candidate also gets
    each stage's total bytes (:attr:`Plan.stages`); ``memory_budget_total_bytes`` (needs
    it) bounds the busiest stage's total. ``documents``: a packed micro-batch
    (:class:`~megatron_seq1f1b.segments.documents.Documents`, e.g. the one measured): every
    candidate's attention costs count pairs within its documents, its memory follows
    them, and the ``"documents"`` partition (cut by them) is a candidate too.
    ``context_parallel_size``: each rank holds ``1 / cp`` of a micro-batch's tokens
    (``bytes_per_token`` is per token a rank holds; the FLOP model's work is split over the
    group); segment lengths divide into ``2 * cp`` chunks.
    """
    if memory_budget_total_bytes is not None and memory_model is None:
        raise ValueError("memory_budget_total_bytes needs memory_model (weights, gradients, "
                         "optimizer states and activations per stage)")
    if not 0 <= tie_tolerance < 1:
        raise ValueError(f"tie_tolerance must be in [0, 1), got {tie_tolerance}")
    p, m, v = num_stages, num_microbatches, num_model_chunks
    if bytes_per_token is None and calibration is not None:
        bytes_per_token = calibration.bytes_per_token
    if v > 1 and p < 2:
        raise ValueError("interleaving (several model chunks) needs num_stages >= 2")
    if memory_budget_bytes is not None and not bytes_per_token:
        raise ValueError("memory_budget_bytes needs bytes_per_token (activation bytes of one "
                         "token of one sample on a stage)")
    flops = cost_model or (CostModel.from_config(config, vocab_size, dense_attention)
                           if config is not None else None)
    if calibration is None:
        if flops is None:
            raise ValueError("choose_plan needs costs: calibration=..., or config=... / "
                             "cost_model=... for FLOPs")
        calibration = Calibration.from_cost_model(flops, p * v,
                                                  context_parallel_size=context_parallel_size)
    if documents is not None:
        calibration = calibration.with_documents(documents)
    partitions, schedules = _options(partitions, schedules, flops is not None, v,
                                     documents is not None)
    multiple = multiple_of or (segment_multiple(config) if config is not None else 1)
    if context_parallel_size > 1:
        multiple = math.lcm(multiple, 2 * context_parallel_size)
    ks = sorted(set(splits)) if splits else split_counts(seq_length, multiple,
                                                         min_segment_length, max_splits)
    costs_of = {"balanced": flops, "measured": calibration,
                "documents": flops or calibration.cost_model()}
    budgets = [name for name, value in (("microbatches", memory_budget),
                                        ("bytes", memory_budget_bytes),
                                        ("total", memory_budget_total_bytes)) if value is not None]
    budgeted = bool(budgets)

    candidates: list[Plan] = []
    for k in ks:
        seen: set[tuple[int, ...]] = set()
        for partition in partitions:
            try:
                lengths = tuple(split_sequence(seq_length, k, partition, multiple_of=multiple,
                                               cost=costs_of.get(partition),
                                               documents=documents))
            except ValueError:  # e.g. a calibration whose cost does not grow with length
                continue
            if lengths in seen or (k > 1 and min(lengths) < min_segment_length):
                continue  # the same split under an earlier name, or segments too short
            seen.add(lengths)
            for name in schedules:
                plan = _evaluate(calibration, p, m, v, partition, lengths, name, send_slack,
                                 memory_model, micro_batch_size, documents)
                if plan is None:
                    continue
                memory_bytes = (plan.memory * seq_length / context_parallel_size
                                * micro_batch_size * bytes_per_token if bytes_per_token else None)
                fits = ((memory_budget is None or plan.memory <= memory_budget + 1e-9)
                        and (memory_budget_bytes is None or memory_bytes <= memory_budget_bytes)
                        and (memory_budget_total_bytes is None
                             or plan.peak_stage_bytes <= memory_budget_total_bytes)
                        ) if budgeted else None
                candidates.append(replace(plan, memory_bytes=memory_bytes, within_budget=fits))
    if not candidates:
        raise ValueError(f"no candidate plan: no split of {seq_length} tokens into segments of "
                         f"at least {min_segment_length} tokens (multiple of {multiple})")
    ranked = tuple(sorted(candidates, key=_rank_key))
    feasible = [c for c in ranked if c.within_budget is not False]
    if not feasible:
        raise _budget_error(ranked, budgets, memory_budget, memory_budget_bytes,
                            memory_budget_total_bytes, max_splits, min_segment_length)
    chosen = _pick(feasible, tie_tolerance)
    return PlanChoice(chosen, ranked, explain(ranked, chosen, tie_tolerance, budgets),
                      calibration.source)


def _budget_error(ranked, budgets, microbatches, activation_bytes, total_bytes, max_splits,
                  min_segment_length) -> BudgetError:
    """Nothing fits: the budgets and the nearest plan, in the budgets' own units (the least
    activations, or with only a total budget the least total on the busiest stage)."""
    activations = (([f"{microbatches:.2f} micro-batches"] if microbatches is not None else [])
                   + ([bytes_text(activation_bytes)] if activation_bytes is not None else []))
    words = ([f"activation-memory budget of {' and '.join(activations)} per stage"]
             if activations else [])
    if total_bytes is not None:
        words.append(f"memory budget of {bytes_text(total_bytes)} per GPU (the busiest stage's "
                     "weights, gradients, optimizer states and activations)")
    smallest = min(ranked, key=_memory_key if activations else
                   lambda plan: (plan.peak_stage_bytes,) + _memory_key(plan))
    return BudgetError(
        f"no plan fits the {' and the '.join(words)}: the smallest reachable is "
        f"{need_text(smallest, budgets)}, by {smallest.describe()} (lengths "
        f"{list(smallest.lengths)})", smallest,
        {"max_splits": max_splits, "min_segment_length": min_segment_length})


def _options(partitions, schedules, have_flops: bool, chunks: int,
             have_documents: bool = False) -> tuple[list, list]:
    """The partitions and schedules to try, in METHODS / SCHEDULES order; asking for one
    that cannot be built is an error (leaving it out silently would hide it)."""
    available = [x for x in METHODS if (x != "balanced" or have_flops)
                 and (x != "documents" or have_documents)]
    allowed = [s for s in SCHEDULES if not (s == "zb-h2" and chunks > 1)]  # ZB_H2_PROBLEM
    for name in partitions or ():
        if name not in available:
            raise ValueError(f"partition {name!r} is not available here; choose from {available}"
                             " ('balanced' needs config= or cost_model=, 'documents' documents=)")
    for name in schedules or ():
        if name not in allowed:
            raise ValueError(f"schedule {name!r} is not available with {chunks} model chunk(s); "
                             f"choose from {allowed}")
    return ([x for x in METHODS if x in (partitions or available)],
            [s for s in SCHEDULES if s in (schedules or allowed)])


def _evaluate(calibration: Calibration, p: int, m: int, v: int, partition: str,
              lengths: tuple[int, ...], name: str, send_slack: int,
              memory_model: MemoryModel | None = None, micro_batch_size: int = 1,
              documents=None) -> Plan | None:
    """One candidate's predicted time, bubble and memory; None if the executor would
    refuse its steps (deadlock, link order)."""
    zero_bubble = name != "1f1b"
    costs = placement_costs(calibration, lengths, p * v) if zero_bubble else None
    schedule = build_schedule(p, m, len(lengths), v, schedule=name, costs=costs)
    try:
        time, bubble = predict(schedule, v, action_cost(calibration, lengths, p, v, zero_bubble),
                               costs, send_slack, calibration.message_latency(lengths))
    except ScheduleError:
        return None
    stages = (tuple(memory_model.stage_bytes(
        schedule, lengths, v, micro_batch_size,
        documents=None if documents is None else [documents]))
        if memory_model is not None else None)
    return Plan(len(lengths), partition, lengths, name, time, bubble,
                activation_peak(schedule, lengths, v), unit=calibration.unit,
                segment_costs=costs, stages=stages)

