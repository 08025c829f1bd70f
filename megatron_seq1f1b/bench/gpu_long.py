"""Long sequences on one GPU: pipeline stages of a 1.3B and a 7B-shaped GPT at 32k-64k tokens.

Flash attention (:mod:`megatron_seq1f1b.attention.flash`, PyTorch SDPA), bf16,
pipeline size 1, one model per configuration shared by its rows. For each
configuration: Megatron-Core's schedule against Seq1F1B k = 1, 2, 4, 8 with
balanced and uniform segments (tokens/s, CUDA peak memory); per-unit forward,
input-gradient and weight-gradient times of uniform 1-, 2-, 4- and 8-way
splits (device time with the host's dispatch apart,
:class:`megatron_seq1f1b.planner.timing.UnitTimer`), fitted and saved as a planner
calibration (``calibration_<config>_<seq>.json``, for
``python -m megatron_seq1f1b.planner --calibration``); then the longest
sequence that trains for the 1.3B stage with Megatron's schedule and with
Seq1F1B k=8. ``scripts/gpu_long.sh`` installs the wheels offline and runs::

    python -m megatron_seq1f1b.bench.gpu_long --out out/gpu_long

Configurations (one stage of each, as a pipeline would hold it):

* ``1.3b``: GPT 1.3B (hidden 2048, 16 heads, ffn 8192, GeLU, LayerNorm, 24 layers over 4
  stages: 6 layers);
* ``7b``: a LLaMA-7B-shaped stage (hidden 4096, 32 heads, ffn 11008, SwiGLU, RMSNorm),
  ``--layers-7b`` layers (default 2).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from megatron_seq1f1b.base.flags import ArgumentParser, non_negative_int, positive_float, positive_int
from megatron_seq1f1b.bench import gpu
from megatron_seq1f1b.bench.gpu import Row, Shape, Size

CONFIGS = {
    "1.3b": (Shape(num_layers=6, ffn_hidden_size=8192, swiglu=False, normalization="LayerNorm"),
             2048, 16),
    "7b": (Shape(num_layers=2, ffn_hidden_size=11008, swiglu=True, normalization="RMSNorm"),
           4096, 32),
}
DEFAULT_RUNS = ("1.3b:32768", "7b:32768", "7b:65536")
CASE_SPLITS = (1, 2, 4, 8)
RESULTS, TABLE = gpu.RESULTS, gpu.TABLE


def parse_run(text: str) -> tuple[str, int]:
    name, _, seq = text.partition(":")
    if name not in CONFIGS or not seq.isdigit() or int(seq) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give CONFIG:SEQ with CONFIG one of "
                                         f"{', '.join(CONFIGS)}, e.g. 1.3b:32768")
    return name, int(seq)


def shape_of(name: str, layers_7b: int) -> tuple[Shape, int, int]:
    shape, hidden, heads = CONFIGS[name]
    if name == "7b":
        shape = Shape(layers_7b, shape.ffn_hidden_size, shape.swiglu, shape.normalization)
    return shape, hidden, heads


def unit_times(model: list, size: Size, opts: argparse.Namespace, batches: list[dict]):
    """(rows [length, end, F, B, W, B with W deferred] in seconds of device time, host rows
    [F, B], the fitted planner calibration) of uniform 1-, 2-, 4-, 8-way splits."""
    from megatron.core.utils import get_model_config

    from megatron_seq1f1b.planner import Calibration
    from megatron_seq1f1b.planner.measure import host_floor, time_cases
    from megatron_seq1f1b.runtime import wgrad
    from megatron_seq1f1b.runtime.model_hooks import unwrap
    from megatron_seq1f1b.schedules.partition import split_sequence

    config = get_model_config(model[0])
    multiple = 64 if size.seq % 64 == 0 else 1
    cases = [split_sequence(size.seq, k, "uniform", multiple_of=multiple)
             for k in CASE_SPLITS if size.seq // multiple >= k]
    split_weights = not wgrad.deferral_problems(model)
    if split_weights:
        wgrad.install()
    host: list = []
    gpt = unwrap(model[0])
    rows, held = time_cases(model[0], 0, cases, gpu._repeat(batches[0]), gpu.forward_step, config,
                            1, gpt.pre_process, gpt.post_process, opts.unit_reps, split_weights,
                            host)
    model[0].zero_grad_buffer()
    floors = {(0, 0): host_floor(host)} if torch.cuda.is_available() else None
    calibration = Calibration.from_samples(
        {(0, 0): rows}, source=f"one GPU, {size}, uniform cases {CASE_SPLITS}, W timed apart",
        bytes_per_token=(held / size.seq) if held else None, floors=floors)
    return rows, host, calibration


def bench_run(opts: argparse.Namespace, name: str, seq: int, out_dir: Path, say,
              deadline: float = float("inf"), saved=lambda run: None) -> dict:
    """Every row of one configuration and length, its unit times and its calibration. A
    failing row (e.g. out of memory) keeps its reason and the others run; rows not started
    by ``deadline`` are kept as not run; ``saved`` gets the run so far after each step."""
    import megatron_seq1f1b as s1
    from megatron.core.pipeline_parallel import schedules

    from megatron_seq1f1b.planner import save_calibration
    from megatron_seq1f1b.runtime import wgrad
    from megatron_seq1f1b.runtime.executor import clear_setups, resolve_lengths

    shape, hidden, heads = shape_of(name, opts.layers_7b)
    size = Size(hidden, seq, heads)
    label = f"{name} stage, seq {seq}"
    rows: list[Row] = []
    run = {"config": name, "seq_length": seq, "rows": [], "unit_times": [],
           "calibration": None, "note": ""}

    def attempt(row_name: str, k: int | None, measure) -> None:
        row = gpu.row_or_note(label, row_name, k, measure, deadline)
        row.size = label
        rows.append(row)
        gpu.set_ratios(rows)
        run["rows"] = [asdict(r) for r in rows]
        say(gpu._line(row))
        saved(run)

    try:
        model, config = gpu.build(opts, size, shape)
    except Exception as exc:  # noqa: BLE001 - e.g. the stage's weights do not fit
        run["note"] = "model not built: " + gpu.failure_note(exc)
    if run["note"]:
        gpu.release_memory()  # here, once the traceback's frames (and tensors) are gone
        saved(run)
        return run
    batches = gpu.host_batches(opts, size)
    m = len(batches)
    attempt("Megatron-Core", None, lambda: gpu.measure_row(
        "Megatron-Core", schedules.forward_backward_no_pipelining, model, batches, size, opts,
        m, None, [seq], detail=False))
    for partition in opts.partitions:
        for k in opts.splits:
            if k == 1 and partition != opts.partitions[0]:
                continue
            row_name = f"Seq1F1B k={k}" + (f" {partition}" if k > 1 else "")

            def seq1f1b(k=k, partition=partition, row_name=row_name) -> Row:
                fb = s1.get_forward_backward_func(k, partition)
                lengths = resolve_lengths(k, partition, None, seq, model, config,
                                          opts.vocab_size)
                return gpu.measure_row(row_name, fb, model, batches, size, opts, m * k, k,
                                       lengths, detail=False)

            attempt(row_name, k, seq1f1b)
    if time.monotonic() > deadline:
        run["note"] = "unit times not taken: time budget spent"
    else:
        try:
            units, host, calibration = unit_times(model, size, opts, batches)
            path = out_dir / f"calibration_{name}_{seq}.json"
            save_calibration(calibration, path)
            say(f"[gpu_long] {label}: calibration saved to {path}")
            run["calibration"] = path.name
            run["unit_times"] = [
                {"length": r[0], "end": r[1], "forward_ms": r[2] * 1e3,
                 "backward_ms": r[3] * 1e3,
                 "weight_ms": r[4] * 1e3 if len(r) > 4 else None,
                 "input_grad_ms": r[5] * 1e3 if len(r) > 5 else None,
                 "host_forward_ms": h[0] * 1e3, "host_backward_ms": h[1] * 1e3}
                for r, h in zip(units, host)]
        except Exception as exc:  # noqa: BLE001 - the rows stand without them
            run["note"] = "unit times not taken: " + gpu.failure_note(exc)
        finally:
            wgrad.uninstall()  # the next configuration's rows run Megatron's own layers
    del model
    clear_setups()
    gpu.release_memory()
    saved(run)
    return run


def longest(opts: argparse.Namespace, say, deadline: float,
            saved=lambda rows: None) -> list[dict]:
    """For the 1.3B stage: Megatron's schedule and Seq1F1B k=8 at each length of
    ``--longest`` (one micro-batch; one warm-up iteration, then one timed) until one does
    not fit; ``saved`` gets the rows so far after each length."""
    import megatron_seq1f1b as s1
    from megatron.core.pipeline_parallel import schedules

    from megatron_seq1f1b.planner.peak_memory import PeakMemory
    from megatron_seq1f1b.runtime.executor import clear_setups

    shape, hidden, heads = shape_of("1.3b", opts.layers_7b)
    results = []
    single = argparse.Namespace(**{**vars(opts), "microbatches": 1})
    for name, make in (("Megatron-Core", lambda: schedules.forward_backward_no_pipelining),
                       ("Seq1F1B k=8", lambda: s1.get_forward_backward_func(8, "balanced"))):
        for seq in opts.longest:
            if time.monotonic() > deadline:
                results.append({"schedule": name, "seq_length": seq, "fits": None,
                                "note": "not run: time budget spent"})
                saved(results)
                break
            size = Size(hidden, seq, heads)
            model = fits = None
            try:
                model, _ = gpu.build(single, size, shape)
                batches = gpu.host_batches(single, size)
                memory = PeakMemory()
                memory.reset()
                gpu._iteration(make(), model, batches, size)  # warm-up: kernels chosen
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                start = time.perf_counter()
                gpu._iteration(make(), model, batches, size)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                peak = memory.peak_above_baseline() / 2**30
                results.append({"schedule": name, "seq_length": seq, "fits": True,
                                "peak_gib": peak, "seconds_per_iter": seconds})
                say(f"[gpu_long] longest, {name}: {seq} tokens train, peak {peak:.1f} GiB")
                fits = True
            except Exception as exc:  # noqa: BLE001 - out of memory ends this schedule's probe
                fits = False
                oom = gpu.out_of_memory(exc)
                note = "out of memory" if oom else gpu.failure_note(exc)
                results.append({"schedule": name, "seq_length": seq,
                                "fits": False if oom else None, "note": note})
                say(f"[gpu_long] longest, {name}: {seq} tokens: {note}")
            finally:
                del model
                clear_setups()
                gpu.release_memory()
                saved(results)
            if not fits:
                break
    return results


def targets(runs: list[dict], longest_rows: list[dict]) -> dict[str, str]:
    verdicts = {}
    for run in runs:
        if run["config"] == "1.3b" and run["seq_length"] == 32768:
            by = {r["name"]: r for r in run["rows"]}
            k1, k4 = by.get("Seq1F1B k=1"), by.get("Seq1F1B k=4 balanced")
            if k1 and k4 and not (k1["tokens_per_s"] and k4["tokens_per_s"]):
                verdicts["1.3b stage, 32768 tokens: k=4 at most 5% longer than k=1"] = (
                    f"MISSED: k=1 {k1['note'] or 'ran'}, k=4 {k4['note'] or 'ran'}")
            elif k1 and k4:
                slower = k4["ms_per_iter"] / k1["ms_per_iter"] - 1
                verdicts["1.3b stage, 32768 tokens: k=4 at most 5% longer than k=1"] = (
                    f"{slower:+.1%} {'ok' if slower <= 0.05 else 'MISSED'}")
    for name in ("Megatron-Core", "Seq1F1B k=8"):
        fits = [r["seq_length"] for r in longest_rows if r["schedule"] == name and r["fits"]]
        if any(r["schedule"] == name for r in longest_rows):
            verdicts[f"1.3b stage, longest that trains, {name}"] = (
                f"{max(fits)} tokens" if fits else "none of those tried")
    return verdicts


def markdown(runs: list[dict], longest_rows: list[dict], environment: dict, command: str) -> str:
    lines = [
        f"GPU: {environment.get('device')}; torch {environment.get('torch')} (CUDA "
        f"{environment.get('cuda')}), megatron-core {environment.get('megatron_core')}, bf16, "
        "flash attention (PyTorch SDPA), pipeline size 1.",
        "", f"Command: `{command}`", "",
        "| stage | schedule | tokens/s | vs Megatron | peak GiB | vs Megatron | lengths | note |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for run in runs:
        if run.get("note") and not run["rows"]:
            lines.append(f"| {run['config']} stage, seq {run['seq_length']} | - | - | - | - | - "
                         f"| - | {gpu.cell(run['note'])} |")
        for r in run["rows"]:
            lengths = ",".join(map(str, r["lengths"][:4])) + (",.." if len(r["lengths"]) > 4
                                                              else "")
            lines.append(f"| {r['size']} | {r['name']} | {r['tokens_per_s']:,.0f} | "
                         f"{gpu._ratio(r['ratio'])} | {gpu._fmt(r['peak_gib'], '.1f')} | "
                         f"{gpu._ratio(r['peak_ratio'])} | {lengths} | {gpu.cell(r['note'])} |")
    lines += ["", "Per unit (uniform segments; device time, the host's dispatch apart):", "",
              "| stage | segment | forward ms | input-grad ms | weight-grad ms | whole backward ms "
              "| host fwd/bwd ms |", "|---|---|---:|---:|---:|---:|---:|"]
    for run in runs:
        if run.get("note") and run["rows"]:
            lines.append(f"| {run['config']} {run['seq_length']} | {gpu.cell(run['note'])} "
                         "| | | | | |")
        for u in run["unit_times"]:
            lines.append(
                f"| {run['config']} {run['seq_length']} | {u['length']} ending {u['end']} | "
                f"{u['forward_ms']:.1f} | {gpu._fmt(u['input_grad_ms'], '.1f')} | "
                f"{gpu._fmt(u['weight_ms'], '.1f')} | {u['backward_ms']:.1f} | "
                f"{u['host_forward_ms']:.1f}/{u['host_backward_ms']:.1f} |")
    if longest_rows:
        lines += ["", "Longest sequence that trains, 1.3B stage (one micro-batch):", "",
                  "| schedule | tokens | trains | peak GiB | s/iter | note |",
                  "|---|---:|---|---:|---:|---|"]
        for r in longest_rows:
            lines.append(f"| {r['schedule']} | {r['seq_length']} | "
                         f"{ {True: 'yes', False: 'no', None: '-'}[r['fits']]} | "
                         f"{gpu._fmt(r.get('peak_gib'), '.1f')} | "
                         f"{gpu._fmt(r.get('seconds_per_iter'), '.2f')} | "
                         f"{gpu.cell(r.get('note', ''))} |")
    return "\n".join(lines) + "\n"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_seq1f1b.bench.gpu_long",
                       description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", nargs="+", type=parse_run,
                   default=[parse_run(r) for r in DEFAULT_RUNS],
                   help="CONFIG:SEQ (default: " + " ".join(DEFAULT_RUNS) + ")")
    p.add_argument("--layers-7b", type=positive_int, default=2)
    p.add_argument("--splits", nargs="+", type=positive_int, default=[1, 2, 4, 8])
    p.add_argument("--partitions", nargs="+", choices=["balanced", "uniform"],
                   default=["balanced", "uniform"])
    p.add_argument("--microbatches", type=positive_int, default=2)
    p.add_argument("--vocab-size", type=positive_int, default=50257)
    p.add_argument("--iters", type=positive_int, default=3)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--unit-reps", type=positive_int, default=1,
                   help="timed repetitions per unit case")
    p.add_argument("--longest", nargs="*", type=positive_int, default=[65536, 131072, 262144],
                   help="lengths to try for the 1.3B stage, in order (none: skip)")
    p.add_argument("--time-budget-s", type=positive_float, default=390.0)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--attention-backend", choices=["flash", "local"], default="flash")
    p.add_argument("--_device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--_shrink", type=positive_int, default=1,
                   help=argparse.SUPPRESS)  # tests: /hidden
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_seq1f1b.bench import gpu_check

    parser = build_parser()
    opts = parser.parse_args(argv)
    shortest = min(seq for _, seq in opts.runs)
    for k in opts.splits:
        if k > shortest:
            parser.error(f"--splits {k}: the shortest sequence of --runs has {shortest} tokens, "
                         "too few for that many segments")
    if opts._shrink > 1:  # the tests' CPU path: the same code on tiny models
        for name, (shape, hidden, heads) in list(CONFIGS.items()):
            CONFIGS[name] = (Shape(2, (shape.ffn_hidden_size or 0) // opts._shrink or None,
                                   shape.swiglu, shape.normalization),
                             hidden // opts._shrink, max(heads // opts._shrink, 1))
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if opts._device == "cuda" and gpu_check.cuda_problem():
        print(f"gpu_long: cannot start: {gpu_check.cuda_problem()}", file=sys.stderr)
        return 2
    say = partial(print, flush=True)
    start = time.monotonic()
    deadline = start + opts.time_budget_s
    command = "python -m megatron_seq1f1b.bench.gpu_long " + " ".join(argv or sys.argv[1:])
    env = gpu_check.environment(torch.device("cuda", 0) if opts._device == "cuda"
                                else torch.device("cpu"))
    if opts.attention_backend == "flash":
        gpu.flash_kernels_only()
    env["sdpa_cudnn"] = torch.backends.cuda.cudnn_sdp_enabled()
    settings = {k: v for k, v in vars(opts).items() if k != "out"}
    runs: list[dict] = []
    longest_rows: list[dict] = []
    skipped: list[str] = []

    def report(final: bool = False) -> None:
        verdicts = targets(runs, longest_rows)
        data = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "command": command, "environment": env, "settings": settings,
                "complete": final, "seconds": round(time.monotonic() - start, 1),
                "skipped": skipped, "targets": verdicts, "runs": runs, "longest": longest_rows}
        gpu.write_report(out_dir, data, markdown(runs, longest_rows, env, command), verdicts,
                         say if final else None)

    first, hidden, heads = shape_of(opts.runs[0][0], opts.layers_7b)
    gpu_check.init_single_rank(argparse.Namespace(
        num_layers=first.num_layers, hidden_size=hidden, num_attention_heads=heads,
        seq_length=opts.runs[0][1], microbatches=opts.microbatches, vocab_size=opts.vocab_size,
        seed=1234, splits=1, partition="balanced"))
    finished = False
    try:
        for name, seq in opts.runs:
            if time.monotonic() > deadline:
                skipped.append(f"{name}:{seq}")
                continue
            say(f"[gpu_long] {name} stage at {seq} tokens")

            def saved(run: dict, index: int = len(runs)) -> None:
                runs[index:] = [run]
                report()

            bench_run(opts, name, seq, out_dir, say, deadline, saved)
        if opts.longest:

            def saved_longest(rows: list[dict]) -> None:
                longest_rows[:] = rows
                report()

            longest_rows[:] = longest(opts, say, deadline, saved_longest)
        finished = True
    finally:
        gpu.shutdown(say, "gpu_long")
        report(final=finished)
    if skipped:
        say(f"[gpu_long] time budget spent: left out {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
