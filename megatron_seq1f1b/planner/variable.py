"""Plans for micro-batches of different lengths: predicted time and memory, and the choice.

Given the lengths of an iteration's micro-batches (a length histogram's draw, or the
first global batch) and per-segment costs (a :class:`~megatron_seq1f1b.planner.costs.Calibration`:
measured, or the FLOP model), every candidate is cut as the executor cuts it
(:func:`~megatron_seq1f1b.schedules.variable.cut_microbatches`, or by documents), built
with one segment count per micro-batch, and replayed as the executor runs it (the replay of
:mod:`~megatron_seq1f1b.planner.search`, with the transport's ``timing``; ``--seq1f1b-splits
auto`` passes the executor's). Megatron's
1F1B on the same micro-batches is the candidate with one segment each. Memory is the most
activation tokens any stage holds (forwarded, not yet backwarded or, with ``W`` split off,
weight-gradiented), in bytes where the calibration knows a token's.

:func:`choose_variable_plan` ranks a token budget per segment (powers of two of the
layout's multiple, within ``min_segment_length`` and the longest micro-batch) and fixed
counts, under a memory budget; the fastest that fits wins, ties to the smaller memory.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from megatron_seq1f1b.planner.costs import Calibration
from megatron_seq1f1b.planner.memory_model import bytes_text
from megatron_seq1f1b.schedules.partition import (
    CostModel, split_documents, split_documents_by_budget,
)
from megatron_seq1f1b.schedules.replay import replay, timing_of
from megatron_seq1f1b.schedules.schedule import Schedule, ScheduleError, build_schedule
from megatron_seq1f1b.schedules.simulate import peak_tokens, placed_steps
from megatron_seq1f1b.schedules.variable import cut_microbatches, segment_count

__all__ = ["VariablePlan", "cut_rows", "predict_rows", "choose_variable_plan", "budgets",
           "regroup"]


@dataclass(frozen=True)
class VariablePlan:
    """One candidate on given micro-batch lengths: how it cuts, and what it is predicted to do."""

    name: str  # e.g. "Megatron 1F1B", "Seq1F1B k=4", "Seq1F1B 2048 tokens/segment"
    num_splits: int
    segment_tokens: int | None
    partition: str
    schedule: str
    rows: tuple[tuple[int, ...], ...]  # segment lengths per micro-batch
    time: float
    bubble: float
    peak_tokens: tuple[float, ...]  # per stage: most activation tokens held
    bytes_per_token: float | None = None
    unit: str = "s"

    @property
    def units(self) -> int:
        return sum(len(row) for row in self.rows)

    @property
    def peak_bytes(self) -> float | None:
        if self.bytes_per_token is None:
            return None
        return max(self.peak_tokens) * self.bytes_per_token

    def memory_text(self) -> str:
        peak = self.peak_bytes
        return bytes_text(peak) if peak is not None else f"{max(self.peak_tokens):.0f} tokens"


def cut_rows(seq_lengths: Sequence[int], num_splits: int, partition: str, *,
             segment_tokens: int | None = None, cost: CostModel | None = None,
             multiple_of: int = 1, documents=None,
             runs_apart: bool = False) -> tuple[tuple[int, ...], ...]:
    """Every micro-batch's segment lengths, as the executor cuts them (``documents``: one
    :class:`~megatron_seq1f1b.segments.documents.Documents` per micro-batch, for the
    documents partition; ``runs_apart``: as ``backward_by_documents`` cuts them)."""
    if partition == "documents" and runs_apart and segment_tokens is not None:
        return tuple(tuple(split_documents_by_budget(docs, segment_tokens, cost,
                                                     multiple_of=multiple_of,
                                                     max_splits=num_splits))
                     for docs in documents)
    if partition == "documents":
        return tuple(tuple(split_documents(
            docs, segment_count(n, num_splits, segment_tokens, multiple_of), cost,
            multiple_of=multiple_of)) for n, docs in zip(seq_lengths, documents))
    return cut_microbatches(seq_lengths, num_splits, partition, segment_tokens=segment_tokens,
                            cost=cost, multiple_of=multiple_of)


def _action_cost(calibration: Calibration, rows, num_stages: int, v: int, split: bool,
                 documents=None):
    """cost(action, rank) per micro-batch and segment (documents: their own attention)."""
    stages = calibration.stage_costs(num_stages * v)
    table = {}
    for mb, row in enumerate(rows):
        costs = calibration.with_documents(documents[mb]) if documents is not None else calibration
        for j, (length, end) in enumerate(zip(row, itertools.accumulate(row))):
            for vs, stage in enumerate(stages):
                if split:
                    f, b, w = costs.zero_bubble_times(stage, length, end)
                else:
                    f, b, _ = costs.times(stage, length, end)
                    w = 0.0
                table[vs, mb, j] = {"F": f, "B": b, "W": w}
    return lambda action, rank: table[action.chunk * num_stages + rank, action.microbatch,
                                      action.segment][action.kind]


def _placement(calibration: Calibration, rows, num_stages: int) -> tuple:
    """Per micro-batch and segment (F, B, W), mean F 1: where a zero-bubble schedule puts W."""
    stages = calibration.stage_costs(num_stages)
    table = []
    for row in rows:
        out = []
        for length, end in zip(row, itertools.accumulate(row)):
            times = [calibration.zero_bubble_times(s, length, end) for s in stages]
            out.append(tuple(sum(t[i] for t in times) / len(times) for i in range(3)))
        table.append(out)
    mean = sum(r[0] for row in table for r in row) / sum(len(row) for row in table)
    return tuple(tuple(tuple(round(x / mean, 4) for x in r) for r in row) for row in table)


def predict_rows(calibration: Calibration, rows: Sequence[Sequence[int]], num_stages: int, *,
                 num_model_chunks: int = 1, schedule: str = "1f1b", send_slack: int = 1,
                 documents=None, timing: str | None = None
                 ) -> tuple[float, float, tuple[float, ...], Schedule]:
    """(time, bubble, peak tokens per stage, schedule) of these cuts, as the executor runs
    them: ``timing`` (:data:`~megatron_seq1f1b.schedules.replay.TIMINGS`) where given, else
    ``send_slack``'s (1: "slack"). Raises ScheduleError where the executor would refuse the
    steps."""
    v = num_model_chunks
    counts = [len(row) for row in rows]
    split = schedule != "1f1b"
    placement = _placement(calibration, rows, num_stages * v) if split else None
    built = build_schedule(num_stages, len(rows), counts, v, schedule=schedule,
                           costs=placement)
    steps = placed_steps(built, v, placement)
    cost = _action_cost(calibration, rows, num_stages, v, split, documents)
    latency = calibration.message_latency([n for row in rows for n in row])
    timeline = replay(steps, cost, comm_latency=latency,
                      timing=timing if timing is not None else timing_of(send_slack))
    busy = sum(iv.end - iv.start for rank in timeline.compute for iv in rank)
    total = timeline.makespan * num_stages
    return (timeline.makespan, 1.0 - busy / total if total else 0.0,
            peak_tokens(built, rows, v), built)


def budgets(seq_lengths: Sequence[int], multiple_of: int = 1, min_segment_length: int = 128
            ) -> list[int]:
    """Token budgets worth trying: powers of two times the layout's multiple, from
    ``min_segment_length`` up to (not including) the longest micro-batch."""
    longest = max(seq_lengths)
    low = max(multiple_of, min_segment_length)
    out, value = [], multiple_of * 2 ** max(0, math.ceil(math.log2(low / multiple_of)))
    while value < longest:
        out.append(value)
        value *= 2
    return out


def regroup(seq_lengths: Sequence[int], num_microbatches: int) -> list[list[int]]:
    """Sequences regrouped into micro-batches of about equal tokens (what careful users do
    against imbalance: longest first into the lightest micro-batch); indices per micro-batch,
    each in the order they came."""
    bins: list[list[int]] = [[] for _ in range(num_microbatches)]
    loads = [0] * num_microbatches
    for index in sorted(range(len(seq_lengths)), key=lambda i: (-seq_lengths[i], i)):
        target = min(range(num_microbatches), key=lambda b: (loads[b], b))
        bins[target].append(index)
        loads[target] += seq_lengths[index]
    return [sorted(b) for b in bins]


def busy_bound(calibration: Calibration, rows: Sequence[Sequence[int]], num_stages: int,
               num_model_chunks: int = 1, documents=None, split_backward: bool = False) -> float:
    """A time no schedule of these cuts can beat, without building one: on the busiest stage
    ``r``, its compute (every unit's forward and whole backward), after the first unit's
    forwards on the stages before it (its first action waits for them) and, unless W is split
    off, before the last unit's backwards there (the earlier stages' last actions wait for
    its own)."""
    p, v = num_stages, num_model_chunks
    stages = calibration.stage_costs(p * v)
    busy, first, last = [0.0] * p, [0.0] * p, [0.0] * p
    for mb, row in enumerate(rows):
        costs = calibration.with_documents(documents[mb]) if documents is not None else calibration
        for j, (length, end) in enumerate(zip(row, itertools.accumulate(row))):
            for vs, stage in enumerate(stages):
                f, b, _ = costs.times(stage, length, end)
                busy[vs % p] += f + b
                if vs < p:  # the first chunk carries the fill and the drain
                    if mb == 0 and j == 0:
                        first[vs] = f
                    if mb == len(rows) - 1 and j == 0:
                        last[vs] = b
    return max(sum(first[:r]) + busy[r] + (0.0 if split_backward else sum(last[:r]))
               for r in range(p))


def _candidates(seq_lengths, schedules, partition, multiple_of, min_segment_length,
                max_splits, fixed_splits):
    yield "Megatron 1F1B", 1, None, "uniform", "1f1b"
    for k in fixed_splits:
        if max(seq_lengths) // k >= min_segment_length:
            for name in schedules:
                yield f"Seq1F1B k={k}", k, None, partition, name
    for tokens in budgets(seq_lengths, multiple_of, min_segment_length):
        for name in schedules:
            yield f"Seq1F1B {tokens} tokens/segment", max(max_splits, 2), tokens, partition, name


def choose_variable_plan(calibration: Calibration, seq_lengths: Sequence[int], num_stages: int,
                         *, cost: CostModel | None = None, num_model_chunks: int = 1,
                         schedules: Sequence[str] = ("1f1b",), partition: str = "balanced",
                         multiple_of: int = 1, min_segment_length: int = 128,
                         max_splits: int = 64, fixed_splits: Sequence[int] = (2, 4, 8, 16),
                         memory_budget_bytes: float | None = None,
                         send_slack: int = 1, documents=None, timing: str | None = None
                         ) -> tuple[VariablePlan, list[VariablePlan]]:
    """(chosen, the candidates timed, fastest first): Megatron's 1F1B (one segment per
    micro-batch), the ``fixed_splits`` counts and token budgets (:func:`budgets`, at most
    ``max_splits`` segments a micro-batch), each with every schedule; ``cost``: the FLOP
    model the balanced partition cuts with (the executor's).

    Memory first (the tokens a stage holds, from the schedule alone); then the candidates
    that fit are timed cheapest :func:`busy_bound` first, and one whose bound is already
    slower than the fastest timed is left untimed: it cannot win (the choice is the same as
    timing all of them, tested). The replays run with the collector paused. ``timing`` (else
    ``send_slack``'s): how the executor's transport posts and waits (:func:`predict_rows`).
    """
    from megatron_seq1f1b.base.collection import collection_paused

    entries = []
    with collection_paused():
        for label, k, tokens, cut, name in _candidates(seq_lengths, schedules, partition,
                                                       multiple_of, min_segment_length,
                                                       max_splits, fixed_splits):
            rows = cut_rows(seq_lengths, k, cut, segment_tokens=tokens, cost=cost,
                            multiple_of=multiple_of, documents=documents)
            built = build_schedule(num_stages, len(rows), [len(r) for r in rows],
                                   num_model_chunks, schedule=name)
            peaks = peak_tokens(built, rows, num_model_chunks)
            fits = (memory_budget_bytes is None or calibration.bytes_per_token is None
                    or max(peaks) * calibration.bytes_per_token <= memory_budget_bytes)
            entries.append((label + ("" if name == "1f1b" else f" {name}"), k, tokens, cut, name,
                            rows, peaks, fits,
                            busy_bound(calibration, rows, num_stages, num_model_chunks,
                                       documents, split_backward=name != "1f1b")))
        if not any(entry[7] for entry in entries):
            label, *_, peaks, _, _ = min(entries, key=lambda e: max(e[6]))
            raise ValueError(f"no plan fits {bytes_text(memory_budget_bytes)} of activations; "
                             f"the smallest, {label}, holds "
                             f"{bytes_text(max(peaks) * calibration.bytes_per_token)}")
        plans, best = [], math.inf
        for label, k, tokens, cut, name, rows, peaks, fits, bound in sorted(
                entries, key=lambda e: (not e[7], e[8])):
            if fits and bound > best:
                continue  # cannot beat the fastest that fits
            try:
                time, bubble, peaks, _ = predict_rows(
                    calibration, rows, num_stages, num_model_chunks=num_model_chunks,
                    schedule=name, send_slack=send_slack, documents=documents,
                    timing=timing)
            except ScheduleError:
                continue
            plans.append(VariablePlan(label, k, tokens, cut, name, rows, time, bubble, peaks,
                                      calibration.bytes_per_token, calibration.unit))
            if fits:
                best = min(best, time)
    key = lambda p: (round(p.time, 12), max(p.peak_tokens), p.units)  # noqa: E731
    fitting = [p for p in plans if memory_budget_bytes is None or p.peak_bytes is None
               or p.peak_bytes <= memory_budget_bytes]
    return min(fitting, key=key), sorted(plans, key=key)


def table(chosen: VariablePlan, ranked: Sequence[VariablePlan], top: int = 8) -> str:
    """The candidates, fastest first (at most ``top``, the chosen one and Megatron's 1F1B
    always), each against Megatron's 1F1B on the same micro-batches."""
    megatron = next((p for p in ranked if p.name == "Megatron 1F1B"), None)
    shown = list(ranked[:top])
    for plan in (chosen, megatron):
        if plan is not None and plan not in shown:
            shown.append(plan)
    lines = [f"{'plan':<40} {'predicted':>12} {'vs Megatron':>11} {'bubble':>7} "
             f"{'units':>6}  peak activations (busiest stage)"]
    for plan in shown:
        speed = f"{megatron.time / plan.time:.2f}x" if megatron else "-"
        mark = "  <- chosen" if plan is chosen else ""
        lines.append(f"{plan.name:<40} {plan.time:>10.4g} {plan.unit:<1} {speed:>11} "
                     f"{plan.bubble:>6.1%} {plan.units:>6}  {plan.memory_text()}{mark}")
    return "\n".join(lines)
