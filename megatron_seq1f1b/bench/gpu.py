"""One GPU: Megatron-Core's schedule against Seq1F1B k = 1, 2, 4, 8 and ``auto``, side by side.

Pipeline size 1 on one GPU (NCCL refuses two ranks on one device), bf16, one
model per size shared by every row (same weights, same batches), for a
ladder of sizes from host-bound to GPU-bound. ``scripts/gpu_bench.sh``
installs the wheels offline and runs this::

    python -m megatron_seq1f1b.bench.gpu --out out/gpu_bench

Per row, from timed iterations after warm-up (one iteration = one
forward-backward over ``--microbatches`` micro-batches; the optimizer step,
the same for every row, is left out so the schedules' differences show):

* tokens/s and its ratio to Megatron's schedule of the same size;
* CUDA peak memory above the iteration's start, and its ratio;
* per unit (Megatron: a micro-batch's forward+backward; Seq1F1B: a
  segment's), the host time (the host's wall time inside the call, which
  returns once everything is launched) and the GPU time (the GPU's busy time
  from one profiled iteration: its kernels' union); the GPU's idle share of
  the iteration (CUDA events around it);
* host-device synchronizations in one iteration
  (``torch.cuda.set_sync_debug_mode``).

Also one ``torch.profiler`` summary of a Seq1F1B iteration (top host
operations), and with ``--megatron-lm DIR`` (a checkout patched by
``python -m megatron_seq1f1b.patch`` or ``scripts/apply_patches.sh``) Megatron-LM's ``pretrain_gpt.py`` with and
without ``--seq1f1b`` for one size. Writes ``results.json``, ``results.md``
and ``profile_seq1f1b.txt`` to ``--out``; exit status 0, or 2 if it cannot
start (no CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch

from megatron_seq1f1b.base.flags import ArgumentParser, non_negative_int, positive_float, positive_int

DEFAULT_SIZES = ("256:1024:4", "1024:4096:16", "2048:8192:16")
DEFAULT_SPLITS = (1, 2, 4, 8)
RESULTS, TABLE, PROFILE = "results.json", "results.md", "profile_seq1f1b.txt"
#: A row whose GPU idles at least this share of the iteration is host-bound: its host time is
#: the dispatch alone (a busy GPU makes the host wait for launch-queue space too).
HOST_BOUND_IDLE = 0.2


@dataclass(frozen=True)
class Size:
    """One rung of the ladder: hidden size, sequence length, attention heads."""

    hidden: int
    seq: int
    heads: int

    @classmethod
    def parse(cls, text: str) -> "Size":
        parts = text.split(":")
        if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(
                f"size {text!r}: give HIDDEN:SEQ or HIDDEN:SEQ:HEADS, e.g. 2048:8192:16")
        hidden, seq = int(parts[0]), int(parts[1])
        heads = int(parts[2]) if len(parts) == 3 else max(hidden // 128, 1)
        if hidden % heads:
            raise argparse.ArgumentTypeError(f"size {text!r}: {heads} heads do not divide "
                                             f"hidden size {hidden}")
        return cls(hidden, seq, heads)

    def __str__(self) -> str:
        return f"hidden {self.hidden}, seq {self.seq}"


@dataclass
class Row:
    """One schedule at one size (ratios against Megatron's schedule of the same size)."""

    size: str
    name: str
    k: int | None
    lengths: list[int]
    units: int  # forward+backward units per iteration
    tokens_per_s: float
    ms_per_iter: float
    peak_gib: float | None
    host_ms_per_unit: float
    gpu_ms_per_unit: float | None
    gpu_idle_share: float | None
    syncs_per_iter: int | None
    kernels_per_unit: float | None = None  # CUDA kernels launched (profiler), GPU only
    ops_per_unit: float | None = None  # ATen operations dispatched, CPU only
    ratio: float | None = None
    peak_ratio: float | None = None
    note: str = ""
    samples_ms: list[float] = field(default_factory=list)


# ------------------------------------------------------------------ measuring


class _Clock:
    """Wall, host and device time of a block: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    @contextlib.contextmanager
    def block(self, into: dict) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        yield
        into["host"] = time.perf_counter() - start
        if self.cuda:
            end.record()
            torch.cuda.synchronize()
            into["device"] = begin.elapsed_time(end) / 1e3
        into["wall"] = time.perf_counter() - start


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels that overlap count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def gpu_busy_s(run: Callable[[], None]) -> tuple[float | None, int | None]:
    """The GPU's busy seconds in one call of ``run`` (CUDA kernels' union, torch.profiler),
    and how many kernels ran."""
    if not torch.cuda.is_available():
        return None, None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    device = [e for e in prof.events() if "cuda" in str(getattr(e, "device_type", "")).lower()]
    if not device:  # the profiler saw nothing (no CUPTI): unknown, not zero
        return None, None
    busy = busy_seconds([(e.time_range.start, e.time_range.end) for e in device]) / 1e6
    kernels = sum(not e.name.startswith(("Memcpy", "Memset")) for e in device)
    return busy, kernels


def count_ops(run: Callable[[], None]) -> int | None:
    """The ATen operations one call of ``run`` dispatches: what a host has to launch, counted
    exactly (a noise-free stand-in for dispatch time). CPU only: a GPU's backward runs on
    autograd's device thread, which a dispatch mode does not see (there: kernels, above)."""
    if torch.cuda.is_available():
        return None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return Count.ops


