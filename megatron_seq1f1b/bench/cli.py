"""The benchmark's flags, and ``main``: build, measure, calibrate, predict, report, in that order.

With ``--splits auto`` the calibration comes first (the ``seq1f1b-auto`` row runs the plan
chosen from it); its samples then serve the predictions as usual.

``scripts/benchmark.py`` is the command users run (under torchrun); it hands
``main`` the model provider and forward step of ``scripts/pretrain_gpt.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_seq1f1b.base.compat import megatron_core_version
from megatron_seq1f1b.base.flags import (
    ArgumentParser, OldSpelling, integer, non_negative_float, non_negative_int,
    positive_float, positive_int,
)
from megatron_seq1f1b.bench import autoplan, cp_report, packing, varlen
from megatron_seq1f1b.bench.calibration import calibrate
from megatron_seq1f1b.bench.confirm import Race, closest_rivals, confirmation, sweep_twin
from megatron_seq1f1b.bench.cp_bytes import attach_meters, measured_bytes
from megatron_seq1f1b.bench.document_stats import row_stats
from megatron_seq1f1b.bench.layouts import build_layouts, microbatches, trainer_argv
from megatron_seq1f1b.bench.lineup import (
    ALL_SCHEDULES, AUTO_KEY, DOCUMENTS_KEY, INTERLEAVED, OPT_IN, backend_attention, make_schedules,
    sweep_key,
)
from megatron_seq1f1b.bench.markdown import markdown
from megatron_seq1f1b.bench.pictures import (
    bar_chart, draw_measured_timelines, draw_simulated_timelines,
)
from megatron_seq1f1b.bench.predict import (
    backend_is_dense, calibrated_predictions, shared_cores_per_pipeline,
)
from megatron_seq1f1b.bench.ranks import rank0, say
from megatron_seq1f1b.bench.runner import confirm_rounds, diagnostic_runs, measure_rounds
from megatron_seq1f1b.bench.summary import auto_vs_sweep, reference_key, summarize
from megatron_seq1f1b.bench.timelines import record_timelines
from megatron_seq1f1b.megatron_lm.arguments import AUTO, splits_value
from megatron_seq1f1b.planner.peak_memory import MMAP_THRESHOLD_HINT, PeakMemory
from megatron_seq1f1b.planner.model_flags import add_recurrent_arguments
from megatron_seq1f1b.trainer import arguments, data, setup


def build_parser() -> arguments.StartupParser:
    """The benchmark's flags; every number is checked as it is read. An error is one line,
    printed once under torchrun (rank 0), and every rank exits with status 2 before any
    process group exists (:func:`megatron_seq1f1b.trainer.arguments.refuse`)."""
    p = arguments.StartupParser(
        prog="scripts/benchmark.py",
        description="Megatron-Core 1F1B vs Seq1F1B, side by side (launch with torchrun).",
        allow_abbrev=False,
    )
    p.add_argument("--pp", type=positive_int, default=2, help="pipeline stages")
    p.add_argument("--vpp", type=integer(2), default=None,
                   help="model chunks per rank (virtual pipeline size); adds the interleaved "
                        "schedules")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", "--context-parallel-size", type=positive_int, default=1,
                   dest="context_parallel_size", metavar="N",
                   help="context-parallel size: every Seq1F1B segment spread over N ranks "
                        "(world = tp x pp x cp x dp). N > 1 runs Seq1F1B rows only "
                        "(Megatron's schedules have no CP exchange for its attentions); "
                        "seq1f1b-k1 is then the reference row, and the calibration is off")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--microbatches", type=positive_int, default=4,
                   help="micro-batches per iteration (m)")
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument("--splits", type=splits_value, default=4,
                   help="Seq1F1B segments per micro-batch (k), or auto: calibrate first, let "
                        "the planner choose k, partition and schedule (row seq1f1b-auto); the "
                        "fixed-k rows then use the chosen k")
    p.add_argument("--sweep-splits", type=positive_int, nargs="+", default=None, metavar="K",
                   help="add rows seq1f1b-k<K> (balanced, 1F1B schedule) for each K")
    p.add_argument("--min-segment-length", type=positive_int, default=128,
                   help="--splits auto: shortest segment the plan may use (tokens)")
    p.add_argument("--confirm-rounds", type=non_negative_int, default=None, metavar="N",
                   help="--splits auto with --sweep-splits: after the measured rounds, at most "
                        "N more rounds of the auto row and its closest sweep rivals alone "
                        "decide the verdict; a rival leaves once auto is surely within or "
                        "surely short of the target against it (looks after round 8 and every "
                        "4th; default 40; 0: the sweep's own runs decide); a sweep row that "
                        "runs the auto plan itself joins them as a control")
    p.add_argument("--confirm-rivals", type=positive_int, default=3, metavar="N",
                   help="the N fastest sweep rows run in the confirmation rounds")
    p.add_argument("--memory-budget-microbatches", "--memory-budget", type=positive_float,
                   dest="memory_budget_microbatches", default=None, metavar="N",
                   action=OldSpelling, old="--memory-budget",
                   why="micro-batches of a stage, not MB",
                   help="--splits auto: most activations per stage the plan may hold, in "
                        "micro-batches of a stage (--memory-budget is its old spelling)")
    p.add_argument("--schedules", nargs="+", choices=ALL_SCHEDULES, default=None,
                   help="default: all (the interleaved ones only with --vpp)")
    p.add_argument("--interleaved-partition", choices=("uniform", "balanced"), default="balanced",
                   help="partition of interleaved Seq1F1B")
    p.add_argument("--seq-length", type=positive_int, default=1024)
    p.add_argument("--hidden-size", type=positive_int, default=256)
    p.add_argument("--num-layers", type=positive_int, default=4)
    p.add_argument("--num-attention-heads", type=positive_int, default=4)
    p.add_argument("--vocab-size", type=positive_int, default=1024)
    p.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"),
                   default="rope")
    p.add_argument("--window-size", type=non_negative_int, default=None, metavar="W",
                   help="sliding-window attention: every token sees the W tokens before it "
                        "(all schedules)")
    p.add_argument("--window-attn-skip-freq", type=positive_int, default=None, metavar="N",
                   help="with --window-size: every N-th layer attends to the whole prefix")
    p.add_argument("--hybrid-layer-pattern", default=None, metavar="PATTERN",
                   help="Megatron-Core's HybridModel (0.18+, the trainer's flag): one symbol per "
                        "layer, '*' attention, 'M' Mamba-2, 'G' gated delta net (with "
                        "--swiglu), '-' MLP, 'E' MoE (with --num-experts), '|' between the --pp "
                        "stages; sets --num-layers")
    p.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLPs (silu; gated delta nets need it)")
    add_recurrent_arguments(p.add_argument_group(
        "Mamba-2 (M) and gated delta net (G) sizes (Megatron-LM's flags; unset: its defaults)"))
    p.add_argument("--num-experts", type=positive_int, default=None, metavar="E",
                   help="mixture of experts: E experts per layer (all schedules; no biases in "
                        "linear layers, all-to-all dispatcher)")
    p.add_argument("--moe-router-topk", type=positive_int, default=2)
    p.add_argument("--moe-aux-loss-coeff", type=non_negative_float, default=0.01)
    p.add_argument("--attention-backend", choices=("local", "flash"), default="local",
                   help="core attention of every schedule (Megatron's and Seq1F1B's alike): "
                        "local (Megatron's DotProductAttention, computes masked scores too) or "
                        "flash (skips masked blocks; packed documents as THD)")
    p.add_argument("--document-length", type=positive_float, default=None, metavar="MEAN",
                   help="pack every micro-batch with documents of mean MEAN tokens, log-normal "
                        "(sigma 1, long-tailed; seed --seed + micro-batch index), each ended by "
                        "the end-of-document token, position ids restarting per document, no "
                        "loss on end-of-document tokens; every schedule gets them in the form "
                        "the trainer gives its backend (dense mask for Megatron on local, the "
                        "end-of-document id for Seq1F1B on local, THD on flash); adds row "
                        "seq1f1b-documents (default: unpacked)")
    p.add_argument("--bf16", action="store_true", help="GPU only")
    p.add_argument("--iters", type=positive_int, default=6, help="measured runs per schedule")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="unmeasured runs per schedule first")
    p.add_argument("--seed", type=non_negative_int, default=1234)
    p.add_argument("--out", default="out/benchmark", help="output directory")
    p.add_argument("--no-timelines", action="store_true", help="skip the recorded iterations")
    p.add_argument("--timeline-runs", type=positive_int, default=1,
                   help="recorded iterations per schedule; the median-makespan one is drawn")
    p.add_argument("--no-calibration", action="store_true",
                   help="skip per-segment cost calibration and calibrated predictions")
    p.add_argument("--calib-reps", type=positive_int, default=3,
                   help="timed repetitions per calibration case (after one warm-up); per "
                        "segment the median counts")
    p.add_argument("--calib-mode", choices=("isolated", "concurrent", "both"), default="both",
                   help="isolated: one pipeline stage at a time (no CPU contention); "
                        "concurrent: all stages at once")
    p.add_argument("--predict-pp", type=positive_int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--predict-microbatches", type=positive_int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--count-saved", action="store_true",
                   help="one extra, untimed run of every schedule counting the bytes autograd "
                        "keeps for backward per stage (activations without one layer's "
                        "temporaries)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile one extra run of every schedule on --profile-rank (a text "
                        "report and the raw .prof per schedule)")
    p.add_argument("--profile-ops", action="store_true",
                   help="torch.profiler of one extra run of every schedule on --profile-rank: "
                        "calls and self CPU time per operator, side by side (ops_rank<r>.md)")
    p.add_argument("--profile-rank", type=non_negative_int, default=0)
    p.add_argument("--loss-rtol", type=non_negative_float, default=1e-4,
                   help="first-iteration losses of all schedules must agree this closely")
    varlen.add_arguments(p)
    return p


def cp_checks(p: ArgumentParser, args: argparse.Namespace) -> None:
    """--cp > 1: only Seq1F1B's segments exchange keys and values over the CP group, so a
    named Megatron row is refused; the calibration times segments without the CP group, so
    it is off (and --splits auto, which plans from it, is refused)."""
    cp = args.context_parallel_size
    if cp <= 1:
        return
    megatron = [s for s in args.schedules or () if s.startswith("1f1b")]
    if megatron:
        p.error(f"--cp {cp}: {' '.join(megatron)} cannot run with context parallelism "
                "(Megatron's schedules give its local and flash attentions no exchange of "
                "keys and values; only Seq1F1B's segments make one): drop "
                f"{'it' if len(megatron) == 1 else 'them'}; seq1f1b-k1 is the reference row")
    if args.splits == AUTO:
        p.error(f"--cp {cp}: --splits auto plans from the calibration, which does not run "
                "with context parallelism: give a fixed --splits")
    args.no_calibration = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked together: a problem is one line on stderr and exit status 2."""
    p = build_parser()
    args = p.parse_args(argv)
    cp_checks(p, args)
    if args.variable_lengths:
        if args.attention_backend != "flash" or args.vpp or args.splits == AUTO \
                or args.micro_batch_size != 1 or args.document_length is not None:
            p.error("--variable-lengths packs THD micro-batches: it runs --attention-backend "
                    "flash, --micro-batch-size 1, a fixed --splits, without --vpp and "
                    "--document-length")
        if args.length_min > args.length_max:
            p.error(f"--length-min {args.length_min} exceeds --length-max {args.length_max}")
        ignored = [flag for flag, value in (
            ("--schedules", args.schedules), ("--sweep-splits", args.sweep_splits),
            ("--confirm-rounds", args.confirm_rounds),
            ("--memory-budget-microbatches", args.memory_budget_microbatches))
            if value is not None]
        if ignored:
            p.error(f"--variable-lengths runs its own rows (Megatron as they come and regrouped, "
                    f"Seq1F1B with --splits and each --segment-tokens): {', '.join(ignored)} "
                    "would be ignored")
        return args
    if args.schedules is None:
        args.schedules = [s for s in ALL_SCHEDULES
                          if (args.vpp or s not in INTERLEAVED) and s not in OPT_IN]
        if args.document_length is not None and args.splits != 1:
            at = args.schedules.index("seq1f1b-balanced") + 1
            args.schedules.insert(at, DOCUMENTS_KEY)
        if args.splits in (1, AUTO):  # auto: the sweep rows are the fixed-k ones
            args.schedules = [s for s in args.schedules
                              if s not in ("seq1f1b-uniform", "seq1f1b-balanced")]
        if args.context_parallel_size > 1:
            args.schedules = [s for s in args.schedules if not s.startswith("1f1b")]
    if any(s in INTERLEAVED for s in args.schedules) and not args.vpp:
        p.error("the interleaved schedules need --vpp")
    if args.hybrid_layer_pattern is not None:  # the trainer checks the rest
        if args.vpp:
            p.error("--hybrid-layer-pattern with --vpp: the benchmark builds one stage per rank")
        args.num_layers = len(args.hybrid_layer_pattern.split("/")[0].replace("|", ""))
    if args.vpp and args.num_layers % (args.pp * args.vpp):
        p.error(f"--num-layers {args.num_layers} must divide by --pp x --vpp")
    if any(s.startswith("1f1b-interleaved") for s in args.schedules) and \
            args.microbatches % args.pp:
        p.error("Megatron's interleaved schedule needs --microbatches divisible by --pp")
    if args.document_length is not None and args.attention_backend == "flash" \
            and args.micro_batch_size > 1:
        p.error("--document-length on --attention-backend flash packs THD batches: use "
                "--micro-batch-size 1 (the benchmark does not flatten b > 1 samples)")
    if args.document_length is not None and args.document_length >= args.seq_length:
        p.error(f"--document-length {args.document_length:g} must be below --seq-length "
                f"{args.seq_length} (documents would not pack)")
    if args.window_attn_skip_freq is not None and args.window_size is None:
        p.error("--window-attn-skip-freq needs --window-size")
    if args.splits != AUTO and args.splits > args.seq_length:
        p.error(f"--splits {args.splits}: --seq-length {args.seq_length} has too few tokens for "
                "that many segments")
    if args.num_layers % args.pp:
        p.error(f"--num-layers {args.num_layers} must divide by --pp {args.pp}")
    if args.hidden_size % args.num_attention_heads:
        p.error(f"--hidden-size {args.hidden_size} must divide by --num-attention-heads "
                f"{args.num_attention_heads}")
    if args.splits == AUTO and args.no_calibration:
        p.error("--splits auto plans from the calibration: drop --no-calibration")
    if args.splits != AUTO and (args.memory_budget_microbatches is not None
                                or args.min_segment_length != 128):
        p.error("--memory-budget-microbatches / --min-segment-length steer --splits auto")
    if args.confirm_rounds is not None and not (args.splits == AUTO and args.sweep_splits):
        p.error("--confirm-rounds checks --splits auto against --sweep-splits: give both")
    if args.confirm_rounds is None:
        args.confirm_rounds = 40 if args.splits == AUTO and args.sweep_splits else 0
    for k in args.sweep_splits or ():
        if k > args.seq_length:
            p.error(f"--sweep-splits {k}: every K must be in 1..{args.seq_length} (--seq-length)")
    added = [sweep_key(k) for k in sorted(set(args.sweep_splits or ()))]
    added += [AUTO_KEY] if args.splits == AUTO else []
    args.schedules = args.schedules + [key for key in added if key not in args.schedules]
    return args


