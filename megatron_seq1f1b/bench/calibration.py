"""Calibration: what a segment's forward and backward cost on each stage, and a message.

Every rank runs, on its own model chunks, forward of segments 0..k-1 then
backward k-1..0 of one micro-batch by hand (``SegmentRun``), for a few
partitions; per segment the median of ``--calib-reps`` repetitions counts. *Isolated*
runs one stage at a time (no CPU contention), *concurrent* all at once. A
ping-pong between neighbouring stages times the pipeline messages.
Everything here is collective; :mod:`.fit` turns the samples into costs.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from megatron_seq1f1b.base.checks import segment_multiple
from megatron_seq1f1b.bench.layouts import Layout
from megatron_seq1f1b.bench.lineup import segment_lengths
from megatron_seq1f1b.bench.ranks import say
from megatron_seq1f1b.megatron_lm.arguments import AUTO
from megatron_seq1f1b.planner.measure import calibration_cases as startup_cases
from megatron_seq1f1b.planner.measure import measure_p2p, time_cases
from megatron_seq1f1b.schedules.partition import split_sequence

# Per (stage, chunk): one row [length, end, forward_s, backward_s(, weight_s, input_grad_s)]
# per segment of every case.
StageSamples = dict[tuple[int, int], list[list[float]]]


@dataclass
class CalibrationSamples:
    """What the calibration measured, before any fitting."""

    cases: list[list[int]]  # the partitions timed
    modes: tuple[str, ...]  # "isolated" and/or "concurrent"
    raw: dict[str, dict[str, StageSamples]]  # mode -> layout name -> samples
    p2p_rows: list[list[float]] | None  # [[bytes, one-way seconds], ...]; None for pp=1


def calibration_cases(args: argparse.Namespace, layout: Layout, vocab_size: int) -> list[list[int]]:
    """Full sequence, uniform k=2, uniform k, balanced k (and FLOP-balanced k if different)."""
    cases = [[args.seq_length]]
    if args.seq_length // segment_multiple(layout.config) < 2:
        return cases
    candidates = [segment_lengths(args, k, partition, layout, vocab_size)
                  for k, partition in ((2, "uniform"), (args.splits, "uniform"),
                                       (args.splits, "balanced")) if k >= 2]
    if args.splits >= 2:  # the causal-pair split too, for comparison
        candidates.append(split_sequence(args.seq_length, args.splits, "balanced",
                                         config=layout.config, vocab_size=vocab_size,
                                         multiple_of=segment_multiple(layout.config)))
    for lengths in candidates:
        if lengths not in cases:
            cases.append(lengths)
    return cases


def splits_weights(args: argparse.Namespace) -> bool:
    """Time W apart when a zero-bubble schedule runs or the planner chooses (it weighs them)."""
    return args.splits == AUTO or any("zb" in name for name in (args.schedules or ()))


def calibrate_layout(layout: Layout, cases: list[list[int]], batch: dict, forward_step: Callable,
                     args: argparse.Namespace, mode: str) -> StageSamples:
    """Per-segment forward/backward times of every chunk of this rank: {(stage, chunk): rows}."""
    from megatron.core import parallel_state

    import megatron_seq1f1b as s1

    layout.activate()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    config = layout.config
    split_weights = splits_weights(args) and not s1.wgrad.deferral_problems(layout.model)
    if split_weights:
        s1.wgrad.install()
    mine: dict = {}

    def measure():
        for c, chunk in enumerate(layout.model):
            gpt = s1.model.unwrap(chunk)
            mine[(pp_rank, c)], _ = time_cases(
                chunk, c, cases, itertools.repeat(batch), forward_step, config, args.micro_batch_size,
                gpt.pre_process, gpt.post_process, args.calib_reps, split_weights)
            chunk.zero_grad_buffer()

    if mode == "concurrent":
        dist.barrier()
        measure()
        dist.barrier()
    else:
        for stage in range(args.pp):
            dist.barrier()
            if stage == pp_rank:
                measure()
        dist.barrier()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged = {}
    for part in gathered:
        for key, rows in part.items():
            merged.setdefault(key, rows)
    return merged


def calibrate(args: argparse.Namespace, layouts: dict[str, Layout], batch: dict,
              forward_step: Callable) -> CalibrationSamples:
    """Segment costs of every layout in each --calib-mode, then (pp > 1) message times.

    With ``--splits auto`` (no k yet) the cases are those of the trainer's start-up
    measurement, so the plan is chosen from what ``--seq1f1b-splits auto`` would time.
    """
    if args.splits == AUTO:
        cases = startup_cases(args.seq_length, segment_multiple(layouts["plain"].config),
                              args.min_segment_length)
    else:
        cases = calibration_cases(args, layouts["plain"], args.vocab_size)
    modes = ("isolated", "concurrent") if args.calib_mode == "both" else (args.calib_mode,)
    say(f"> calibrating segment costs ({', '.join(modes)}), cases {cases}")
    raw = {mode: {name: calibrate_layout(layout, cases, batch, forward_step, args, mode)
                  for name, layout in layouts.items()} for mode in modes}
    p2p_rows = None
    if args.pp > 1:
        token_counts = sorted({n for case in cases for n in case})
        p2p_rows = measure_p2p(args.micro_batch_size, layouts["plain"].config, token_counts)
    return CalibrationSamples(cases, modes, raw, p2p_rows)