def count_syncs(run: Callable[[], None]) -> int | None:
    """Host-device synchronizations in one call of ``run`` (torch's sync debug mode)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def profile_table(run: Callable[[], None], rows: int = 25) -> str:
    """torch.profiler's top host operations (self CPU time) of one call of ``run``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or came from, the device running out of memory (the executor
    re-raises a unit's error as its ``ActionError``'s cause)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def release_memory() -> None:
    """Free what deleted models held (their configs' bound methods form reference cycles,
    so only the collector frees them), then the allocator's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shutdown(say: Callable[[str], None], tag: str) -> None:
    """The one-rank process groups torn down; a failure (e.g. after a CUDA error) is said,
    not raised, so the rows measured so far are still reported."""
    from megatron_seq1f1b.bench import gpu_check

    try:
        gpu_check.shutdown_single_rank()
    except Exception as exc:  # noqa: BLE001 - keep the rows
        say(f"[{tag}] shutdown failed: {type(exc).__name__}: {exc}")


def flash_kernels_only() -> None:
    """SDPA without cuDNN attention. PyTorch may prefer cuDNN for equal query and key
    lengths (full sequences, first segments) while a segment over its prefix goes to the
    flash kernel: comparisons would mix kernels."""
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)


# ------------------------------------------------------------------ the model and its data


@dataclass(frozen=True)
class Shape:
    """The transformer besides hidden size and heads (a :class:`Size`)."""

    num_layers: int = 4
    ffn_hidden_size: int | None = None  # None: the trainer's default for the activation
    swiglu: bool = True
    normalization: str = "RMSNorm"


def model_argv(opts: argparse.Namespace, size: Size, shape: Shape) -> list[str]:
    """The trainer's flags for this model (the same model every row of a size runs)."""
    return [
        "--num-layers", str(shape.num_layers), "--hidden-size", str(size.hidden),
        "--num-attention-heads", str(size.heads), "--seq-length", str(size.seq),
        *(["--ffn-hidden-size", str(shape.ffn_hidden_size)] if shape.ffn_hidden_size else []),
        *(["--swiglu"] if shape.swiglu else []), "--normalization", shape.normalization,
        "--position-embedding-type", "rope", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
        "--global-batch-size", str(opts.microbatches), "--mock-data",
        "--vocab-size", str(opts.vocab_size), "--seed", "1234", "--seq1f1b",
        *(["--bf16"] if opts.dtype == "bf16" else []),
    ]


def build(opts: argparse.Namespace, size: Size, shape: Shape | None = None):
    """(model chunks, config) as the trainer builds them: DDP, Float16Module for bf16,
    Seq1F1B-enabled (inactive outside segments), the attention backend asked for."""
    from megatron_seq1f1b.bench.gpu_check import _provider
    from megatron_seq1f1b.trainer import arguments, setup

    shape = shape or Shape(num_layers=opts.num_layers)
    args = arguments.parse(model_argv(opts, size, shape), world_size=1)
    config = setup.transformer_config(args)
    return setup.build_model(args, config, _provider(opts.attention_backend)), config


