#!/usr/bin/env python
"""Benchmark Megatron-Core's pipeline schedules against Seq1F1B on one model, side by side.

Launch with torchrun (CPU ranks with gloo, one thread each, or GPUs with NCCL)::

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 2 scripts/benchmark.py \
        --pp 2 --microbatches 4 --splits 4 --seq-length 1024 --hidden-size 256 \
        --num-layers 4 --iters 6 --warmup 2 --out out/bench_p2

One invocation builds the model once per layout (non-interleaved, and
interleaved with ``--vpp``; both hold the same weights, copied across the
layouts) and one fixed set of micro-batches, then runs the schedules
alternately (A B C A B C ...) after warm-up runs:

* ``1f1b``                Megatron-Core 1F1B
* ``seq1f1b-k1``          Seq1F1B with one segment (the cost of our executor)
* ``seq1f1b-uniform``     Seq1F1B, k segments of equal length
* ``seq1f1b-balanced``    Seq1F1B, k segments of equal estimated FLOPs
* ``1f1b-interleaved``    Megatron-Core interleaved 1F1B (with ``--vpp``)
* ``seq1f1b-interleaved`` interleaved Seq1F1B (with ``--vpp``)
* ``1f1b-interleaved-recompute`` Megatron interleaved 1F1B with full activation
  recompute (only when named in ``--schedules``): a memory-matched baseline

Each run is one forward-backward over all micro-batches (no optimizer step;
gradient buffers are zeroed between runs); the first run of every schedule
checks that all give the same loss. Reported per schedule: median iteration
time (slowest rank), tokens/s, the paired ratio (median over rounds of the
per-round time ratio), process CPU time per stage, peak memory per pipeline
stage (real allocations, :class:`megatron_seq1f1b.memory.PeakMemory`, above
the resident set at the start of the run), and ratios against Megatron 1F1B.

Then, unless disabled: measured timelines of one extra iteration (the
recorder for Seq1F1B; timed ``forward_step``/``backward_step`` calls for
Megatron), drawn as PNG and Chrome trace; a calibration of every stage's
per-segment forward/backward times and of the p2p message time; a
least-squares fit ``time = a*len + c*quad(len, end) + d`` per stage; and
predictions with :func:`megatron_seq1f1b.simulate.simulate` (plus a replay
with p2p latency and, when ranks oversubscribe the CPU cores, processor
sharing) for the measured configuration and for larger pipelines.

Outputs in ``--out``: ``results.json``, ``results.md``, ``benchmark.png``,
``timeline_<schedule>_{measured,simulated}.png``, ``timeline_<schedule>_measured.json``
(Chrome trace) and, with ``--profile``, ``profile_<schedule>_rank<r>.txt``.
On CPU set ``MALLOC_MMAP_THRESHOLD_=65536`` before the processes start (see
:mod:`megatron_seq1f1b.memory`); without it peak memory is not valid. CPU
ranks use ``SEQ1F1B_THREADS_PER_RANK`` threads (default 1).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import importlib.util
import io
import itertools
import json
import math
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import megatron_seq1f1b as s1  # noqa: E402
from megatron_seq1f1b.memory import MMAP_THRESHOLD_HINT, PeakMemory  # noqa: E402
from megatron_seq1f1b.checks import segment_multiple  # noqa: E402
from megatron_seq1f1b.partition import causal_pairs, split_sequence  # noqa: E402
from megatron_seq1f1b.replay import Interval, Timeline  # noqa: E402
from megatron_seq1f1b.schedule import Action, B, F, build_schedule  # noqa: E402

ALL_SCHEDULES = ("1f1b", "seq1f1b-k1", "seq1f1b-uniform", "seq1f1b-balanced",
                 "1f1b-interleaved", "seq1f1b-interleaved", "1f1b-interleaved-recompute")
INTERLEAVED = ("1f1b-interleaved", "seq1f1b-interleaved", "1f1b-interleaved-recompute")
OPT_IN = ("1f1b-interleaved-recompute",)
MiB = 2 ** 20


# ------------------------------------------------------------------ arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Megatron-Core 1F1B vs Seq1F1B, side by side (launch with torchrun).",
        allow_abbrev=False,
    )
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--vpp", type=int, default=None,
                   help="model chunks per rank (virtual pipeline size); adds the interleaved "
                        "schedules")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per iteration (m)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--splits", type=int, default=4, help="Seq1F1B segments per micro-batch (k)")
    p.add_argument("--schedules", nargs="+", choices=ALL_SCHEDULES, default=None,
                   help="default: all (the interleaved ones only with --vpp)")
    p.add_argument("--interleaved-partition", choices=("uniform", "balanced"), default="balanced",
                   help="partition of interleaved Seq1F1B")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"),
                   default="rope")
    p.add_argument("--bf16", action="store_true", help="GPU only")
    p.add_argument("--iters", type=int, default=6, help="measured runs per schedule")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured runs per schedule first")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="out/benchmark", help="output directory")
    p.add_argument("--no-timelines", action="store_true", help="skip the recorded iterations")
    p.add_argument("--timeline-runs", type=int, default=1,
                   help="recorded iterations per schedule; the median-makespan one is drawn")
    p.add_argument("--no-calibration", action="store_true",
                   help="skip per-segment cost calibration and calibrated predictions")
    p.add_argument("--calib-reps", type=int, default=3,
                   help="timed repetitions per calibration case (after one warm-up); the "
                        "fastest counts")
    p.add_argument("--calib-mode", choices=("isolated", "concurrent", "both"), default="both",
                   help="isolated: one pipeline stage at a time (no CPU contention); "
                        "concurrent: all stages at once")
    p.add_argument("--predict-pp", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--predict-microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--profile", action="store_true",
                   help="cProfile one extra run of every schedule on --profile-rank")
    p.add_argument("--profile-rank", type=int, default=0)
    p.add_argument("--loss-rtol", type=float, default=1e-4,
                   help="first-iteration losses of all schedules must agree this closely")
    args = p.parse_args(argv)
    if args.schedules is None:
        args.schedules = [s for s in ALL_SCHEDULES
                          if (args.vpp or s not in INTERLEAVED) and s not in OPT_IN]
        if args.splits == 1:
            args.schedules = [s for s in args.schedules
                              if s not in ("seq1f1b-uniform", "seq1f1b-balanced")]
    if any(s in INTERLEAVED for s in args.schedules) and not args.vpp:
        p.error("the interleaved schedules need --vpp")
    if args.vpp is not None and args.vpp < 2:
        p.error("--vpp must be >= 2 (omit it for the non-interleaved schedules)")
    if args.vpp and args.num_layers % (args.pp * args.vpp):
        p.error(f"--num-layers {args.num_layers} must divide by --pp x --vpp")
    if any(s.startswith("1f1b-interleaved") for s in args.schedules) and \
            args.microbatches % args.pp:
        p.error("Megatron's interleaved schedule needs --microbatches divisible by --pp")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def trainer_argv(args, interleaved: bool) -> list[str]:
    """The standalone trainer's flags for one layout (reuses its validation and setup)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = max(world // (args.tp * args.pp), 1)
    argv = [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--vocab-size", str(args.vocab_size),
        "--position-embedding-type", args.position_embedding_type, "--mock-data",
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.micro_batch_size * args.microbatches * dp),
        "--tensor-model-parallel-size", str(args.tp),
        "--pipeline-model-parallel-size", str(args.pp),
        "--seed", str(args.seed), "--train-iters", "1",
        "--seq1f1b", "--seq1f1b-splits", str(args.splits),  # build_model enables segments
    ]
    if args.sequence_parallel:
        argv.append("--sequence-parallel")
    if args.bf16:
        argv.append("--bf16")
    if interleaved:
        argv += ["--num-layers-per-virtual-pipeline-stage",
                 str(args.num_layers // (args.pp * args.vpp))]
    return argv


def load_pretrain_gpt():
    """scripts/pretrain_gpt.py as a module (model_provider, forward_step)."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "scripts" /
                                                  "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ layouts and schedules


@dataclass
class Layout:
    name: str
    targs: argparse.Namespace
    config: object
    model: list  # DDP-wrapped chunks of this rank
    vpp: int | None

    @property
    def chunks(self) -> int:
        return len(self.model)

    def activate(self) -> None:
        from megatron.core import parallel_state

        parallel_state.set_virtual_pipeline_model_parallel_world_size(self.vpp)


@dataclass
class Schedule:
    key: str
    label: str
    layout: Layout
    megatron: bool
    k: int
    partition: str | None
    lengths: list[int]
    fb: object = None
    times: list[float] = field(default_factory=list)
    peaks: list[list[int]] = field(default_factory=list)  # per run, per stage (bytes)
    cpu: list[list[float]] = field(default_factory=list)  # per run, per stage (CPU seconds)
    first_loss: float | None = None
    timeline: dict | None = None
    prediction: dict | None = None
    recompute: bool = False  # full activation recompute (Megatron's, one layer at a time)

    @contextlib.contextmanager
    def options(self):
        """Per-schedule model options (set on the shared config only while this one runs)."""
        if not self.recompute:
            yield
            return
        config = self.layout.config
        saved = (config.recompute_granularity, config.recompute_method,
                 config.recompute_num_layers)
        config.recompute_granularity, config.recompute_method = "full", "uniform"
        config.recompute_num_layers = 1
        try:
            yield
        finally:
            (config.recompute_granularity, config.recompute_method,
             config.recompute_num_layers) = saved


def segment_lengths(args, k: int, partition: str, layout: Layout, vocab_size: int) -> list[int]:
    """The lengths the executor itself would choose for this model (passed explicitly)."""
    from megatron_seq1f1b.executor import resolve_lengths

    return resolve_lengths(k, partition, None, args.seq_length, layout.model, layout.config,
                           vocab_size)


def make_schedules(args, layouts: dict, vocab_size: int) -> list[Schedule]:
    from megatron.core.pipeline_parallel import schedules as msched

    made = []
    for key in args.schedules:
        interleaved = key in INTERLEAVED
        layout = layouts["interleaved" if interleaved else "plain"]
        v = f", v={args.vpp}" if interleaved else ""
        if key.startswith("1f1b"):
            label = ("Megatron interleaved 1F1B" if interleaved else "Megatron 1F1B") + v
            recompute = key.endswith("-recompute")
            label += " + full recompute" if recompute else ""
            sched = Schedule(key, label, layout, True, 1, None, [args.seq_length],
                             recompute=recompute)
            sched.fb = msched.get_forward_backward_func(args.pp, args.vpp if interleaved else None)
        else:
            if key == "seq1f1b-k1":
                k, partition = 1, "uniform"
            elif key == "seq1f1b-interleaved":
                k, partition = args.splits, args.interleaved_partition
            else:
                k, partition = args.splits, key.split("-")[1]
            lengths = segment_lengths(args, k, partition, layout, vocab_size)
            name = "interleaved Seq1F1B" if interleaved else "Seq1F1B"
            label = f"{name} k={k}" + (f" {partition}" if k > 1 else "") + v
            sched = Schedule(key, label, layout, False, k, partition, lengths)
            sched.fb = s1.get_forward_backward_func(k, partition, split_lengths=lengths)
        made.append(sched)
    return made


# ------------------------------------------------------------------ helpers


def rank0() -> bool:
    return dist.get_rank() == 0


def say(message: str) -> None:
    if rank0():
        print(message, flush=True)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _global_name(gpt, name: str, tied: bool) -> str:
    if name.startswith("decoder.layers."):
        _, _, index, rest = name.split(".", 3)
        return f"layer{gpt.decoder.layers[int(index)].layer_number}.{rest}"
    if name == "output_layer.weight" and tied:
        return "embedding.word_embeddings.weight"
    return name


def _named_global_params(model, tied: bool) -> dict:
    from megatron_seq1f1b.model import unwrap

    params = {}
    for chunk in model:
        gpt = unwrap(chunk)
        for name, param in gpt.named_parameters():
            params[_global_name(gpt, name, tied)] = param
    return params


def copy_weights_across_layouts(src: Layout, dst: Layout, tied: bool) -> None:
    """Give `dst` (other layer-to-rank map) exactly the weights of `src` (collective)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    mine = {name: p.detach().cpu().clone() for name, p in _named_global_params(src.model, tied).items()}
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (tp_rank, mine))
    table = {}
    for their_tp, params in everything:
        if their_tp == tp_rank:
            table.update(params)
    with torch.no_grad():
        for name, param in _named_global_params(dst.model, tied).items():
            param.copy_(table[name].to(param.device))


def microbatches(targs, args) -> list[dict]:
    """This data-parallel rank's m micro-batches, materialized once and reused by every run."""
    from megatron.core import parallel_state

    from megatron_seq1f1b.trainer import data

    tokenizer = data.make_tokenizer(targs)
    train, _ = data.build_datasets(targs, tokenizer, train_samples=targs.global_batch_size,
                                   eval_samples=1)
    dp_rank = parallel_state.get_data_parallel_rank()
    stream = data.batches(train, targs.micro_batch_size, dp_rank, targs.data_parallel_size)
    return [next(stream) for _ in range(args.microbatches)]


def per_stage(*values: float) -> list[list[float]]:
    """Each value per pipeline stage (max over the stage's tensor/data-parallel ranks)."""
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    mine = torch.tensor([stage, *values], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    result = [[0.0] * stages for _ in values]
    for row in everyone:
        for i in range(len(values)):
            result[i][int(row[0])] = max(result[i][int(row[0])], row[1 + i].item())
    return result


def loss_of(store: list) -> tuple[float, float]:
    """(loss sum, tokens) of this rank's forward data store (non-zero on the last stage)."""
    total = [0.0, 0.0]
    for entry in store:
        report = entry["lm loss"]
        total[0] += float(report[0])
        total[1] += float(report[1])
    return total[0], total[1]


# ------------------------------------------------------------------ one run


@contextlib.contextmanager
def megatron_step_timer(recorder, chunks: list):
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


def run_once(sched: Schedule, batches: list, args, forward_step, memory: PeakMemory, *,
             fb=None, profile: cProfile.Profile | None = None, on_start=None) -> dict:
    """One forward-backward of all micro-batches; collective; returns time, peaks, loss."""
    layout = sched.layout
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


# ------------------------------------------------------------------ timelines


def timeline_stats(timeline: Timeline) -> dict:
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


def record_timeline(sched: Schedule, batches, args, forward_step, memory, group):
    """One extra iteration with per-action timing; returns the gathered Timeline (all ranks)."""
    from megatron_seq1f1b.trace import TimelineRecorder

    recorder = TimelineRecorder()
    if sched.megatron:
        with megatron_step_timer(recorder, sched.layout.model):
            run_once(sched, batches, args, forward_step, memory,
                     on_start=lambda: recorder.begin(dist.get_rank()))
    else:
        fb = s1.get_forward_backward_func(sched.k, sched.partition, split_lengths=sched.lengths,
                                          recorder=recorder)
        run_once(sched, batches, args, forward_step, memory, fb=fb)
    return recorder.gather(-1, group=group)


# ------------------------------------------------------------------ calibration


def measure_p2p(args, config, token_counts, reps: int = 5) -> list[list[float]]:
    """One-way time of a pipeline message per size: ping-pong between neighbouring stages.

    One neighbour pair at a time (the others wait at a barrier). Returns
    [[bytes, seconds], ...] from every pair (collective).
    """
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    pp_rank, p = group.rank(), group.size()
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for stage in range(p - 1):
        dist.barrier()
        if pp_rank not in (stage, stage + 1):
            continue
        peer = dist.get_global_rank(group, stage + 1 if pp_rank == stage else stage)
        for tokens in token_counts:
            tensor = torch.zeros(tokens // tp, args.micro_batch_size, config.hidden_size,
                                 dtype=config.pipeline_dtype, device=device)
            samples = []
            for rep in range(reps + 1):
                synchronize()
                start = time.perf_counter()
                if pp_rank == stage:
                    dist.send(tensor, peer)
                    dist.recv(tensor, peer)
                else:
                    dist.recv(tensor, peer)
                    dist.send(tensor, peer)
                synchronize()
                if rep:
                    samples.append((time.perf_counter() - start) / 2)
            if pp_rank == stage:
                rows.append([float(tensor.numel() * tensor.element_size()),
                             statistics.median(samples)])
    dist.barrier()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return [row for part in gathered for row in part]


def message_latency(p2p_fit: dict, lengths, args, config) -> float:
    """Mean one-way time of one schedule's messages (all segments occur equally often)."""
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    element = torch.empty((), dtype=config.pipeline_dtype).element_size()
    sizes = [n // tp * args.micro_batch_size * config.hidden_size * element for n in lengths]
    return sum(p2p_fit["alpha"] + p2p_fit["beta"] * b for b in sizes) / len(sizes)


def calibration_cases(args, layout: Layout, vocab_size) -> list[list[int]]:
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


def _time_microbatch(chunk, chunk_index, lengths, batch, forward_step, config, args, pre, post):
    """Forward segments 0..k-1 then backward k-1..0 of one micro-batch on one chunk.

    Returns [(length, end, forward_s, backward_s)] per segment. Inputs of
    non-first chunks are random activations of the segment's shape; outputs of
    non-last chunks get random gradients.
    """
    from megatron.core.utils import get_attr_wrapped_model

    from megatron_seq1f1b.segments import SegmentRun

    run = SegmentRun(lengths, config=config)
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    b, h = args.micro_batch_size, config.hidden_size
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = config.pipeline_dtype
    data = itertools.repeat(batch)
    set_input = get_attr_wrapped_model(chunk, "set_input_tensor")
    outputs, grads, rows = [], [], []
    end = 0
    for j, length in enumerate(lengths):
        end += length
        inp = None
        if not pre:
            inp = torch.randn(length // tp, b, h, device=device, dtype=dtype, requires_grad=True)
        grad = None if post else torch.randn(length // tp, b, h, device=device, dtype=dtype)
        synchronize()
        start = time.perf_counter()
        set_input([inp])
        with run.forward(0, j, chunk_index):
            output, loss_func = forward_step(data, chunk)
        if post:
            output = loss_func(output)[0]
        synchronize()
        rows.append([length, end, time.perf_counter() - start, 0.0])
        outputs.append(output)
        grads.append(grad)
    for j in reversed(range(len(lengths))):
        synchronize()
        start = time.perf_counter()
        with run.backward(0, j, chunk_index):
            torch.autograd.backward(outputs[j], grad_tensors=grads[j])
        synchronize()
        rows[j][3] = time.perf_counter() - start
        outputs[j] = None
    run.close()
    return rows


def calibrate_layout(layout: Layout, cases, batch, forward_step, args, mode: str) -> dict:
    """Per-segment forward/backward times of every chunk of this rank: {(stage, chunk): rows}."""
    from megatron.core import parallel_state

    layout.activate()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    config = layout.config
    mine: dict = {}

    def measure():
        for c, chunk in enumerate(layout.model):
            gpt = s1.model.unwrap(chunk)
            rows = []
            for lengths in cases:
                samples = []
                for rep in range(args.calib_reps + 1):
                    got = _time_microbatch(chunk, c, lengths, batch, forward_step, config, args,
                                           gpt.pre_process, gpt.post_process)
                    if rep:
                        samples.append(got)
                for j in range(len(lengths)):
                    rows.append([
                        lengths[j], samples[0][j][1],
                        # min: on a shared machine interference only ever adds time
                        min(s[j][2] for s in samples),
                        min(s[j][3] for s in samples),
                    ])
            mine[(pp_rank, c)] = rows
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


QUADRATIC = {
    "causal_pairs": lambda length, end: causal_pairs(length, end),
    "rectangle": lambda length, end: length * end,  # score entries a non-flash kernel computes
}


def _nonneg_lstsq(features: list[list[float]], target: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (best of all feature subsets)."""
    import numpy as np

    X, y = np.asarray(features, dtype=float), np.asarray(target, dtype=float)
    n = X.shape[1]
    best, best_res = [0.0] * n, math.inf
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            coef, *_ = np.linalg.lstsq(X[:, subset], y, rcond=None)
            if (coef < 0).any():
                continue
            res = float(((X[:, subset] @ coef - y) ** 2).sum())
            if res < best_res - 1e-15:
                full = [0.0] * n
                for i, value in zip(subset, coef):
                    full[i] = float(value)
                best, best_res = full, res
    return best


def fit_costs(rows_by_stage: dict, quadratic: str) -> dict:
    """time = a*len + c*quad(len, end) + d per (stage, chunk), forward and backward."""
    quad = QUADRATIC[quadratic]
    fits = {}
    for key, rows in rows_by_stage.items():
        features = [[length, quad(length, end), 1.0] for length, end, _, _ in rows]
        entry = {}
        for name, col in (("F", 2), ("B", 3)):
            target = [r[col] for r in rows]
            coef = _nonneg_lstsq(features, target)
            pred = [sum(c * x for c, x in zip(coef, f)) for f in features]
            rel = [abs(p - t) / t for p, t in zip(pred, target) if t > 0]
            entry[name] = {"a": coef[0], "c": coef[1], "d": coef[2],
                           "mean_rel_err": sum(rel) / max(len(rel), 1),
                           "max_rel_err": max(rel, default=0.0)}
        fits[key] = entry
    return fits


def _virtual_fits(fits: dict, p: int, v: int) -> list[dict]:
    """Fits in pipeline order (virtual stage = chunk * p + rank)."""
    return [fits[(vs % p, vs // p)] for vs in range(p * v)]


def extrapolated_fits(ordered: list[dict], stages: int) -> list[dict]:
    """Weak scaling: the first and last virtual stage keep their fit, the rest a middle one."""
    if stages == len(ordered):
        return ordered
    middle = ordered[1] if len(ordered) > 2 else ordered[0]
    return [ordered[0]] + [middle] * (stages - 2) + [ordered[-1]] if stages > 1 else [ordered[0]]


def fitted_cost(ordered_fits: list[dict], lengths: list[int], p: int, quadratic: str,
                recompute: bool = False):
    """cost(action, rank) from the fits; with full recompute a backward re-runs the forward."""
    quad = QUADRATIC[quadratic]
    ends = list(itertools.accumulate(lengths))

    def one(fit, length, end):
        return fit["a"] * length + fit["c"] * quad(length, end) + fit["d"]

    def cost(action: Action, rank: int) -> float:
        fits = ordered_fits[action.chunk * p + rank]
        length, end = lengths[action.segment], ends[action.segment]
        if action.is_forward:
            return one(fits["F"], length, end)
        return one(fits["B"], length, end) + (one(fits["F"], length, end) if recompute else 0.0)

    return cost


@dataclass
class SharedResult:
    makespan: float
    bubble_fraction: float
    peak_inflight: list[int]
    timeline: Timeline


def pipeline_replay(schedule, cost, cores: float | None = None,
                    latency: float = 0.0) -> SharedResult:
    """Replay with rendezvous p2p (as :func:`megatron_seq1f1b.replay.replay`), plus two effects.

    * ``latency``: a step that exchanges tensors starts computing ``latency``
      seconds after the last peer arrived (the replay's ``comm_latency``).
    * ``cores``: processor sharing. While n ranks compute at once, each
      progresses at ``min(1, cores / n)`` of its isolated speed (one thread per
      rank); models oversubscribed CPUs, where overlapping compute slows down
      and bubbles hand their core to the busy ranks. None: one device per rank.

    With neither, this is the plain replay that :func:`simulate` runs.
    """
    from megatron_seq1f1b.plan import plan_steps
    from megatron_seq1f1b.replay import index_messages
    from megatron_seq1f1b.schedule import schedule_shape
    from megatron_seq1f1b.simulate import peak_inflight

    _, _, _, chunks = schedule_shape(schedule)
    steps = plan_steps(schedule, chunks)
    sent, received = index_messages(steps)
    n = len(steps)
    position = [0] * n
    queue: list[list] = [[] for _ in range(n)]  # [action, remaining, start] of the current step
    start_at = [0.0] * n  # compute of the current step may begin then (after p2p latency)
    timeline = Timeline([[] for _ in range(n)], [[] for _ in range(n)])
    waiting_since = [0.0] * n
    now = 0.0

    def ready(rank: int) -> bool:
        step = steps[rank][position[rank]]
        for table, messages in ((received, step.sends), (sent, step.recvs)):
            for msg in messages:
                peer, peer_step = table[msg]
                if position[peer] < peer_step:
                    return False
        return True

    while True:
        progressed = True
        while progressed:
            progressed = False
            for rank in range(n):
                if queue[rank] or position[rank] >= len(steps[rank]) or not ready(rank):
                    continue
                step = steps[rank][position[rank]]
                comm = bool(step.sends or step.recvs)
                if step.actions:
                    queue[rank] = [[a, cost(a, rank), None] for a in step.actions]
                    start_at[rank] = now + (latency if comm else 0.0)
                    if comm and start_at[rank] > waiting_since[rank]:
                        timeline.waits[rank].append(Interval(
                            rank, waiting_since[rank], start_at[rank], None, position[rank]))
                else:
                    position[rank] += 1
                    waiting_since[rank] = now
                progressed = True
        pending = [r for r in range(n) if queue[r]]
        if not pending:
            if any(position[r] < len(steps[r]) for r in range(n)):
                raise RuntimeError("pipeline_replay: deadlock")
            break
        active = [r for r in pending if start_at[r] <= now + 1e-15]
        rate = 1.0 if cores is None else min(1.0, cores / max(len(active), 1))
        for r in active:
            if queue[r][0][2] is None:
                queue[r][0][2] = now
        candidates = [queue[r][0][1] / rate for r in active]
        candidates += [start_at[r] - now for r in pending if r not in active]
        dt = max(min(candidates), 0.0)
        now += dt
        for r in active:
            head = queue[r][0]
            head[1] -= dt * rate
            if head[1] <= 1e-12:
                timeline.compute[r].append(Interval(r, head[2], now, head[0], position[r]))
                queue[r].pop(0)
                if not queue[r]:
                    position[r] += 1
                    waiting_since[r] = now
    makespan = timeline.makespan
    busy = sum(iv.end - iv.start for rank in timeline.compute for iv in rank)
    bubble = 1.0 - busy / (makespan * n) if makespan else 0.0
    return SharedResult(makespan, bubble, [peak_inflight(a) for a in schedule], timeline)


def predict(ordered_fits, p, m, lengths, v, quadratic, recompute=False, cores=None,
            latency=0.0):
    """Simulated iteration with fitted costs: simulate(), or pipeline_replay() when p2p
    latency or shared cores (fewer than p) are modelled."""
    from megatron_seq1f1b.simulate import simulate

    schedule = build_schedule(p, m, len(lengths), v)
    cost = fitted_cost(ordered_fits, lengths, p, quadratic, recompute)
    if cores is not None and cores >= p:
        cores = None
    if cores is None and not latency:
        return simulate(schedule, cost)
    return pipeline_replay(schedule, cost, cores, latency)


# ------------------------------------------------------------------ reports


def fmt_mib(value: float) -> str:
    return f"{value / MiB:.1f}"


def summarize(schedules: list[Schedule], args, tokens_per_iter: int) -> list[dict]:
    base = next((s for s in schedules if s.key == "1f1b"), None)
    base_i = next((s for s in schedules if s.key == "1f1b-interleaved"), None)
    rows = []
    for s in schedules:
        median = statistics.median(s.times)
        stages = len(s.peaks[0])
        peak_median = [statistics.median(run[i] for run in s.peaks) for i in range(stages)]
        peak_max = [max(run[i] for run in s.peaks) for i in range(stages)]
        cpu_median = [statistics.median(run[i] for run in s.cpu) for i in range(stages)]
        rows.append({
            "key": s.key, "label": s.label, "megatron": s.megatron, "k": s.k,
            "partition": s.partition, "lengths": s.lengths,
            "vpp": s.layout.vpp, "times_s": s.times, "median_s": median,
            "min_s": min(s.times), "max_s": max(s.times),
            "tokens_per_s": tokens_per_iter / median,
            "peak_bytes_per_stage": peak_median, "peak_bytes_per_stage_max": peak_max,
            "cpu_s_per_stage": cpu_median, "cpu_s_total": sum(cpu_median),
            "first_iteration_loss": s.first_loss,
            "timeline": s.timeline, "prediction": s.prediction,
        })
    by_key = {r["key"]: r for r in rows}
    for r in rows:
        for name, ref in (("vs_1f1b", base), ("vs_1f1b_interleaved", base_i)):
            if ref is None:
                continue
            b = by_key[ref.key]
            r[f"speedup_{name}"] = r["tokens_per_s"] / b["tokens_per_s"]
            # Runs alternate, so run i of every schedule saw the same machine state: the
            # median of per-round ratios is less sensitive to drift than a ratio of medians.
            paired = [bt / t for bt, t in zip(b["times_s"], r["times_s"])]
            r[f"paired_speedup_{name}"] = statistics.median(paired)
            r[f"paired_speedup_{name}_range"] = [min(paired), max(paired)]
            r[f"cpu_ratio_{name}"] = r["cpu_s_total"] / b["cpu_s_total"]
            r[f"peak_ratio_{name}"] = [
                (x / y if y else None) for x, y in zip(r["peak_bytes_per_stage"],
                                                      b["peak_bytes_per_stage"])]
    return rows


def markdown(rows, args, meta, calibration, predictions) -> str:
    lines = [f"# Benchmark: p={args.pp}, m={args.microbatches}, k={args.splits}"
             + (f", v={args.vpp}" if args.vpp else ""), ""]
    lines.append(
        f"Model: {args.num_layers} layers, hidden {args.hidden_size}, "
        f"{args.num_attention_heads} heads, vocabulary {args.vocab_size}, "
        f"{args.position_embedding_type}; sequence {args.seq_length}, micro-batch size "
        f"{args.micro_batch_size}, tp {args.tp}, dp {meta['dp']}. {meta['device']}, "
        f"{meta['world_size']} ranks, {meta['cpu_count']} CPU cores, "
        f"{meta['threads_per_rank']} thread(s) per rank. {args.iters} measured runs per "
        f"schedule after {args.warmup} warm-up runs, alternating; forward-backward only "
        "(no optimizer step).")
    if not meta["memory_valid"]:
        lines += ["", f"**Peak memory is not valid in this run**: CPU without "
                  f"{MMAP_THRESHOLD_HINT} (freed tensors stay resident)."]
    lines.append("")
    lines.append("| schedule | segments | median ms (min–max) | tokens/s | × 1F1B | paired × 1F1B "
                 "(min–max) | CPU s per stage | CPU × 1F1B | peak MiB per stage | stage-0 mem × "
                 "1F1B | predicted ms | pred. error |")
    lines.append("|---|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|")

    def num(value, spec):
        return "-" if value is None else format(value, spec)

    for r in rows:
        ref = "vs_1f1b_interleaved" if r["vpp"] and "speedup_vs_1f1b_interleaved" in r \
            else "vs_1f1b"
        mem = (r.get(f"peak_ratio_{ref}") or [None])[0]
        pred = r.get("prediction") or {}
        segs = "-" if r["megatron"] else "/".join(str(n) for n in r["lengths"])
        paired = "-"
        if r.get(f"paired_speedup_{ref}") is not None:
            low, high = r[f"paired_speedup_{ref}_range"]
            paired = f"{r[f'paired_speedup_{ref}']:.3f} ({low:.2f}–{high:.2f})"
        lines.append(
            f"| {r['label']} | {segs} | {r['median_s'] * 1e3:.0f} ({r['min_s'] * 1e3:.0f}–"
            f"{r['max_s'] * 1e3:.0f}) | {r['tokens_per_s']:.0f} | "
            f"{num(r.get(f'speedup_{ref}'), '.3f')} | {paired} | "
            f"{' / '.join(f'{x:.2f}' for x in r['cpu_s_per_stage'])} | "
            f"{num(r.get(f'cpu_ratio_{ref}'), '.3f')} | "
            f"{' / '.join(fmt_mib(x) for x in r['peak_bytes_per_stage'])} | {num(mem, '.2f')} | "
            f"{num(pred.get('makespan_s') and pred['makespan_s'] * 1e3, '.0f')} | "
            f"{num(pred.get('rel_error'), '+.1%')} |")
    lines.append("")
    lines.append("Ratios of interleaved schedules are against Megatron interleaved 1F1B when it "
                 "ran, of the others against Megatron 1F1B. Paired: median over rounds of the "
                 "ratio of the two schedules' times in the same round. CPU s: process CPU time of the "
                 "forward-backward per stage (insensitive to other processes' load; includes "
                 "p2p threads). Peak memory: real allocations above the resident set at the start "
                 f"of the run (median over runs). Load average before/after: "
                 f"{meta['loadavg_start']:.1f} / {meta['loadavg_end']:.1f}.")
    timed = [r for r in rows if r.get("timeline")]
    if timed:
        lines += ["", f"## Measured timelines (median of {args.timeline_runs} recorded "
                  "iteration(s))", "",
                  "Busy: time inside compute actions; bubble: idle share of ranks × makespan; "
                  "busy ÷ simulated busy > 1 means the actions ran slower in the pipeline than "
                  "the calibration predicts.", "",
                  "| schedule | makespan ms | bubble (idle share) | busy ms per rank | p2p wait ms "
                  "per rank | simulated bubble | busy ÷ simulated busy |",
                  "|---|---:|---:|---|---|---:|---:|"]
        for r in timed:
            t = r["timeline"]
            sim = (r.get("prediction") or {}).get("bubble_fraction")
            sim_busy = (r.get("prediction") or {}).get("busy_s")
            inflation = f"{sum(t['busy_s']) / sum(sim_busy):.2f}" if sim_busy else "-"
            lines.append(
                f"| {r['label']} | {t['makespan_s'] * 1e3:.0f} | {t['bubble_fraction']:.1%} | "
                f"{' / '.join(f'{x * 1e3:.0f}' for x in t['busy_s'])} | "
                f"{' / '.join(f'{x * 1e3:.0f}' for x in t['p2p_wait_s']) or '-'} | "
                f"{'-' if sim is None else f'{sim:.1%}'} | {inflation} |")
    if calibration:
        lines += ["", "## Cost calibration", "",
                  f"Predictions: {calibration['prediction_variant']}; quadratic term: "
                  f"{calibration['quadratic']} (mean relative fit error of both: "
                  + ", ".join(f"{q} {e:.1%}" for q, e in calibration["fit_error"].items())
                  + "). time = a·len + c·quad + d per stage, forward / backward:", "",
                  "| layout | stage.chunk | F a (µs/token) | F c (ns/quad) | F d (ms) | "
                  "B a (µs/token) | B c (ns/quad) | B d (ms) | fit error F / B |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        if calibration.get("p2p"):
            p2p = calibration["p2p"]
            lines[-3:-3] = ["", f"Pipeline message (ping-pong between neighbouring stages): "
                            f"{p2p['alpha'] * 1e3:.3f} ms + {p2p['beta'] * 1e9:.3f} ns/byte one "
                            "way; used as the per-step latency of the replay."]
        for layout, fits in calibration["fits"].items():
            for key, fit in fits.items():
                f_, b_ = fit["F"], fit["B"]
                lines.append(
                    f"| {layout} | {key} | {f_['a'] * 1e6:.2f} | {f_['c'] * 1e9:.2f} | "
                    f"{f_['d'] * 1e3:.2f} | {b_['a'] * 1e6:.2f} | {b_['c'] * 1e9:.2f} | "
                    f"{b_['d'] * 1e3:.2f} | {f_['mean_rel_err']:.1%} / {b_['mean_rel_err']:.1%} |")
        if calibration.get("other_variants"):
            lines += ["", "Predictions of the measured configuration (primary: "
                      f"{calibration['prediction_variant']}) and with the other variants:", "",
                      "| schedule | measured ms | " + " | ".join(
                          [calibration["prediction_variant"]]
                          + [o["variant"] for o in calibration["other_variants"]]) + " |",
                      "|---|---:|" + "---:|" * (1 + len(calibration["other_variants"]))]
            for r in rows:
                cells = [r["prediction"]] + [o["predictions"][r["key"]]
                                             for o in calibration["other_variants"]]
                lines.append(f"| {r['label']} | {r['median_s'] * 1e3:.0f} | " + " | ".join(
                    f"{c['makespan_s'] * 1e3:.0f} ({c['rel_error']:+.1%})" for c in cells)
                    + " |")
    if predictions:
        lines += ["", "## Calibrated predictions for larger pipelines", "",
                  "simulate() with the fitted costs; weak scaling (every stage holds the measured "
                  "per-stage layers, first/last stage as measured); one device per stage; "
                  f"{calibration['mode_used']} calibration; no p2p latency.", ""]
        keys = [k for k in predictions[0]["schedules"]]
        lines.append("| p | m | " + " | ".join(f"{k} bubble" for k in keys) + " | "
                     + " | ".join(f"{k} × 1F1B" for k in keys if k != "1f1b") + " |")
        lines.append("|---:|---:|" + "---:|" * (2 * len(keys) - ("1f1b" in keys)))
        for row in predictions:
            sch = row["schedules"]
            base = sch.get("1f1b", {}).get("makespan_s")
            cells = [f"{sch[k]['bubble_fraction']:.1%}" for k in keys]
            cells += [f"{base / sch[k]['makespan_s']:.3f}" if base else "-"
                      for k in keys if k != "1f1b"]
            lines.append(f"| {row['p']} | {row['m']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bar_chart(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"].replace(" 1F1B", "\n1F1B").replace(" k=", "\nk=") for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(rows)), 4.6))
    colours = ["0.55" if r["megatron"] else "tab:blue" for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    bars = ax1.bar(range(len(rows)), values, color=colours)
    for bar, r in zip(bars, rows):
        speed = r.get("speedup_vs_1f1b_interleaved") if r["vpp"] else None
        speed = speed or r.get("speedup_vs_1f1b")
        if speed is not None:
            ax1.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{speed:.2f}×",
                     ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(rows)))
    ax1.set_xticklabels(labels, fontsize=7)
    ax1.set_ylabel("tokens / s (median)")
    ax1.set_title("throughput", fontsize=10)
    stages = len(rows[0]["peak_bytes_per_stage"])
    width = 0.8 / stages
    for stage in range(stages):
        ax2.bar([i + (stage - (stages - 1) / 2) * width for i in range(len(rows))],
                [r["peak_bytes_per_stage"][stage] / MiB for r in rows], width=width,
                label=f"stage {stage}")
    ax2.set_xticks(range(len(rows)))
    ax2.set_xticklabels(labels, fontsize=7)
    ax2.set_ylabel("peak MiB above start")
    ax2.set_title("peak memory per pipeline stage", fontsize=10)
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron.core import parallel_state

    from megatron_seq1f1b.trainer import arguments, data, setup

    pretrain_gpt = load_pretrain_gpt()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plain_args = arguments.parse(trainer_argv(args, False), world)
    data.quiet_logs()
    device = setup.init_distributed(plain_args)  # parallel state without virtual pipeline
    out = Path(args.out)
    if rank0():
        out.mkdir(parents=True, exist_ok=True)
    on_gpu = device.type == "cuda"
    if not on_gpu and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        say(f"WARNING: {MMAP_THRESHOLD_HINT} is not set: freed tensors can stay resident, so "
            "CPU peak memory is overestimated and schedules cannot be compared. Launch as "
            f"`{MMAP_THRESHOLD_HINT} torchrun ...`.")
    tied = True  # the trainer's default (no --untie-embeddings-and-output-weights)

    layouts = {}
    plain_config = setup.transformer_config(plain_args)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    layouts["plain"] = Layout("plain", plain_args, plain_config,
                              setup.build_model(plain_args, plain_config,
                                                pretrain_gpt.model_provider), None)
    if args.vpp:
        inter_args = arguments.parse(trainer_argv(args, True), world)
        inter_config = setup.transformer_config(inter_args)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(args.vpp)
        layouts["interleaved"] = Layout("interleaved", inter_args, inter_config,
                                        setup.build_model(inter_args, inter_config,
                                                          pretrain_gpt.model_provider), args.vpp)
        copy_weights_across_layouts(layouts["plain"], layouts["interleaved"], tied)

    batches = microbatches(plain_args, args)
    schedules = make_schedules(args, layouts, args.vocab_size)
    memory = PeakMemory(device)
    forward_step = pretrain_gpt.forward_step
    dp = plain_args.data_parallel_size
    tokens_per_iter = args.microbatches * args.micro_batch_size * args.seq_length * dp
    threads = torch.get_num_threads()
    cpu_count = os.cpu_count() or 1
    say(f"> benchmark: world {world} ({'GPU/NCCL' if on_gpu else 'CPU/gloo'}), tp {args.tp}, "
        f"pp {args.pp}, vpp {args.vpp}, dp {dp}; m={args.microbatches} x {args.micro_batch_size}"
        f" x {args.seq_length} tokens, k={args.splits}; {args.num_layers} layers, hidden "
        f"{args.hidden_size}; {threads} thread(s) per rank on {cpu_count} CPU cores")
    if not on_gpu and world * threads > cpu_count:
        say(f"> note: {world} ranks x {threads} thread(s) oversubscribe {cpu_count} cores: "
            "compute is slowed when ranks overlap, which also hides part of the bubbles")
    for s in schedules:
        say(f">   {s.key:<20} {s.label}" + ("" if s.megatron else f"  segments {s.lengths}"))

    loadavg_start = os.getloadavg()[0]
    # Warm-up (the first run of each schedule also gives the loss check), then alternate.
    for w in range(max(args.warmup, 1)):
        for s in schedules:
            result = run_once(s, batches, args, forward_step, memory)
            if w == 0:
                s.first_loss = result["loss"]
            if w >= args.warmup:  # --warmup 0: the loss-check run is measured too
                s.times.append(result["time"])
                s.peaks.append(result["peaks"])
                s.cpu.append(result["cpu"])
                say(f"  [run 1/{args.iters}] {s.label:<40} {result['time'] * 1e3:8.1f} ms  "
                    f"{tokens_per_iter / result['time']:8.0f} tokens/s  peak MiB per stage "
                    + " ".join(fmt_mib(x) for x in result["peaks"]))
        if w == 0:
            losses = [s.first_loss for s in schedules]
            ref = losses[0]
            worst = max(abs(x - ref) / abs(ref) for x in losses)
            say("> first-iteration loss: " + ", ".join(f"{s.key} {s.first_loss:.8f}"
                                                         for s in schedules)
                + f"  (max relative difference {worst:.1e}: "
                + ("OK)" if worst <= args.loss_rtol else "MISMATCH)"))
            if worst > args.loss_rtol:
                say(f"ERROR: schedules disagree on the loss by more than {args.loss_rtol}")
                return 2
    first_measured = 1 if args.warmup == 0 else 0
    for i in range(first_measured, args.iters):
        for s in schedules:
            result = run_once(s, batches, args, forward_step, memory)
            s.times.append(result["time"])
            s.peaks.append(result["peaks"])
            s.cpu.append(result["cpu"])
            say(f"  [run {i + 1}/{args.iters}] {s.label:<40} {result['time'] * 1e3:8.1f} ms  "
                f"{tokens_per_iter / result['time']:8.0f} tokens/s  peak MiB per stage "
                + " ".join(fmt_mib(x) for x in result["peaks"]))

    # Optional cProfile of one extra run per schedule on one rank.
    if args.profile:
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
                print(f"> cProfile of {s.key} on rank {args.profile_rank}: {path}", flush=True)

    # Measured timelines: --timeline-runs recorded iterations per schedule (alternating);
    # the one with the median makespan is kept and drawn.
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if not args.no_timelines:
        recorded = {s.key: [] for s in schedules}
        for _ in range(args.timeline_runs):
            for s in schedules:
                recorded[s.key].append(
                    record_timeline(s, batches, args, forward_step, memory, pp_group))
        for s in schedules:
            runs = sorted(recorded[s.key], key=lambda t: t.makespan)
            timeline = runs[(len(runs) - 1) // 2]
            s.timeline = timeline_stats(timeline)
            s.timeline["makespans_s"] = [t.makespan for t in recorded[s.key]]
            if rank0():
                from megatron_seq1f1b import draw

                title = (f"measured: {s.label}, p={args.pp}, m={args.microbatches}, "
                         f"makespan {s.timeline['makespan_s'] * 1e3:.0f} ms, bubble "
                         f"{s.timeline['bubble_fraction']:.1%}")
                draw.draw_png(timeline, out / f"timeline_{s.key}_measured.png", title=title,
                              time_label="seconds (measured)", show_waits=True)
                draw.write_chrome_trace(timeline, out / f"timeline_{s.key}_measured.json",
                                        time_unit_us=1e6)
            say(f"> timeline {s.key}: makespan {s.timeline['makespan_s'] * 1e3:.0f} ms, bubble "
                f"{s.timeline['bubble_fraction']:.1%}")

    # Calibration, fit, predictions.
    calibration, predictions = None, []
    if not args.no_calibration:
        cases = calibration_cases(args, layouts["plain"], args.vocab_size)
        modes = ("isolated", "concurrent") if args.calib_mode == "both" else (args.calib_mode,)
        say(f"> calibrating segment costs ({', '.join(modes)}), cases {cases}")
        raw = {mode: {name: calibrate_layout(layout, cases, batches[0], forward_step, args, mode)
                      for name, layout in layouts.items()} for mode in modes}
        # Cores per pipeline rank when this node's ranks oversubscribe its CPU cores.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        shared_cores = None
        if not on_gpu and local_world * threads > cpu_count:
            shared_cores = cpu_count * args.pp / (local_world * threads)

        # The calibration that matches the run: with a core (or device) per rank all
        # stages compute at once, as in the concurrent calibration; oversubscribed, the
        # isolated one plus processor sharing in the replay.
        mode_used = "isolated" if shared_cores and "isolated" in modes else (
            "concurrent" if "concurrent" in modes else modes[0])
        other_modes = [mode for mode in modes if mode != mode_used]
        p2p_fit = None
        if args.pp > 1:
            token_counts = sorted({n for case in cases for n in case})
            p2p_rows = measure_p2p(args, layouts["plain"].config, token_counts)
            coef = _nonneg_lstsq([[1.0, r[0]] for r in p2p_rows], [r[1] for r in p2p_rows])
            p2p_fit = {"alpha": coef[0], "beta": coef[1], "samples": p2p_rows}
            say(f"> p2p one-way time: {coef[0] * 1e3:.3f} ms + {coef[1] * 1e9:.3f} ns/byte "
                f"({len(p2p_rows)} samples)")
        # Pick the quadratic term that fits the data better (summed over stages, F and B).
        fit_error = {}
        for quadratic in QUADRATIC:
            errs = [fit[d]["mean_rel_err"] for layout in raw[mode_used].values()
                    for fit in fit_costs(layout, quadratic).values() for d in ("F", "B")]
            fit_error[quadratic] = sum(errs) / len(errs)
        quadratic = min(fit_error, key=fit_error.get)
        fits = {mode: {name: fit_costs(rows, quadratic) for name, rows in per.items()}
                for mode, per in raw.items()}

        def ordered_for(mode, layout_name):
            layout = layouts[layout_name]
            return _virtual_fits(fits[mode][layout_name], args.pp, layout.chunks)

        def predict_measured(mode, cores, with_latency):
            out_map = {}
            for s in schedules:
                layout = s.layout
                latency = message_latency(p2p_fit, s.lengths, args, layout.config) \
                    if with_latency and p2p_fit else 0.0
                result = predict(ordered_for(mode, layout.name), args.pp, args.microbatches,
                                 s.lengths, layout.chunks, quadratic, s.recompute, cores,
                                 latency)
                median = statistics.median(s.times)
                out_map[s.key] = {
                    "makespan_s": result.makespan, "bubble_fraction": result.bubble_fraction,
                    "rel_error": result.makespan / median - 1.0, "p2p_latency_s": latency,
                    "busy_s": [sum(iv.end - iv.start for iv in rank)
                               for rank in result.timeline.compute],
                    "variant": variant_name(mode, cores, with_latency),
                    "_timeline": result.timeline,
                }
            return out_map

        def variant_name(mode, cores, with_latency):
            if not with_latency and not cores:
                return f"simulate(), {mode} calibration"
            return (f"{mode} calibration" + (" + p2p latency" if with_latency else "")
                    + (f" + {cores:g} shared cores" if cores else ""))

        has_latency = p2p_fit is not None
        variants = [(mode_used, shared_cores, has_latency)]
        if shared_cores or has_latency:
            variants.append((mode_used, None, False))
        variants += [(mode, None, has_latency) for mode in other_modes]
        primary = variant_name(*variants[0])
        measured_pred = predict_measured(*variants[0])
        for s in schedules:
            entry = dict(measured_pred[s.key])
            sim_timeline = entry.pop("_timeline")
            s.prediction = entry
            if rank0() and not args.no_timelines:
                from megatron_seq1f1b import draw

                draw.draw_png(sim_timeline, out / f"timeline_{s.key}_simulated.png",
                              title=(f"simulated ({primary}): {s.label}, "
                                     f"p={args.pp}, m={args.microbatches}, makespan "
                                     f"{entry['makespan_s'] * 1e3:.0f} ms, bubble "
                                     f"{entry['bubble_fraction']:.1%}"),
                              time_label="seconds (simulated from calibrated costs)")
            say(f"> predicted {s.key} ({primary}): {entry['makespan_s'] * 1e3:.0f} ms "
                f"(measured median {statistics.median(s.times) * 1e3:.0f} ms, error "
                f"{entry['rel_error']:+.1%}), bubble {entry['bubble_fraction']:.1%}")
        other = []
        for variant in variants[1:]:
            preds = {k: {kk: vv for kk, vv in v.items() if kk != "_timeline"}
                     for k, v in predict_measured(*variant).items()}
            other.append({"variant": variant_name(*variant), "predictions": preds})
            for key, value in preds.items():
                say(f"> predicted {key} ({variant_name(*variant)}): "
                    f"{value['makespan_s'] * 1e3:.0f} ms (error {value['rel_error']:+.1%})")

        # Larger pipelines (weak scaling) with the isolated fits.
        plain_order = ordered_for(mode_used, "plain")
        inter_order = ordered_for(mode_used, "interleaved") if "interleaved" in layouts else None
        seq_lengths = {s.key: s.lengths for s in schedules}
        candidates = [("1f1b", [args.seq_length], 1)]
        for key in ("seq1f1b-uniform", "seq1f1b-balanced"):
            if key in seq_lengths:
                candidates.append((key, seq_lengths[key], 1))
        if inter_order is not None:
            candidates.append(("1f1b-interleaved", [args.seq_length], args.vpp))
            if "seq1f1b-interleaved" in seq_lengths:
                candidates.append(("seq1f1b-interleaved", seq_lengths["seq1f1b-interleaved"],
                                   args.vpp))
        for p_ in args.predict_pp:
            for m_ in args.predict_microbatches:
                row = {"p": p_, "m": m_, "schedules": {}}
                for key, lengths, v in candidates:
                    if v > 1 and p_ < 2:
                        continue
                    order = plain_order if v == 1 else inter_order
                    stage_fits = extrapolated_fits(order, p_ * v)
                    result = predict(stage_fits, p_, m_, lengths, v, quadratic)
                    row["schedules"][key] = {"makespan_s": result.makespan,
                                             "bubble_fraction": result.bubble_fraction,
                                             "peak_inflight_rank0_units": result.peak_inflight[0]}
                predictions.append(row)
        calibration = {
            "cases": cases, "mode_used": mode_used, "prediction_variant": primary,
            "shared_cores": shared_cores, "quadratic": quadratic, "p2p": p2p_fit,
            "fit_error": fit_error,
            "fits": {name: {f"{k[0]}.{k[1]}": v for k, v in per.items()}
                     for name, per in fits[mode_used].items()},
            "fits_other_mode": ({name: {f"{k[0]}.{k[1]}": v for k, v in per.items()}
                                 for name, per in fits[other_modes[0]].items()}
                                if other_modes else None),
            "samples": {mode: {name: {f"{k[0]}.{k[1]}": rows for k, rows in per.items()}
                               for name, per in per_mode.items()}
                        for mode, per_mode in raw.items()},
            "other_variants": other,
        }

    rows = summarize(schedules, args, tokens_per_iter)
    meta = {
        "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg()[0],
        "world_size": world, "dp": dp, "device": "GPU/NCCL" if on_gpu else "CPU/gloo",
        "cpu_count": cpu_count, "threads_per_rank": threads,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "memory_valid": on_gpu or "MALLOC_MMAP_THRESHOLD_" in os.environ,
        "tokens_per_iteration": tokens_per_iter, "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }
    if rank0():
        result = {"args": vars(args), "meta": meta, "schedules": rows,
                  "calibration": calibration, "predictions": predictions}
        (out / "results.json").write_text(json.dumps(result, indent=1))
        (out / "results.md").write_text(markdown(rows, args, meta, calibration, predictions))
        try:
            bar_chart(rows, out / "benchmark.png",
                      f"p={args.pp}, m={args.microbatches}, k={args.splits}, seq "
                      f"{args.seq_length}, hidden {args.hidden_size}, {args.num_layers} layers "
                      f"({meta['device']}, {world} ranks)")
        except ImportError:
            print("> matplotlib missing: no benchmark.png", flush=True)
        print("", flush=True)
        print((out / "results.md").read_text(), flush=True)
        print(f"> wrote {out}/results.json, results.md, benchmark.png", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
