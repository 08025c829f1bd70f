"""Measured timelines: per-action timings of real iterations, for Megatron's schedules and ours.

Seq1F1B records through :class:`megatron_seq1f1b.runtime.trace.TimelineRecorder`;
Megatron's schedules are timed by wrapping its ``forward_step`` and
``backward_step`` for the duration of one run (so they show no p2p waits).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch.distributed as dist

from megatron_seq1f1b.bench.lineup import BenchSchedule
from megatron_seq1f1b.bench.ranks import say
from megatron_seq1f1b.bench.runner import run_once
from megatron_seq1f1b.planner.peak_memory import PeakMemory
from megatron_seq1f1b.runtime.trace import megatron_step_timer, timeline_stats
from megatron_seq1f1b.schedules.replay import Timeline


def record_timeline(sched: BenchSchedule, batches: list, args: argparse.Namespace,
                    forward_step: Callable, memory: PeakMemory, group) -> Timeline:
    """One extra iteration with per-action timing; returns the gathered Timeline (all ranks)."""
    from megatron_seq1f1b.runtime.trace import TimelineRecorder

    recorder = TimelineRecorder()
    if sched.megatron:
        with megatron_step_timer(recorder, sched.layout.model):
            run_once(sched, batches, args, forward_step, memory,
                     on_start=lambda: recorder.begin(dist.get_rank()))
    else:
        run_once(sched, batches, args, forward_step, memory,
                 fb=sched.forward_backward(recorder=recorder))
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