def host_batches(opts: argparse.Namespace, size: Size) -> list[dict]:
    """Random micro-batches in host memory (pinned on a GPU machine), as a data loader
    gives them: every schedule copies them to the device itself."""
    gen = torch.Generator().manual_seed(7)
    s, v = size.seq, opts.vocab_size
    batches = []
    for _ in range(opts.microbatches):
        batch = {"tokens": torch.randint(0, v, (1, s), generator=gen),
                 "labels": torch.randint(0, v, (1, s), generator=gen),
                 "loss_mask": torch.ones(1, s), "position_ids": torch.arange(s).unsqueeze(0)}
        if torch.cuda.is_available():
            batch = {k: t.pin_memory() for k, t in batch.items()}
        batches.append(batch)
    return batches


def forward_step(data_iterator, model):
    """The trainer's forward step: the micro-batch to the device, this segment's part."""
    import megatron_seq1f1b as s1
    from megatron_seq1f1b.bench.gpu_check import _loss_func

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: t.to(device, non_blocking=True) for k, t in next(data_iterator).items()}
    batch = s1.slice_batch(dict(batch, attention_mask=None))
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _iteration(forward_backward: Callable, model: list, batches: list[dict], size: Size):
    for chunk in model:
        chunk.zero_grad_buffer()
    return forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                            model=model[0], num_microbatches=len(batches),
                            seq_length=size.seq, micro_batch_size=1, forward_only=False)


def measure_row(name: str, forward_backward: Callable, model: list, batches: list[dict],
                size: Size, opts: argparse.Namespace, units: int, k: int | None,
                lengths: list[int], detail: bool = True) -> Row:
    """Warm-up, timed iterations, one profiled and one sync-counted iteration (``detail``)."""
    from megatron_seq1f1b.planner.peak_memory import PeakMemory

    cuda = torch.cuda.is_available()
    run = partial(_iteration, forward_backward, model, batches, size)
    for _ in range(opts.warmup):
        run()
    clock, memory = _Clock(cuda), PeakMemory()
    memory.reset()
    samples = []
    for _ in range(opts.iters):
        sample: dict = {}
        with clock.block(sample):
            run()
        samples.append(sample)
    peak = memory.peak_above_baseline() / 2**30 if cuda else None
    wall = statistics.median(s["wall"] for s in samples)
    device = statistics.median(s.get("device", s["wall"]) for s in samples)
    host = statistics.median(s["host"] for s in samples)
    busy, kernels = gpu_busy_s(run) if detail else (None, None)
    ops = count_ops(run) if detail else None
    return Row(
        size=str(size), name=name, k=k, lengths=lengths, units=units,
        tokens_per_s=len(batches) * size.seq / wall, ms_per_iter=wall * 1e3, peak_gib=peak,
        host_ms_per_unit=host * 1e3 / units,
        gpu_ms_per_unit=None if busy is None else busy * 1e3 / units,
        gpu_idle_share=None if busy is None else max(0.0, 1.0 - busy / device),
        syncs_per_iter=count_syncs(run) if detail else None,
        samples_ms=[s["wall"] * 1e3 for s in samples],
        kernels_per_unit=None if kernels is None else kernels / units,
        ops_per_unit=None if ops is None else ops / units,
    )


def unmeasured_row(size: Size | str, name: str, k: int | None, note: str) -> Row:
    """A row that has no numbers: it failed (``note`` says how) or was not started."""
    return Row(size=str(size), name=name, k=k, lengths=[], units=0, tokens_per_s=0.0,
               ms_per_iter=0.0, peak_gib=None, host_ms_per_unit=0.0, gpu_ms_per_unit=None,
               gpu_idle_share=None, syncs_per_iter=None, note=note)


def failure_note(exc: BaseException) -> str:
    """What a failed row's table says (the traceback goes to stderr)."""
    traceback.print_exception(exc, file=sys.stderr)
    if out_of_memory(exc):
        return "out of memory"
    return f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"


