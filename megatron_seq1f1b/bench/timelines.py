"""Measured timelines: per-action timings of real iterations, for Megatron's schedules and ours.

Seq1F1B records through :class:`megatron_seq1f1b.trace.TimelineRecorder`;
Megatron's schedules are timed by wrapping its ``forward_step`` and
``backward_step`` for the duration of one run (so they show no p2p waits).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from typing import Callable, Iterator

import torch.distributed as dist

from megatron_seq1f1b.bench.lineup import BenchSchedule
from megatron_seq1f1b.bench.ranks import say
from megatron_seq1f1b.bench.runner import run_once
from megatron_seq1f1b.memory import PeakMemory
from megatron_seq1f1b.replay import Timeline
from megatron_seq1f1b.schedule import Action, B, F


@contextlib.contextmanager
def megatron_step_timer(recorder, chunks: list) -> Iterator[None]:
    """Time Megatron's forward_step/backward_step calls into a TimelineRecorder.

    Patches the module globals of megatron.core.pipeline_parallel.schedules for
    the duration; micro-batch numbers come from ``current_microbatch`` (or a
    per-chunk counter), backward steps are matched to their forward by the
    identity of the output tensor.
    """
    from megatron.core.pipeline_parallel import schedules as msched

    original_forward, original_backward = msched.forward_step, msched.backward_step
    counters = [0] * len(chunks)
    owner: dict[int, Action] = {}
    step = itertools.count()

    def chunk_index(model) -> int:
        for i, chunk in enumerate(chunks):
            if chunk is model:
                return i
        return 0

    def forward_step(*a, **kw):
        model = a[2] if len(a) > 2 else kw["model"]
        c = chunk_index(model)
        mb = kw.get("current_microbatch")
        if mb is None:
            mb = counters[c]
        counters[c] += 1
        start = recorder.now()
        result = original_forward(*a, **kw)
        action = F(mb, 0, c)
        owner[id(result[0])] = action
        recorder.compute(start, action, next(step), 0)
        return result

    def backward_step(input_tensor, output_tensor, output_tensor_grad, *rest):
        # rest: (config,), or (model_type, config) on Megatron-Core 0.16
        start = recorder.now()
        result = original_backward(input_tensor, output_tensor, output_tensor_grad, *rest)
        fwd = owner.pop(id(output_tensor), F(0, 0, 0))
        recorder.compute(start, B(fwd.microbatch, 0, fwd.chunk), next(step), 0)
        return result

    msched.forward_step, msched.backward_step = forward_step, backward_step
    try:
        yield
    finally:
        msched.forward_step, msched.backward_step = original_forward, original_backward


def timeline_stats(timeline: Timeline) -> dict:
    """Makespan, busy and p2p-wait time per rank, and the idle share of a (measured) timeline."""
    makespan = timeline.makespan
    busy = [sum(iv.end - iv.start for iv in rank) for rank in timeline.compute]
    waits = [sum(iv.end - iv.start for iv in rank) for rank in timeline.waits] \
        if timeline.waits else []
    total = makespan * len(timeline.compute)
    return {
        "makespan_s": makespan,
        "busy_s": busy,
        "p2p_wait_s": waits,
        "bubble_fraction": 1.0 - sum(busy) / total if total else 0.0,
    }


def record_timeline(sched: BenchSchedule, batches: list, args: argparse.Namespace,
                    forward_step: Callable, memory: PeakMemory, group) -> Timeline:
    """One extra iteration with per-action timing; returns the gathered Timeline (all ranks)."""
    import megatron_seq1f1b as s1
    from megatron_seq1f1b.trace import TimelineRecorder

    recorder = TimelineRecorder()
    if sched.megatron:
        with megatron_step_timer(recorder, sched.layout.model):
            run_once(sched, batches, args, forward_step, memory,
                     on_start=lambda: recorder.begin(dist.get_rank()))
    else:
        fb = s1.get_forward_backward_func(sched.k, sched.partition, split_lengths=sched.lengths,
                                          recorder=recorder, schedule=sched.schedule)
        run_once(sched, batches, args, forward_step, memory, fb=fb)
    return recorder.gather(-1, group=group)


def record_timelines(schedules: list[BenchSchedule], batches: list, args: argparse.Namespace,
                     forward_step: Callable, memory: PeakMemory) -> dict[str, Timeline]:
    """--timeline-runs recorded iterations per schedule (alternating); keeps the median one.

    Sets every schedule's ``timeline`` statistics; returns the kept timelines by key.
    """
    from megatron.core import parallel_state

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    recorded: dict[str, list[Timeline]] = {s.key: [] for s in schedules}
    for _ in range(args.timeline_runs):
        for s in schedules:
            recorded[s.key].append(
                record_timeline(s, batches, args, forward_step, memory, pp_group))
    kept = {}
    for s in schedules:
        runs = sorted(recorded[s.key], key=lambda t: t.makespan)
        kept[s.key] = runs[(len(runs) - 1) // 2]
        s.timeline = timeline_stats(kept[s.key])
        s.timeline["makespans_s"] = [t.makespan for t in recorded[s.key]]
        say(f"> timeline {s.key}: makespan {s.timeline['makespan_s'] * 1e3:.0f} ms, bubble "
            f"{s.timeline['bubble_fraction']:.1%}")
    return kept