def _write_outputs(out: Path, args: argparse.Namespace, meta: dict, rows: list[dict],
                   calibration: dict | None, predictions: list[dict],
                   auto: dict | None) -> None:
    """results.json, results.md and benchmark.png (rank 0), and results.md on stdout."""
    result = {"args": vars(args), "meta": meta, "schedules": rows,
              "calibration": calibration, "predictions": predictions, "auto_plan": auto}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(rows, args, meta, calibration, predictions, auto))
    try:
        bar_chart(rows, out / "benchmark.png",
                  f"p={args.pp}, m={args.microbatches}, k={args.splits}, seq "
                  f"{args.seq_length}, hidden {args.hidden_size}, {args.num_layers} layers "
                  f"({meta['device']}, {meta['world_size']} ranks)")
    except ImportError:
        print("> matplotlib missing: no benchmark.png", flush=True)
    print("", flush=True)
    print((out / "results.md").read_text(), flush=True)
    print(f"> wrote {out}/results.json, results.md, benchmark.png", flush=True)


def _give_forms(schedules: list, batches: list[dict], args: argparse.Namespace,
                eod: int) -> None:
    """Each schedule's micro-batches in the form its backend and schedule take (packing.py)."""
    packed = args.document_length is not None
    for s in schedules:
        s.form = packing.form_of(s.megatron, args.attention_backend, packed)
    forms = packing.batches_by_form(batches, {s.form for s in schedules}, eod)
    for s in schedules:
        s.batches = forms[s.form]