def row_or_note(size: Size | str, name: str, k: int | None, measure: Callable[[], Row],
                deadline: float) -> Row:
    """``measure()``'s row; if it fails (e.g. out of memory), a row saying why, the memory
    released; after ``deadline`` (``time.monotonic()``), a row saying it was not run."""
    if time.monotonic() > deadline:
        return unmeasured_row(size, name, k, "not run: time budget spent")
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - the row says what failed; others run
        row = unmeasured_row(size, name, k, failure_note(exc))
    release_memory()  # here, once the traceback's frames (and tensors) are gone
    return row


def set_ratios(rows: list[Row]) -> None:
    """tokens/s and peak memory against the first row (Megatron's schedule), if it ran."""
    base = rows[0]
    for row in rows:
        row.ratio = row.tokens_per_s / base.tokens_per_s if base.tokens_per_s and \
            row.tokens_per_s else None
        if row.peak_gib is not None and base.peak_gib:
            row.peak_ratio = row.peak_gib / base.peak_gib


def bench_size(opts: argparse.Namespace, size: Size, say: Callable[[str], None],
               deadline: float = float("inf"),
               saved: Callable[[list[Row]], None] = lambda rows: None) -> list[Row]:
    """Every row of one size; ratios against Megatron's schedule. A row that fails (e.g.
    out of memory) is kept with its note and the next row runs; rows not started by
    ``deadline`` (``time.monotonic()``) are kept as not run. ``saved`` gets the rows so far
    after each one (the report is written as the run goes)."""
    import megatron_seq1f1b as s1
    from megatron.core.pipeline_parallel import schedules

    from megatron_seq1f1b.runtime import wgrad
    from megatron_seq1f1b.runtime.executor import clear_setups, resolve_lengths

    rows: list[Row] = []

    def attempt(name: str, k: int | None, measure: Callable[[], Row]) -> None:
        rows.append(row_or_note(size, name, k, measure, deadline))
        set_ratios(rows)
        say(_line(rows[-1]))
        saved(rows)

    try:
        model, config = build(opts, size)
    except Exception as exc:  # noqa: BLE001 - e.g. the model does not fit: the size says so
        rows.append(unmeasured_row(size, "Megatron-Core", None,
                                   "model not built: " + failure_note(exc)))
    if rows:
        release_memory()  # here, once the traceback's frames (and tensors) are gone
        say(_line(rows[-1]))
        saved(rows)
        return rows
    batches = host_batches(opts, size)
    m = len(batches)
    attempt("Megatron-Core", None, lambda: measure_row(
        "Megatron-Core", schedules.forward_backward_no_pipelining, model, batches, size, opts,
        m, None, [size.seq]))
    for k in opts.splits:
        if size.seq // k < 1:
            continue

        def seq1f1b(k=k) -> Row:
            fb = s1.get_forward_backward_func(k, opts.partition)
            lengths = resolve_lengths(k, opts.partition, None, size.seq, model, config,
                                      opts.vocab_size)
            return measure_row(f"Seq1F1B k={k}", fb, model, batches, size, opts, m * k, k,
                               lengths)

        attempt(f"Seq1F1B k={k}", k, seq1f1b)
    if opts.auto:
        def auto() -> Row:
            from megatron_seq1f1b.planner.auto import plan_by_measuring

            try:
                choice = plan_by_measuring(model, forward_step, _repeat(batches[0]),
                                           seq_length=size.seq, num_microbatches=m,
                                           micro_batch_size=1)
                plan = choice.plan
                fb = s1.get_forward_backward_func(plan.num_splits, plan.partition,
                                                  split_lengths=plan.lengths,
                                                  schedule=plan.schedule,
                                                  segment_costs=plan.segment_costs)
                row = measure_row("auto", fb, model, batches, size, opts, m * plan.num_splits,
                                  plan.num_splits, list(plan.lengths))
            finally:
                wgrad.uninstall()  # the next size's rows run Megatron's own linear layers
            row.note = f"chose k={plan.num_splits} {plan.partition} {plan.schedule}"
            return row

        attempt("auto", None, auto)
    del model
    clear_setups()
    release_memory()
    return rows


def _repeat(batch: dict) -> Iterator[dict]:
    while True:
        yield batch


