"""The one-GPU check of issue 27: a rehearsed stage's peak memory against the planner's.

Configuration (a) of :mod:`megatron_seq1f1b.bench.predictions` (GPT 1.3B, PP=4,
32768 tokens, 4 micro-batches, bf16, flash attention, Adam with the distributed
optimizer), stage 0 rehearsed alone with Seq1F1B k=1 (Megatron's 1F1B) and k=4
balanced (``python -m megatron_seq1f1b.rehearse``, one process each, so every
CUDA peak starts clean): its CUDA peak (weights, main gradients, Adam states and
activations; the states exist from the warm-up iteration's step) must be within 10 %
of the planner's predicted total for that stage. One GPU holds one rank, so the
distributed optimizer shards over a data-parallel size of 1 here, and the
planner predicts that layout (``--data-parallel-size 1``); the planner's command
line is run too and its stage-0 total recorded.

With ``--calibrate`` (and time left in ``--budget-s``) it then rehearses the first,
a middle and the last stage of both configurations with ``--save-calibration`` and
runs :mod:`megatron_seq1f1b.bench.predictions` on them, the activations scaled by
what the k=1 row measured over what was predicted. Writes ``OUT/gpu_rehearse.json``
(checks with status and numbers), the rehearsals' JSON, and with ``--calibrate``
``OUT/calibrations/`` and ``OUT/predictions.{json,md}``. Exit status 0 when no check
failed, 1 when one did, 2 when it could not start.

``--tiny`` shrinks everything to a CPU-sized model (tests); ``--in-process`` runs the
rehearsals in this process (CPU tests; on a GPU separate processes keep peaks apart).
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from megatron_seq1f1b.base.flags import ArgumentParser, positive_float
from megatron_seq1f1b.bench.predictions import CONFIGS

TOLERANCE = 0.10
GIB = 2.0 ** 30

# configuration (a) as the rehearsal CLI's flags
MODEL_A = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
           "--ffn-hidden-size", "8192", "--vocab-size", "50257", "--seq-length", "32768",
           "--untie-embeddings-and-output-weights"]
TINY_A = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
          "--ffn-hidden-size", "256", "--vocab-size", "128", "--seq-length", "256",
          "--untie-embeddings-and-output-weights"]


@dataclass
class Check:
    name: str
    status: str  # pass, fail, skip
    summary: str
    numbers: dict = field(default_factory=dict)


def _flag(argv: Sequence[str], name: str) -> str:
    return argv[list(argv).index(name) + 1]


def model_flags(config: str, tiny: bool) -> list[str]:
    """The rehearsal CLI's model flags of a configuration (a CPU-sized one with ``tiny``)."""
    if tiny:
        return list(TINY_A)
    shape = CONFIGS[config].shape
    flags = ["--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
             "--num-attention-heads", str(shape.num_attention_heads), "--ffn-hidden-size",
             str(shape.ffn), "--vocab-size", str(shape.vocab_size), "--seq-length",
             str(max(CONFIGS[config].seq_lengths))]
    return flags + ([] if shape.tied_embeddings else ["--untie-embeddings-and-output-weights"])


def check_rows(tiny: bool) -> list[tuple[str, list[str]]]:
    """(name, rehearsal CLI arguments) of the two rehearsals the check compares."""
    common = MODEL_A if not tiny else TINY_A
    common = common + ["--pipeline-model-parallel-size", "4", "--rehearse-stage", "0",
                       "--num-microbatches", "4", "--seq1f1b-partition", "balanced",
                       "--optimizer", "adam", "--use-distributed-optimizer",
                       "--warmup", "1", "--iters", "2"]
    if not tiny:
        common += ["--bf16", "--attention-backend", "flash"]
    return [(f"stage 0 of (a), k={k}", common + ["--seq1f1b-splits", str(k)]) for k in (1, 4)]


def planner_args(tiny: bool, out: Path) -> list[str]:
    """The planner's command line for the check's layout (one rank: DP=1)."""
    flags = MODEL_A if not tiny else TINY_A
    pick = {n: _flag(flags, n) for n in ("--num-layers", "--hidden-size", "--num-attention-heads",
                                         "--ffn-hidden-size", "--vocab-size", "--seq-length")}
    args = [x for name, value in pick.items() for x in (name, value)]
    args += ["--pp", "4", "--microbatches", "4", "--untie-embeddings-and-output-weights",
             "--use-distributed-optimizer", "--data-parallel-size", "1", "--splits", "1", "4",
             "--partitions", "balanced", "--schedules", "1f1b", "--json", str(out)]
    return args + (["--multiple-of", "64", "--bf16"] if not tiny else
                   ["--min-segment-length", "32"])


