"""Timed forward-backward runs: one run, and the alternating rounds that measure every schedule.

Runs alternate (A B C A B C ...), so run i of every schedule saw the same
machine state; the first run of each schedule also checks that all schedules
compute the same loss.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_seq1f1b.bench.confirm import Race
from megatron_seq1f1b.bench.lineup import BenchSchedule
from megatron_seq1f1b.bench.ranks import per_stage, say, synchronize
from megatron_seq1f1b.bench.units import fmt_mib
from megatron_seq1f1b.planner.peak_memory import PeakMemory


def loss_of(store: list) -> tuple[float, float]:
    """(loss sum, tokens) of this rank's forward data store (non-zero on the last stage)."""
    total = [0.0, 0.0]
    for entry in store:
        report = entry["lm loss"]
        total[0] += float(report[0])
        total[1] += float(report[1])
    return total[0], total[1]


def run_once(sched: BenchSchedule, batches: list, args: argparse.Namespace,
             forward_step: Callable, memory: PeakMemory, *, fb: Callable | None = None,
             profile: cProfile.Profile | _OpProfile | None = None,
             on_start: Callable[[], object] | None = None) -> dict:
    """One forward-backward of all micro-batches; collective; returns time, peaks, loss.

    The schedule's own micro-batches (``sched.batches``: its form of packed documents)
    take the place of ``batches`` where it has them.
    """
    layout = sched.layout
    if sched.batches is not None:
        batches = sched.batches
    layout.activate()
    for chunk in layout.model:
        chunk.zero_grad_buffer()
    iterators = [iter(batches) for _ in range(layout.chunks)]
    gc.collect()
    memory.reset()
    dist.barrier()
    gc.disable()
    if on_start is not None:
        on_start()
    start, cpu_start = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    with sched.options():
        store = (fb or sched.fb)(
            forward_step_func=forward_step,
            data_iterator=iterators if layout.chunks > 1 else iterators[0],
            model=layout.model if layout.chunks > 1 else layout.model[0],
            num_microbatches=args.microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=None,
            forward_only=False,
        )
        synchronize()
    if profile is not None:
        profile.disable()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    gc.enable()
    peak = memory.peak_above_baseline()
    loss_sum, tokens = loss_of(store)
    sums = torch.tensor([loss_sum, tokens], dtype=torch.float64)
    times = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    # Every tensor-parallel rank of the last stage reports the same (sum, tokens): the
    # ratio is unaffected.
    loss = (sums[0] / sums[1].clamp(min=1)).item()
    peaks, cpus = per_stage(peak, cpu)
    return {"time": times.item(), "peaks": [int(x) for x in peaks], "cpu": cpus, "loss": loss}


def _log_run(index: int, iters: int, sched: BenchSchedule, result: dict,
             tokens_per_iter: int) -> None:
    say(f"  [run {index}/{iters}] {sched.label:<40} {result['time'] * 1e3:8.1f} ms  "
        f"{tokens_per_iter / result['time']:8.0f} tokens/s  peak MiB per stage "
        + " ".join(fmt_mib(x) for x in result["peaks"]))


def _losses_agree(schedules: list[BenchSchedule], rtol: float) -> bool:
    losses = [s.first_loss for s in schedules]
    ref = losses[0]
    worst = max(abs(x - ref) / abs(ref) for x in losses)
    say("> first-iteration loss: " + ", ".join(f"{s.key} {s.first_loss:.8f}"
                                                 for s in schedules)
        + f"  (max relative difference {worst:.1e}: "
        + ("OK)" if worst <= rtol else "MISMATCH)"))
    if worst > rtol:
        say(f"ERROR: schedules disagree on the loss by more than {rtol}")
        return False
    return True


def measure_rounds(schedules: list[BenchSchedule], batches: list, args: argparse.Namespace,
                   forward_step: Callable, memory: PeakMemory, tokens_per_iter: int) -> bool:
    """Warm-up (whose first run checks the loss), then --iters alternating measured rounds.

    Returns False, having said why, when the schedules disagree on the loss.
    """
    for w in range(max(args.warmup, 1)):
        for s in schedules:
            result = run_once(s, batches, args, forward_step, memory)
            if w == 0:
                s.first_loss = result["loss"]
            if w >= args.warmup:  # --warmup 0: the loss-check run is measured too
                s.record(result)
                _log_run(1, args.iters, s, result, tokens_per_iter)
        if w == 0 and not _losses_agree(schedules, args.loss_rtol):
            return False
    first_measured = 1 if args.warmup == 0 else 0
    for i in range(first_measured, args.iters):
        for s in schedules:
            result = run_once(s, batches, args, forward_step, memory)
            s.record(result)
            _log_run(i + 1, args.iters, s, result, tokens_per_iter)
    return True