def seq1f1b_profile(opts: argparse.Namespace, size: Size, k: int) -> str:
    """The profiler's top host operations of one Seq1F1B iteration (after warm-up)."""
    import megatron_seq1f1b as s1

    model, _ = build(opts, size)
    batches = host_batches(opts, size)
    run = partial(_iteration, s1.get_forward_backward_func(k, opts.partition), model, batches,
                  size)
    for _ in range(max(opts.warmup, 1)):
        run()
    header = (f"Seq1F1B k={k} ({opts.partition}), {size}, {opts.num_layers} layers, "
              f"{opts.microbatches} micro-batches, {opts.dtype}: top host operations of one "
              "iteration\n\n")
    return header + profile_table(run)


# ------------------------------------------------------------------ Megatron-LM


def megatron_lm_command(script: Path, size: Size, opts: argparse.Namespace, seq1f1b: bool,
                        port: int) -> list[str]:
    """Megatron-LM's pretrain_gpt.py on one GPU (flags it needs without TE and Apex)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--master-port", str(port), str(script),
        "--num-layers", str(opts.num_layers), "--hidden-size", str(size.hidden),
        "--num-attention-heads", str(size.heads), "--seq-length", str(size.seq),
        "--max-position-embeddings", str(size.seq), "--micro-batch-size", "1",
        "--global-batch-size", str(opts.microbatches), "--train-iters", str(opts.lm_iters),
        "--lr", "1e-4", "--bf16", "--transformer-impl", "local", "--no-persist-layer-norm",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
        "--position-embedding-type", "rope", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(opts.vocab_size), "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", str(opts.lm_iters + 1),
    ]
    if seq1f1b:
        command += ["--seq1f1b", "--seq1f1b-splits", str(opts.lm_splits),
                    "--seq1f1b-partition", opts.partition]
    return command


ITER_MS = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")


def _text(output: str | bytes | None) -> str:
    """A timed-out subprocess's captured output (bytes even with text=True)."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def iteration_ms(log: str, skip: int = 2) -> float | None:
    """Median of Megatron-LM's logged 'elapsed time per iteration (ms)', first ``skip`` left out."""
    values = [float(x) for x in ITER_MS.findall(log)]
    values = values[skip:] if len(values) > skip else values
    return statistics.median(values) if values else None


def megatron_lm_rows(opts: argparse.Namespace, out_dir: Path, say,
                     timeout_s: float | None = None) -> list[Row]:
    """Megatron-LM's own loop with Megatron's schedule and with --seq1f1b (each run stopped
    after ``timeout_s``, default ``--lm-timeout-s``)."""
    timeout_s = opts.lm_timeout_s if timeout_s is None else timeout_s
    from megatron_seq1f1b.bench.gpu_check import _free_port

    script = Path(opts.megatron_lm) / "pretrain_gpt.py"
    size = opts.lm_size
    rows = []
    for seq1f1b in (False, True):
        tag = "seq1f1b" if seq1f1b else "megatron"
        log_file = out_dir / f"megatron_lm_{tag}.log"
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1",
                   PYTHONPATH=f"{opts.megatron_lm}:{os.environ.get('PYTHONPATH', '')}")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        command = megatron_lm_command(script, size, opts, seq1f1b, _free_port())
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env,
                                  timeout=timeout_s, cwd=opts.megatron_lm)
            log = done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            log = f"timed out after {timeout_s:.0f} s\n{_text(exc.stdout)}{_text(exc.stderr)}"
        log_file.write_text(" ".join(command) + "\n\n" + log)
        ms = iteration_ms(log)
        name = "Megatron-LM" if not seq1f1b else f"Megatron-LM --seq1f1b k={opts.lm_splits}"
        m = opts.microbatches
        rows.append(Row(size=f"{size} (Megatron-LM)", name=name,
                        k=opts.lm_splits if seq1f1b else None, lengths=[], units=m,
                        tokens_per_s=m * size.seq / (ms / 1e3) if ms else 0.0,
                        ms_per_iter=ms or 0.0, peak_gib=None, host_ms_per_unit=0.0,
                        gpu_ms_per_unit=None, gpu_idle_share=None, syncs_per_iter=None,
                        note="" if ms else f"no iteration time logged ({log_file.name})"))
        say(_line(rows[-1]))
    if rows[0].tokens_per_s:
        for row in rows:
            row.ratio = row.tokens_per_s / rows[0].tokens_per_s
    return rows