def calibration_runs(tiny: bool, out: Path) -> list[tuple[str, int, list[str], Path]]:
    """(config, stage, rehearsal CLI arguments, calibration file) for the predictions."""
    runs = []
    for name, published in CONFIGS.items():
        p = published.num_stages
        for stage in (0, 1, p - 1):
            path = out / "calibrations" / f"{name}-stage{stage}.json"
            args = model_flags(name, tiny) + [
                "--pipeline-model-parallel-size", str(p), "--rehearse-stage", str(stage),
                "--num-microbatches", "1", "--optimizer", "none", "--warmup", "0", "--iters",
                "1", "--save-calibration", str(path)]
            if tiny:
                args += ["--min-segment-length", "32", "--calibration-reps", "1"]
            else:  # two repetitions (median) keep all six within the budget (~45 s each)
                args += ["--bf16", "--attention-backend", "flash", "--calibration-reps", "2"]
            runs.append((name, stage, args, path))
    return runs


def judge(name: str, result: dict, tolerance: float = TOLERANCE) -> Check:
    """A rehearsal's measured peak against the planner's predicted total for its stage."""
    rehearsal, predicted = result["rehearsal"], result["predicted"]
    measured = rehearsal.get("peak_total_bytes")
    numbers = {"predicted_total_gib": predicted["total"] / GIB,
               "predicted_activations_gib": predicted["activations"] / GIB,
               "predicted_static_gib": (predicted["total"] - predicted["activations"]) / GIB,
               "peak_above_start_gib": rehearsal["peak_bytes"] / GIB,
               "lengths": rehearsal["lengths"], "compute_s": rehearsal["compute_s"],
               "iteration_s": rehearsal["iteration_s"],
               "same_actions": predicted.get("same_actions")}
    if measured is None:
        return Check(name, "skip", "no CUDA: the allocator's peak is what this check compares "
                     "(CPU resident sets cannot tell)", numbers)
    numbers["measured_total_gib"] = measured / GIB
    numbers["reserved_gib"] = (rehearsal.get("peak_reserved_bytes") or 0) / GIB
    error = measured / predicted["total"] - 1
    numbers["relative_error"] = error
    status = "pass" if abs(error) <= tolerance else "fail"
    return Check(name, status, f"measured {measured / GIB:.2f} GiB, predicted "
                 f"{predicted['total'] / GIB:.2f} GiB ({error:+.1%}; within "
                 f"{tolerance:.0%}: {status})", numbers)


def activation_scale(results: Sequence[dict]) -> float | None:
    """Measured over predicted activations (the peak above an iteration's start, whose
    baseline holds weights, gradients and Adam states) of the CUDA rows; None without."""
    ratios = [r["rehearsal"]["peak_bytes"] / r["predicted"]["activations"]
              for r in results if r["rehearsal"].get("peak_total_bytes")
              and r["predicted"]["activations"]]
    return sum(ratios) / len(ratios) if ratios else None


class Runner:
    """Runs ``python -m MODULE ARGS``: a subprocess (default) or in this process. A
    subprocess still running at ``deadline`` (``time.monotonic()``) is killed and reported
    with status 124, so a stuck child (NCCL start or exit) cannot hold the machine."""

    def __init__(self, in_process: bool = False, python: str = sys.executable,
                 log: Callable[[str], None] = print, deadline: float = float("inf")):
        self.in_process, self.python, self.log = in_process, python, log
        self.deadline = deadline

    def __call__(self, module: str, args: list[str]) -> int:
        self.log(f"[rehearsal_check] python -m {module} {' '.join(args)}")
        if not self.in_process:
            left = self.deadline - time.monotonic()
            try:
                return subprocess.run([self.python, "-m", module, *args],
                                      timeout=max(left, 1.0) if left != float("inf")
                                      else None).returncode
            except subprocess.TimeoutExpired:
                self.log("[rehearsal_check] killed: still running at the time limit")
                return 124
        import importlib

        main = importlib.import_module(module).main
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = main(args)
        self.log(buffer.getvalue().rstrip())
        return code