def _document_stats(schedules: list, batches: list[dict], args: argparse.Namespace,
                    layout, eod: int) -> list | None:
    """Per row the predicted segment cost spread and attention pairs skipped on these
    micro-batches' documents (with --document-length, or when the documents row runs);
    returns the packed micro-batches' documents (None: unpacked)."""
    if args.document_length is None and DOCUMENTS_KEY not in args.schedules:
        return None
    from megatron_seq1f1b.runtime.executor_setup import document_cut
    from megatron_seq1f1b.segments.documents import Documents

    cost, multiple = document_cut(layout.model, layout.config, args.vocab_size,
                                  attention=backend_attention(args))
    found = [data.batch_documents(b, eod) if args.document_length is not None
             else Documents.whole(args.seq_length, args.micro_batch_size) for b in batches]
    for s in schedules:
        lengths = None if s.partition == "documents" else s.lengths
        s.document_stats = row_stats(lengths, found, s.k, cost, multiple)
    return found if args.document_length is not None else None


def main(argv: list[str] | None = None, *, model_provider: Callable,
         forward_step: Callable) -> int:
    """Run the whole benchmark in this torchrun process; 0 on success, 2 on a loss mismatch."""
    args = parse_args(argv)
    if args.variable_lengths:  # its own rows and table (bench/varlen.py)
        return varlen.main(args, model_provider=model_provider, forward_step=forward_step)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plain_args = arguments.parse(trainer_argv(args, False), world)
    data.quiet_logs()
    device = setup.init_distributed(plain_args)  # parallel state without virtual pipeline
    out = Path(args.out)
    if rank0():
        out.mkdir(parents=True, exist_ok=True)
    on_gpu = device.type == "cuda"
    if not on_gpu and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        say(f"WARNING: {MMAP_THRESHOLD_HINT} is not set: freed tensors stay resident and are "
            "reused, so CPU peak memory is not valid and schedules cannot be compared. Launch as "
            f"`{MMAP_THRESHOLD_HINT} torchrun ...`.")

    layouts = build_layouts(args, plain_args, model_provider, world)
    batches = microbatches(plain_args, args)
    eod = data.make_tokenizer(plain_args).eod
    if args.document_length is not None:
        batches = packing.pack_all(batches, args, eod)  # calibration: the tokens alone
    threads = torch.get_num_threads()
    cpu_count = os.cpu_count() or 1
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    shared_cores = shared_cores_per_pipeline(args.pp, on_gpu, local_world, threads, cpu_count)
    samples, plan, plan_record = None, None, None
    if args.splits == AUTO:  # the seq1f1b-auto row needs its plan: calibrate before measuring
        samples = calibrate(args, layouts, batches[0], forward_step)
        plan, plan_record = autoplan.choose(samples, args, layouts["plain"].config,
                                            shared_cores,
                                            backend_is_dense(args))
    schedules = make_schedules(args, layouts, args.vocab_size, plan,
                               documents=packing.documents_source(plain_args, eod))
    _give_forms(schedules, batches, args, eod)
    packed_documents = _document_stats(schedules, batches, args, layouts["plain"], eod)
    meters = attach_meters(schedules)  # CP bytes of the Seq1F1B rows
    memory = PeakMemory(device)
    dp = plain_args.data_parallel_size  # without CP: a CP group shares one sequence
    tokens_per_iter = args.microbatches * args.micro_batch_size * args.seq_length * dp
    say(f"> benchmark: world {world} ({'GPU/NCCL' if on_gpu else 'CPU/gloo'}), tp {args.tp}, "
        f"pp {args.pp}, vpp {args.vpp}, cp {args.context_parallel_size}, dp {dp}; "
        f"m={args.microbatches} x {args.micro_batch_size}"
        f" x {args.seq_length} tokens, k={args.splits}; {args.num_layers} layers, hidden "
        f"{args.hidden_size}; {threads} thread(s) per rank on {cpu_count} CPU cores")
    if not on_gpu and world * threads > cpu_count:
        say(f"> note: {world} ranks x {threads} thread(s) oversubscribe {cpu_count} cores: "
            "compute is slowed when ranks overlap, which also hides part of the bubbles")
    if args.context_parallel_size > 1:
        say(f"> note: --cp {args.context_parallel_size}: Seq1F1B rows only, reference "
            f"{reference_key(schedules)}; no calibration (it times segments without the CP "
            "group), so no calibrated predictions")
    for s in schedules:
        segments = "per micro-batch" if s.partition == "documents" else s.lengths
        say(f">   {s.key:<20} {s.label}" + ("" if s.megatron else f"  segments {segments}")
            + (f"  (form {s.form})" if args.document_length is not None else ""))

    loadavg_start = os.getloadavg()[0]
    if not measure_rounds(schedules, batches, args, forward_step, memory, tokens_per_iter):
        return 2
    confirmed = None
    if plan is not None and args.confirm_rounds:  # rivals alike on every rank (max times)
        auto_row = next(s for s in schedules if s.key == AUTO_KEY)
        twin = sweep_twin(schedules, auto_row)
        rivals = closest_rivals(schedules, args.confirm_rivals, auto_row)
        race = Race(max_rounds=args.confirm_rounds, twin=twin.key if twin else None)
        say(f"> confirmation: at most {race.max_rounds} rounds of {auto_row.key} against "
            + ", ".join(s.key for s in rivals)
            + (f"; {twin.key} runs the same plan (control)" if twin else "")
            + "; a rival leaves once decided, looks after rounds "
            + ", ".join(map(str, race.looks())) + f" (bound z={race.z:.3f})")
        times = confirm_rounds(auto_row, ([twin] if twin else []) + rivals, race,
                               batches, args, forward_step, memory, tokens_per_iter)
        confirmed = confirmation(times, race)
    diagnostic_runs(schedules, batches, args, forward_step, memory, out)
    if not args.no_timelines:
        measured = record_timelines(schedules, batches, args, forward_step, memory)
        if rank0():
            draw_measured_timelines(schedules, measured, args, out)

    calibration, predictions = None, []
    if not args.no_calibration:
        if samples is None:  # --splits auto calibrated before measuring
            samples = calibrate(args, layouts, batches[0], forward_step)
        calibration, predictions, simulated = calibrated_predictions(
            schedules, layouts, samples, args, shared_cores)
        if rank0() and not args.no_timelines:
            draw_simulated_timelines(schedules, simulated, args,
                                     calibration["prediction_variant"], out)

    rows = summarize(schedules, tokens_per_iter, args.attention_backend)
    cp_report.add_fields(rows, schedules, measured_bytes(meters), args, layouts["plain"].config,
                         packed_documents)
    # printed with results.md (section "Automatic plan vs a sweep of k")
    auto = auto_vs_sweep(rows, plan_record, confirmed=confirmed) if plan_record else None
    meta = {
        "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg()[0],
        "world_size": world, "dp": dp, "context_parallel_size": args.context_parallel_size,
        "reference": reference_key(schedules), "device": "GPU/NCCL" if on_gpu else "CPU/gloo",
        "cpu_count": cpu_count, "threads_per_rank": threads,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "memory_valid": on_gpu or "MALLOC_MMAP_THRESHOLD_" in os.environ,
        "attention_backend": args.attention_backend, "document_length": args.document_length,
        "tokens_per_iteration": tokens_per_iter, "torch": torch.__version__,
        "megatron_core": megatron_core_version(), "command": " ".join(sys.argv),
    }
    if rank0():
        _write_outputs(out, args, meta, rows, calibration, predictions, auto)
    dist.barrier()
    dist.destroy_process_group()
    return 0