# ------------------------------------------------------------------ reports


def cell(text: str) -> str:
    """Text for a markdown table cell (a ``|`` in an error message would split it)."""
    return text.replace("|", "/").replace("\n", " ")


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _line(row: Row) -> str:
    return (f"[gpu_bench] {row.size}: {row.name}: {row.tokens_per_s:,.0f} tokens/s, "
            f"{row.ms_per_iter:.1f} ms/iter, peak {_fmt(row.peak_gib, '.2f')} GiB, host "
            f"{row.host_ms_per_unit:.2f} ms/unit, GPU {_fmt(row.gpu_ms_per_unit, '.2f')} ms/unit, "
            f"idle {_fmt(row.gpu_idle_share, '.0%')}, syncs {_fmt(row.syncs_per_iter, 'd')}, "
            f"{_dispatch(row)}" + (f" ({row.note})" if row.note else ""))


def _launched(row: Row) -> float | None:
    return row.kernels_per_unit if row.kernels_per_unit is not None else row.ops_per_unit


def _dispatch(row: Row) -> str:
    """Kernels (GPU) or ATen operations (CPU) per unit: what the host launches."""
    if row.kernels_per_unit is not None:
        return f"{row.kernels_per_unit:.0f} kernels/unit"
    return "-" if row.ops_per_unit is None else f"{row.ops_per_unit:.0f} ops/unit"


def markdown(rows: list[Row], environment: dict, settings: dict, command: str) -> str:
    """The table for docs/benchmarks.md (one row per schedule and size)."""
    lines = [
        f"GPU: {environment.get('device')}; torch {environment.get('torch')} (CUDA "
        f"{environment.get('cuda')}), megatron-core {environment.get('megatron_core')}, "
        f"{settings['dtype']}, {settings['num_layers']} layers, {settings['microbatches']} "
        f"micro-batches, pipeline size 1, attention {settings['attention_backend']}, "
        f"{settings['partition']} segments.",
        "",
        f"Command: `{command}`",
        "",
        "| size | schedule | tokens/s | vs Megatron | peak GiB | vs Megatron | host ms/unit | "
        "GPU ms/unit | GPU idle | syncs/iter | launched per unit | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.size} | {r.name} | {r.tokens_per_s:,.0f} | {_ratio(r.ratio)} | "
            f"{_fmt(r.peak_gib, '.2f')} | {_ratio(r.peak_ratio)} | "
            f"{r.host_ms_per_unit:.2f} | {_fmt(r.gpu_ms_per_unit, '.2f')} | "
            f"{_fmt(r.gpu_idle_share, '.0%')} | {_fmt(r.syncs_per_iter, 'd')} | {_dispatch(r)} | "
            f"{cell(r.note)} |")
    return "\n".join(lines) + "\n"