def run_check(out: Path, *, tiny: bool = False, calibrate: bool = False, budget_s: float = 300,
              runner: Runner | None = None, python: str = sys.executable) -> list[Check]:
    """Everything above; the checks (also written to ``out/gpu_rehearse.json``)."""
    runner = runner or Runner(python=python)
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    checks, results = [], []

    def write_summary() -> None:  # after every step: a run cut short keeps its checks
        summary = {"checks": [vars(c) for c in checks], "elapsed_s": time.monotonic() - start,
                   "activation_scale": activation_scale(results), "tolerance": TOLERANCE}
        (out / "gpu_rehearse.json").write_text(json.dumps(summary, indent=1) + "\n")

    for index, (name, args) in enumerate(check_rows(tiny)):
        path = out / f"rehearse_k{_flag(args, '--seq1f1b-splits')}.json"
        code = runner("megatron_seq1f1b.planner.rehearse", args + ["--json", str(path)])
        if code != 0 or not path.exists():
            checks.append(Check(name, "fail", f"the rehearsal exited with status {code}"))
            continue
        result = json.loads(path.read_text())
        results.append(result)
        checks.append(judge(name, result))
        write_summary()
    plan_path = out / "plan.json"
    code = runner("megatron_seq1f1b.planner", planner_args(tiny, plan_path))
    if code == 0 and plan_path.exists():
        plan = json.loads(plan_path.read_text())
        totals = {c["num_splits"]: c["stages"][0]["total"] / GIB for c in plan["candidates"]}
        checks.append(Check("planner command line", "pass", "stage 0 totals per k: " + ", ".join(
            f"k={k}: {v:.2f} GiB" for k, v in sorted(totals.items())), {"stage0_total_gib": totals}))
    else:
        checks.append(Check("planner command line", "fail", f"exited with status {code}"))
    write_summary()
    if calibrate:
        _calibrate_and_predict(out, tiny, runner, start, budget_s, activation_scale(results),
                               checks, write_summary)
    write_summary()
    for c in checks:
        runner.log(f"[rehearsal_check] {c.status:>4}  {c.name}: {c.summary}")
    return checks


def _calibrate_and_predict(out: Path, tiny: bool, runner: Runner, start: float,
                           budget_s: float, scale: float | None, checks: list[Check],
                           saved: Callable[[], None]) -> None:
    """Appends to ``checks``, calling ``saved`` after each step."""
    files = {}
    for name, stage, args, path in calibration_runs(tiny, out):
        label = f"calibration {name} stage {stage}"
        if time.monotonic() - start > budget_s:
            checks.append(Check(label, "skip", f"past the time budget of {budget_s:.0f} s"))
            continue
        json_path = path.with_suffix(".rehearsal.json")
        code = runner("megatron_seq1f1b.planner.rehearse", args + ["--json", str(json_path)])
        ok = code == 0 and path.exists()
        checks.append(Check(label, "pass" if ok else "fail",
                            str(path) if ok else f"exited with status {code}"))
        saved()
        if ok:
            files.setdefault(name, []).append(str(path))
    complete = {name: paths for name, paths in files.items() if len(paths) == 3}
    if not complete:
        checks.append(Check("predictions", "skip", "no configuration has all three stages "
                            "calibrated"))
        return
    args = [x for name, paths in complete.items()
            for x in ("--calibration", f"{name}={','.join(paths)}")]
    args += ["--out", str(out / "predictions.json"), "--markdown", str(out / "predictions.md")]
    if scale:
        args += ["--activation-scale", f"{scale:.4f}"]
    code = runner("megatron_seq1f1b.bench.predictions", args)
    checks.append(Check("predictions", "pass" if code == 0 else "fail",
                        f"{out / 'predictions.json'} for {', '.join(complete)}"
                        if code == 0 else f"exited with status {code}"))


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_seq1f1b.bench.rehearsal_check",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--calibrate", action="store_true",
                   help="also calibrate first/middle/last stages of both configurations and "
                        "predict them")
    p.add_argument("--budget-s", type=positive_float, default=300,
                   help="no calibration starts after this many seconds")
    p.add_argument("--limit-s", type=positive_float, default=420,
                   help="a rehearsal, calibration or planner run still going this many "
                        "seconds after the start is killed (keeps the script inside 8 minutes "
                        "with the install)")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model (tests)")
    p.add_argument("--in-process", action="store_true",
                   help="run the rehearsals in this process (CPU tests)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.tiny:
        print("rehearsal_check: no CUDA device (use --tiny for a CPU-sized dry run)",
              file=sys.stderr)
        return 2
    runner = Runner(in_process=args.in_process, deadline=time.monotonic() + args.limit_s)
    checks = run_check(Path(args.out), tiny=args.tiny, calibrate=args.calibrate,
                       budget_s=args.budget_s, runner=runner)
    return 1 if any(c.status == "fail" for c in checks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
