"""The GPU check's results and verdicts: what a check found, how two runs are compared
(fp32 exactly, bf16 and TF32 by loss and gradient cosine), and the JSON summary.

Pure functions of tensors and numbers (no GPU needed): the CPU tests drive them with
injected errors to prove each limit catches what it is meant to
(:mod:`megatron_seq1f1b.bench.gpu_check` runs the checks).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import torch

FP32_RTOL = 1e-5
BF16_LOSS_RTOL = 1e-2
BF16_MIN_COSINE = 0.999
# Transformer Engine runs fp32 GEMMs in TF32 (10-bit mantissa; no switch), so two GEMM
# shapes differ by ~1e-3: its "fp32" is judged like bf16, with tighter limits.
TF32_LOSS_RTOL = 1e-3
TF32_MIN_COSINE = 0.9999
MAX_MEMORY_RATIO = 1.5
SUMMARY_FILE = "gpu_check.json"


# ---------------------------------------------------------------- results


@dataclasses.dataclass
class Check:
    """One row of the summary: what was checked, the verdict, and the numbers behind it."""

    name: str
    status: str  # "pass" | "fail" | "skip"
    summary: str  # one line: the deciding numbers, or why it failed / was skipped
    numbers: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


class Verdict(NamedTuple):
    status: str
    summary: str
    numbers: dict


def format_table(checks: Iterable[Check]) -> str:
    """A short fixed-width table, one line per check."""
    rows = [("check", "status", "seconds", "details")]
    rows += [(c.name, c.status.upper(), f"{c.seconds:.1f}", c.summary) for c in checks]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def counts(checks: Iterable[Check]) -> dict[str, int]:
    result = {"pass": 0, "fail": 0, "skip": 0}
    for check in checks:
        result[check.status] += 1
    return result


def write_summary(out_dir: Path, environment: dict, settings: dict, checks: list[Check],
                  seconds: float) -> Path:
    """gpu_check.json: environment, settings, every check; ``passed`` iff none failed."""
    tally = counts(checks)
    report = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "passed": tally["fail"] == 0,
        "counts": tally,
        "seconds": round(seconds, 1),
        "environment": environment,
        "settings": settings,
        "checks": [dataclasses.asdict(c) for c in checks],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SUMMARY_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
    tmp.replace(path)
    return path


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# ---------------------------------------------------------------- comparisons


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, per tensor, as the test suite compares.

    Relative to the tensor's largest entry, so entries near zero do not turn
    rounding into huge element-wise ratios.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0
    expected = expected.detach().double()
    scale = expected.abs().max().item()
    error = (actual.detach().double() - expected).abs().max().item()
    return error / max(scale, 1e-30)


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two tensors as flat vectors; two zero tensors agree (1.0)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    norm_a, norm_b = a.norm().item(), b.norm().item()
    if norm_a == 0.0 and norm_b == 0.0:
        return 1.0
    if norm_a == 0.0 or norm_b == 0.0:
        return 0.0
    return (a @ b).item() / (norm_a * norm_b)


def overall_cosine(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> float:
    """Cosine of all gradients concatenated into one vector (names as in `expected`)."""
    dot = norm_e = norm_a = 0.0
    for name, e in expected.items():
        e, a = e.detach().double().flatten(), actual[name].detach().double().flatten()
        dot += (e @ a).item()
        norm_e += (e @ e).item()
        norm_a += (a @ a).item()
    if norm_e == 0.0 and norm_a == 0.0:
        return 1.0
    if norm_e == 0.0 or norm_a == 0.0:
        return 0.0
    return dot / math.sqrt(norm_e * norm_a)


def _relative(actual: float, expected: float) -> float:
    if not (math.isfinite(actual) and math.isfinite(expected)):
        return math.inf
    return abs(actual - expected) / max(abs(expected), 1e-30)


def _gradient_problems(expected: dict, actual: dict) -> list[str]:
    """Parameters that lack a gradient on one side (both runs must produce the same set)."""
    problems = [f"{n}: no Seq1F1B gradient" for n in expected if actual.get(n) is None]
    problems += [f"{n}: no full-sequence gradient" for n in actual if expected.get(n) is None
                 and actual.get(n) is not None]
    return problems


def judge_exact(loss_full: float, loss_seq: float, grads_full: dict, grads_seq: dict,
                rtol: float = FP32_RTOL) -> Verdict:
    """fp32: the loss and every parameter gradient within `rtol` (relative, per tensor)."""
    problems = _gradient_problems(grads_full, grads_seq)
    loss_rel = _relative(loss_seq, loss_full)
    if not loss_rel <= rtol:
        problems.insert(0, f"loss {loss_seq:.8g} vs {loss_full:.8g} (rel {loss_rel:.1e})")
    errors = {n: max_relative_error(grads_seq[n], g) for n, g in grads_full.items()
              if g is not None and grads_seq.get(n) is not None}
    over = sorted((n for n, e in errors.items() if not e <= rtol), key=lambda n: -errors[n])
    worst = max(errors, key=errors.get) if errors else None
    numbers = {
        "criterion": f"loss and every gradient: max|diff| / max|full| <= {rtol:g}",
        "loss_full": loss_full, "loss_seq1f1b": loss_seq, "loss_rel_err": loss_rel,
        "params_compared": len(errors), "grad_max_rel_err": errors.get(worst, 0.0),
        "worst_param": worst, "params_over": over[:10], "params_over_count": len(over),
    }
    detail = (f"loss rel {loss_rel:.1e}; worst gradient rel {errors.get(worst, 0.0):.1e} "
              f"({worst}) of {len(errors)}; limit {rtol:g}")
    if over:
        problems.append(f"{len(over)} of {len(errors)} gradients over rel {rtol:g}, worst "
                        f"{errors[over[0]]:.1e} ({over[0]})")
    if problems:
        return Verdict("fail", "; ".join(problems), numbers)
    return Verdict("pass", detail, numbers)


def judge_cosine(loss_full: float, loss_seq: float, grads_full: dict, grads_seq: dict,
                 loss_rtol: float = BF16_LOSS_RTOL,
                 min_cosine: float = BF16_MIN_COSINE) -> Verdict:
    """bf16: loss within `loss_rtol`; overall gradient cosine >= `min_cosine` (judged);
    the smallest per-parameter cosine is reported."""
    problems = _gradient_problems(grads_full, grads_seq)
    loss_rel = _relative(loss_seq, loss_full)
    if not loss_rel <= loss_rtol:
        problems.insert(0, f"loss {loss_seq:.6g} vs {loss_full:.6g} (rel {loss_rel:.1e} > "
                           f"{loss_rtol:g})")
    names = [n for n, g in grads_full.items() if g is not None and grads_seq.get(n) is not None]
    per_param = {n: cosine_similarity(grads_seq[n], grads_full[n]) for n in names}
    errors = {n: max_relative_error(grads_seq[n], grads_full[n]) for n in names}
    overall = overall_cosine({n: grads_full[n] for n in names}, grads_seq) if names else 0.0
    lowest = min(per_param, key=per_param.get) if per_param else None
    below = sorted((n for n in names if not per_param[n] >= min_cosine), key=per_param.get)
    numbers = {
        "criterion": (f"loss rel <= {loss_rtol:g}; overall cosine (all gradients as one vector) "
                      f">= {min_cosine:g}; per-parameter minimum reported, not judged"),
        "loss_full": loss_full, "loss_seq1f1b": loss_seq, "loss_rel_err": loss_rel,
        "params_compared": len(names), "cosine_overall": overall,
        "cosine_min_param": per_param.get(lowest), "cosine_min_param_name": lowest,
        "params_below_min_cosine": below[:10], "params_below_min_cosine_count": len(below),
        "grad_max_rel_err": max(errors.values(), default=0.0),
        "worst_param": max(errors, key=errors.get) if errors else None,
    }
    if not overall >= min_cosine:
        problems.append(f"overall gradient cosine {overall:.6f} < {min_cosine:g}")
    if problems:
        return Verdict("fail", "; ".join(problems), numbers)
    low = "" if lowest is None else f", lowest parameter {per_param[lowest]:.5f} ({lowest})"
    return Verdict("pass", f"loss rel {loss_rel:.1e}; overall gradient cosine {overall:.6f}{low}",
                   numbers)


def judge_for(backend: str, dtype: str) -> Callable[..., Verdict]:
    """fp32 with Megatron's local layers: exact; bf16, and TE's TF32 "fp32": cosine."""
    if dtype == "bf16":
        return judge_cosine
    if backend == "te":
        return partial(judge_cosine, loss_rtol=TF32_LOSS_RTOL, min_cosine=TF32_MIN_COSINE)
    return judge_exact


def judge_memory(full_bytes: int, seq_bytes: int, max_ratio: float = MAX_MEMORY_RATIO) -> Verdict:
    """Seq1F1B's peak (above the run's start) at most `max_ratio` x the full sequence's."""
    mib = 2.0**20
    numbers = {"criterion": f"Seq1F1B peak <= {max_ratio:g} x full-sequence peak",
               "peak_full_mib": full_bytes / mib, "peak_seq1f1b_mib": seq_bytes / mib}
    if full_bytes <= 0:
        return Verdict("fail", "no allocation measured in the full-sequence run", numbers)
    ratio = seq_bytes / full_bytes
    numbers["ratio"] = ratio
    detail = (f"peak above start: full {full_bytes / mib:.1f} MiB, Seq1F1B "
              f"{seq_bytes / mib:.1f} MiB ({ratio:.2f}x; limit {max_ratio:g}x)")
    return Verdict("pass" if ratio <= max_ratio else "fail", detail, numbers)