def targets(rows: list[Row]) -> dict[str, str]:
    """The issue's targets, judged from one invocation's rows (text per target)."""
    by_size: dict[str, list[Row]] = {}
    for row in rows:
        if "Megatron-LM" not in row.size:
            by_size.setdefault(row.size, []).append(row)
    verdicts = {}
    for size, group in by_size.items():
        base = group[0]
        if not base.tokens_per_s:
            verdicts[f"{size}: targets"] = f"not judged: Megatron's row has no time ({base.note})"
            continue
        k1 = next((r for r in group if r.k == 1 and r.name != "auto"), None)
        auto = next((r for r in group if r.name == "auto"), None)
        unmeasured = [r for r in group if not r.tokens_per_s]
        group = [r for r in group if r.tokens_per_s]
        fixed = [r for r in group if r.k is not None and r.name != "auto"]
        for row in unmeasured:
            verdicts[f"{size}: {row.name}"] = f"MISSED: {row.note}"
        if k1 is not None and k1.tokens_per_s:
            verdicts[f"{size}: k=1 within 2% of Megatron"] = (
                f"{k1.ratio:.3f} {'ok' if abs(k1.ratio - 1) <= 0.02 else 'MISSED'}")
        segmented = [r for r in fixed if (r.k or 1) > 1]
        host_bound = [r for r in segmented if r.gpu_idle_share is None
                      or r.gpu_idle_share >= HOST_BOUND_IDLE]
        if segmented:
            key = f"{size}: host per segment <= 1.15x host per micro-batch"
            if host_bound:
                worst = max(host_bound, key=lambda r: r.host_ms_per_unit)
                ratio = worst.host_ms_per_unit / base.host_ms_per_unit
                verdicts[key] = (f"{worst.host_ms_per_unit:.2f} ms (k={worst.k}) vs "
                                 f"{base.host_ms_per_unit:.2f} ms ({ratio:.2f}x) "
                                 f"{'ok' if ratio <= 1.15 else 'MISSED'}")
            else:
                verdicts[key] = ("not judged: the GPU was busy throughout, so the host's time "
                                 "includes waits for the launch queue (an upper bound)")
        launched = [r for r in segmented if _launched(r) is not None]
        if launched and _launched(base):
            worst = max(launched, key=_launched)
            ratio = _launched(worst) / _launched(base)
            verdicts[f"{size}: launched per segment vs per micro-batch"] = (
                f"{_dispatch(worst)} (k={worst.k}) vs {_dispatch(base)} ({ratio:.3f}x)")
        if auto is not None and auto.tokens_per_s and fixed:
            best = max(fixed, key=lambda r: r.tokens_per_s)
            share = auto.tokens_per_s / best.tokens_per_s
            verdicts[f"{size}: auto within 3% of the best k and >= 0.98x Megatron"] = (
                f"{share:.3f} of k={best.k}, {auto.ratio:.3f}x Megatron "
                f"{'ok' if share >= 0.97 and auto.ratio >= 0.98 else 'MISSED'}")
    return verdicts


def write_report(out_dir: Path, report: dict, table: str, verdicts: dict, say=None) -> None:
    """results.json, results.md (the table, then the targets' verdicts), and both printed
    (unless ``say`` is None: a partial report, saved as a run goes, so a run cut short
    still leaves what it measured)."""
    for name, text in ((RESULTS, json.dumps(report, indent=1, default=str) + "\n"),
                       (TABLE, table + "\n" + "\n".join(f"- {name}: {verdict}"
                                                          for name, verdict in verdicts.items())
                        + "\n")):
        partial_file = out_dir / (name + ".partial")
        partial_file.write_text(text)
        partial_file.replace(out_dir / name)  # whole files only, even if killed meanwhile
    if say is not None:
        say("\n" + table)
        for name, verdict in verdicts.items():
            say(f"{name}: {verdict}")