class _OpProfile:
    """torch.profiler over one run, with cProfile's enable/disable (what ``run_once`` calls)."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def enable(self) -> None:
        self.profiler.start()

    def disable(self) -> None:
        self.profiler.stop()


def op_profile_runs(schedules: list[BenchSchedule], batches: list, args: argparse.Namespace,
                    forward_step: Callable, memory: PeakMemory, out: Path) -> None:
    """torch.profiler of one extra run of every schedule on --profile-rank: per operator,
    calls and self CPU time side by side (``ops_rank<r>.md``), and each schedule's own
    table, also by input shapes (``ops_<key>_rank<r>.txt``)."""
    from megatron_seq1f1b.bench.op_profile import OpTotals, side_by_side

    totals: dict[str, OpTotals] = {}
    for s in schedules:
        profile = _OpProfile() if dist.get_rank() == args.profile_rank else None
        run_once(s, batches, args, forward_step, memory, profile=profile)
        if profile is not None:
            events = profile.profiler.key_averages()
            totals[s.key] = OpTotals.of(events)
            shapes = profile.profiler.key_averages(group_by_input_shape=True)
            path = out / f"ops_{s.key}_rank{args.profile_rank}.txt"
            path.write_text(events.table(sort_by="self_cpu_time_total", row_limit=40) + "\n"
                            + shapes.table(sort_by="self_cpu_time_total", row_limit=60))
    if totals:
        path = out / f"ops_rank{args.profile_rank}.md"
        path.write_text(side_by_side(totals))
        print(f"> operator profile on rank {args.profile_rank}: {path}", flush=True)


def profile_runs(schedules: list[BenchSchedule], batches: list, args: argparse.Namespace,
                 forward_step: Callable, memory: PeakMemory, out: Path) -> None:
    """cProfile one extra run of every schedule on --profile-rank: text reports in `out`, and
    the raw statistics beside them (``.prof``, for ``pstats`` to compare two schedules)."""
    for s in schedules:
        profile = cProfile.Profile() if dist.get_rank() == args.profile_rank else None
        run_once(s, batches, args, forward_step, memory, profile=profile)
        if profile is not None:
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)
            path = out / f"profile_{s.key}_rank{args.profile_rank}.txt"
            path.write_text(text.getvalue())
            profile.dump_stats(path.with_suffix(".prof"))
            print(f"> cProfile of {s.key} on rank {args.profile_rank}: {path}", flush=True)


def count_saved_runs(schedules: list[BenchSchedule], batches: list, args: argparse.Namespace,
                     forward_step: Callable, memory: PeakMemory) -> None:
    """One extra, untimed run of every schedule counting what autograd keeps for backward
    (:class:`~megatron_seq1f1b.planner.peak_memory.SavedActivations`: the activations themselves, without
    the one-layer temporaries, e.g. collectives' buffers, that the resident peak also holds);
    ``saved_bytes_per_stage`` of each row, the most any rank of a stage kept."""
    from megatron_seq1f1b.planner.peak_memory import SavedActivations
    from megatron_seq1f1b.runtime.model_hooks import unwrap

    for s in schedules:
        params = [p for chunk in s.layout.model for p in unwrap(chunk).parameters()]
        meter = SavedActivations(exclude=params)
        with meter:
            run_once(s, batches, args, forward_step, memory)
        (s.saved_peaks,) = per_stage(meter.peak_bytes)
        say(f"  [saved] {s.label:<40} kept for backward, MiB per stage "
            + " ".join(fmt_mib(x) for x in s.saved_peaks))


def diagnostic_runs(schedules: list[BenchSchedule], batches: list, args: argparse.Namespace,
                    forward_step: Callable, memory: PeakMemory, out: Path) -> None:
    """The untimed extra runs the flags ask for: ``--count-saved``, ``--profile``,
    ``--profile-ops`` (every benchmark mode runs them after its timed rounds)."""
    if args.count_saved:
        count_saved_runs(schedules, batches, args, forward_step, memory)
    if args.profile:
        profile_runs(schedules, batches, args, forward_step, memory, out)
    if args.profile_ops:
        op_profile_runs(schedules, batches, args, forward_step, memory, out)


def confirm_rounds(auto: BenchSchedule, rivals: list[BenchSchedule], race: Race,
                   batches: list, args: argparse.Namespace, forward_step: Callable,
                   memory: PeakMemory, tokens_per_iter: int) -> dict[str, list[float]]:
    """The confirmation race (:mod:`~megatron_seq1f1b.bench.confirm`): rounds of auto and
    the rivals still racing, in mirrored order (auto first, then auto last, so a drift
    across two rounds cancels); times per key.

    Every rank holds the same times (each is the maximum over ranks), so every rank drops
    the same rivals. A rival may be the twin (auto's own plan); it is best placed first.
    """
    times: dict[str, list[float]] = {s.key: [] for s in [auto, *rivals]}
    racing = list(rivals)
    for i in range(race.max_rounds):
        for s in [auto, *racing] if i % 2 == 0 else [*reversed(racing), auto]:
            result = run_once(s, batches, args, forward_step, memory)
            times[s.key].append(result["time"])
            say(f"  [confirm {i + 1}/{race.max_rounds}] {s.label:<36} "
                f"{result['time'] * 1e3:8.1f} ms  {tokens_per_iter / result['time']:8.0f} tokens/s")
        still = race.racing(times)
        left = [s.key for s in racing if s.key not in still]
        if left and still:
            say(f"  [confirm {i + 1}/{race.max_rounds}] decided, leaving the race: "
                + ", ".join(left))
        racing = [s for s in racing if s.key in still]
        if not racing:
            if i + 1 < race.max_rounds:
                say(f"> confirmation: every rival decided after {i + 1} rounds")
            break
    return times