def judge_trainer(log: dict | None, iterations: int, baseline: dict | None = None,
                  first_loss_rtol: float = BF16_LOSS_RTOL) -> Verdict:
    """A trainer run (its --log-json content): all iterations, finite falling losses; with a
    baseline run of the same weights and data, the same first loss."""
    if log is None:
        return Verdict("fail", "no --log-json written (see the run's log)", {})
    summary = log.get("summary", {})
    losses = list(summary.get("losses", []))
    numbers = {
        "iterations": len(losses), "losses": losses,
        "tokens_per_s": summary.get("tokens_per_s"),
        "mean_ms_per_iter": summary.get("mean_ms_per_iter"),
        "peak_gib_per_stage": summary.get("peak_gib_per_stage"),
    }
    problems = []
    if len(losses) != iterations:
        problems.append(f"{len(losses)} iterations logged, expected {iterations}")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses):
        problems.append("non-finite loss")
    elif losses and not losses[-1] < losses[0]:
        problems.append(f"loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")
    base_losses = list((baseline or {}).get("summary", {}).get("losses", []))
    if losses and base_losses:
        first_rel = _relative(losses[0], base_losses[0])
        pairs = list(zip(losses, base_losses))
        numbers.update(
            first_loss_rel_diff=first_rel,
            max_loss_rel_diff=max(_relative(a, b) for a, b in pairs),
            tokens_per_s_ratio=(summary.get("tokens_per_s") or 0.0)
            / max(baseline["summary"].get("tokens_per_s") or 0.0, 1e-9),
        )
        if not first_rel <= first_loss_rtol:
            problems.append(f"first loss {losses[0]:.6g} vs Megatron's {base_losses[0]:.6g} "
                            f"(rel {first_rel:.1e} > {first_loss_rtol:g})")
    if problems:
        return Verdict("fail", "; ".join(problems), numbers)
    detail = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
              f"{numbers['tokens_per_s'] or 0:.0f} tokens/s")
    if "tokens_per_s_ratio" in numbers:
        detail += (f" ({numbers['tokens_per_s_ratio']:.2f}x Megatron); loss curves within rel "
                   f"{numbers['max_loss_rel_diff']:.1e}")
    return Verdict("pass", detail, numbers)