# ------------------------------------------------------------------ the run


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_seq1f1b.bench.gpu",
                       description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", nargs="+", type=Size.parse,
                   default=[Size.parse(s) for s in DEFAULT_SIZES],
                   help="HIDDEN:SEQ[:HEADS] per rung (default: " + " ".join(DEFAULT_SIZES) + ")")
    p.add_argument("--splits", nargs="+", type=positive_int, default=list(DEFAULT_SPLITS))
    p.add_argument("--partition", choices=["uniform", "balanced"], default="balanced")
    p.add_argument("--no-auto", dest="auto", action="store_false",
                   help="leave out the --seq1f1b-splits auto row")
    p.add_argument("--num-layers", type=positive_int, default=4)
    p.add_argument("--microbatches", type=positive_int, default=4)
    p.add_argument("--vocab-size", type=positive_int, default=32000)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--attention-backend", choices=["local", "flash"], default="local")
    p.add_argument("--iters", type=positive_int, default=5)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--profile-k", type=positive_int, default=4,
                   help="the Seq1F1B k whose iteration is profiled (smallest size)")
    p.add_argument("--megatron-lm", default=None,
                   help="a Megatron-LM checkout patched by python -m megatron_seq1f1b.patch "
                        "(scripts/apply_patches.sh): also run "
                        "its pretrain_gpt.py with and without --seq1f1b")
    p.add_argument("--lm-size", type=Size.parse, default=Size.parse("1024:4096:16"))
    p.add_argument("--lm-splits", type=positive_int, default=4)
    p.add_argument("--lm-iters", type=positive_int, default=8)
    p.add_argument("--lm-timeout-s", type=positive_float, default=150.0)
    p.add_argument("--time-budget-s", type=positive_float, default=400.0,
                   help="rows not started by then are left out, Megatron-LM's runs too unless "
                        "a minute is left (the install comes on top; results are saved after "
                        "every row)")
    p.add_argument("--_device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_seq1f1b.bench import gpu_check

    parser = build_parser()
    opts = parser.parse_args(argv)
    shortest = min(size.seq for size in opts.sizes)
    for flag, k in [("--splits", k) for k in opts.splits] + [("--profile-k", opts.profile_k)]:
        if k > shortest:
            parser.error(f"{flag} {k}: the shortest sequence of --sizes has {shortest} tokens, "
                         "too few for that many segments")
    if opts.lm_splits > opts.lm_size.seq:
        parser.error(f"--lm-splits {opts.lm_splits}: --lm-size has {opts.lm_size.seq} tokens, "
                     "too few for that many segments")
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if opts._device == "cuda" and gpu_check.cuda_problem():
        print(f"gpu_bench: cannot start: {gpu_check.cuda_problem()}", file=sys.stderr)
        return 2
    if opts._device == "cpu" and torch.cuda.is_available():
        print("gpu_bench: --_device cpu is the tests' CPU path: hide the GPUs", file=sys.stderr)
        return 2
    say = partial(print, flush=True)
    start = time.monotonic()
    command = "python -m megatron_seq1f1b.bench.gpu " + " ".join(argv or sys.argv[1:])
    settings = {k: (str(v) if isinstance(v, Size) else v) for k, v in vars(opts).items()
                if k not in ("out",)}
    settings["sizes"] = [str(s) for s in opts.sizes]
    env = gpu_check.environment(torch.device("cuda", 0) if opts._device == "cuda"
                                else torch.device("cpu"))
    if opts.attention_backend == "flash":
        flash_kernels_only()
    env["sdpa_cudnn"] = torch.backends.cuda.cudnn_sdp_enabled()
    deadline = start + opts.time_budget_s
    rows: list[Row] = []
    skipped: list[str] = []

    def report(final: bool = False) -> None:
        verdicts = targets(rows)
        data = {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "command": command, "environment": env, "settings": settings, "complete": final,
            "skipped_sizes": skipped, "seconds": round(time.monotonic() - start, 1),
            "targets": verdicts, "rows": [asdict(r) for r in rows],
        }
        write_report(out_dir, data, markdown(rows, env, settings, command), verdicts,
                     say if final else None)

    gpu_check.init_single_rank(argparse.Namespace(
        num_layers=opts.num_layers, hidden_size=opts.sizes[0].hidden,
        num_attention_heads=opts.sizes[0].heads, seq_length=opts.sizes[0].seq,
        microbatches=opts.microbatches, vocab_size=opts.vocab_size, seed=1234, splits=1,
        partition=opts.partition))
    try:
        for size in opts.sizes:
            if time.monotonic() > deadline:
                skipped.append(str(size))
                continue
            say(f"[gpu_bench] {size}, heads {size.heads}")

            def saved(size_rows: list[Row], before: int = len(rows)) -> None:
                rows[before:] = size_rows
                report()

            bench_size(opts, size, say, deadline, saved)
        if time.monotonic() < deadline:
            try:
                profile = seq1f1b_profile(opts, opts.sizes[0], opts.profile_k)
                (out_dir / PROFILE).write_text(profile)
            except Exception as exc:  # noqa: BLE001 - the rows are what matters
                say(f"[gpu_bench] profile not taken: {failure_note(exc)}")
            release_memory()
    finally:
        shutdown(say, "gpu_bench")
        report()
    left = deadline - time.monotonic()
    if opts.megatron_lm and left > 60:
        rows += megatron_lm_rows(opts, out_dir, say, timeout_s=min(opts.lm_timeout_s, left / 2))
    report(final=True)
    if skipped:
        say(f"[gpu_bench] time budget spent: sizes left out: {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
