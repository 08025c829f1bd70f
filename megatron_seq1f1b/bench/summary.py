"""Measurements -> result rows: medians, tokens/s and ratios against Megatron's schedules.

The rows are the ``schedules`` list of results.json; the markdown tables and
the bar chart are drawn from them.
"""

from __future__ import annotations

import math
import statistics

from megatron_seq1f1b.bench.lineup import AUTO_KEY, SWEEP_KEY, BenchSchedule

AUTO_TARGET = 0.97  # the auto plan's tokens/s at least this share of the best measured k


def summarize(schedules: list[BenchSchedule], tokens_per_iter: int) -> list[dict]:
    """One row per schedule, with ratios against Megatron 1F1B (and interleaved 1F1B)."""
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
    for r in rows:  # zero-bubble rows against the Seq1F1B schedule they refine
        ref = by_key.get(SEQ1F1B_OF.get(r["key"], ""))
        if ref is None:
            continue
        paired = [bt / t for bt, t in zip(ref["times_s"], r["times_s"])]
        r["vs_seq1f1b"] = {
            "key": ref["key"], "speedup": r["tokens_per_s"] / ref["tokens_per_s"],
            "paired_speedup": statistics.median(paired), "paired_range": [min(paired), max(paired)],
            "stage0_peak_ratio": (r["peak_bytes_per_stage"][0] / ref["peak_bytes_per_stage"][0]
                                  if ref["peak_bytes_per_stage"][0] else None),
            "bubble_ratio": (r["timeline"]["bubble_fraction"] / ref["timeline"]["bubble_fraction"]
                             if r.get("timeline") and ref.get("timeline")
                             and ref["timeline"]["bubble_fraction"] else None),
        }
    return rows


# Zero-bubble rows and the Seq1F1B row each is compared with.
SEQ1F1B_OF = {"seq1f1b-zb-h1": "seq1f1b-balanced", "seq1f1b-zb-h2": "seq1f1b-balanced",
              "seq1f1b-interleaved-zb-h1": "seq1f1b-interleaved"}


def same_plan(a: BenchSchedule, b: BenchSchedule) -> bool:
    """Whether two rows run the same plan (segments and schedule variant) on the same layout."""
    return (a.lengths == b.lengths and a.schedule == b.schedule and a.layout == b.layout
            and a.megatron == b.megatron and a.recompute == b.recompute)


def sweep_twin(schedules: list[BenchSchedule], auto: BenchSchedule) -> BenchSchedule | None:
    """The sweep row that runs exactly the auto plan, if any: a control whose true ratio is 1."""
    return next((s for s in schedules if SWEEP_KEY.fullmatch(s.key) and same_plan(s, auto)),
                None)


def closest_rivals(schedules: list[BenchSchedule], count: int,
                   auto: BenchSchedule | None = None) -> list[BenchSchedule]:
    """The `count` sweep rows with the shortest median time (the confirmation's rivals),
    leaving out the row that runs ``auto``'s own plan (beating itself is noise)."""
    sweep = [s for s in schedules if SWEEP_KEY.fullmatch(s.key)
             and (auto is None or not same_plan(s, auto))]
    return sorted(sweep, key=lambda s: statistics.median(s.times))[:count]


# Two-sided 95 % quantiles of Student's t by degrees of freedom (1.96 beyond the table).
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14,
        2.13, 2.12, 2.11, 2.10, 2.09, 2.09)


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios and its 95 % interval (t on the log ratios)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = (_T95[len(logs) - 2] if len(logs) - 1 <= len(_T95) else 1.96) * \
        statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def confirmation(times: dict[str, list[float]], target: float = AUTO_TARGET,
                 twin: str | None = None) -> dict:
    """Auto's tokens/s over each rival's, per confirmation round: geometric mean with its
    95 % interval, and the verdict against the rival that beats auto most.

    ``twin``: the key of a row that runs auto's own plan. Its ratio (true value 1) shows
    the measurement noise; its runs and auto's are samples of one plan, so per round
    auto's time is the geometric mean of the two (half the variance on auto's side).
    """
    auto = times[AUTO_KEY]
    control = None
    if twin is not None:
        ratios = [t / a for a, t in zip(auto, times[twin])]
        mean, low, high = ratio_interval(ratios)
        control = {"key": twin, "ratios": ratios, "ratio": mean, "low": low, "high": high,
                   "median_s": statistics.median(times[twin])}
        auto = [math.sqrt(a * t) for a, t in zip(auto, times[twin])]
    rivals = {}
    for key, rival in times.items():
        if key in (AUTO_KEY, twin):
            continue
        ratios = [r / a for a, r in zip(auto, rival)]
        mean, low, high = ratio_interval(ratios)
        rivals[key] = {"ratios": ratios, "ratio": mean, "low": low, "high": high,
                       "median_s": statistics.median(rival)}
    worst_key = min(rivals, key=lambda k: rivals[k]["ratio"])
    worst = rivals[worst_key]
    verdict = ("hit" if worst["low"] >= target else "miss" if worst["high"] < target
               else "hit within noise" if worst["ratio"] >= target else "miss within noise")
    return {"rounds": len(auto), "auto_median_s": statistics.median(auto), "rivals": rivals,
            "same_plan": control, "against": worst_key, "ratio": worst["ratio"],
            "interval": [worst["low"], worst["high"]], "verdict": verdict,
            "hit": worst["ratio"] >= target}


def auto_vs_sweep(rows: list[dict], plan: dict, target: float = AUTO_TARGET,
                  confirmed: dict | None = None) -> dict:
    """The ``seq1f1b-auto`` row against the best ``seq1f1b-k{K}`` row, and the planner's
    prediction error (its predicted iteration against the auto row's measured median).

    ``confirmed`` (:func:`confirmation`): the verdict comes from the confirmation rounds,
    new samples of auto and its closest rivals, rather than from the sweep that chose them.
    """
    auto = next(r for r in rows if r["key"] == AUTO_KEY)
    sweep = [r for r in rows if SWEEP_KEY.fullmatch(r["key"])]
    best = max(sweep, key=lambda r: r["tokens_per_s"], default=None)
    result = {
        "plan": plan, "auto_tokens_per_s": auto["tokens_per_s"], "auto_median_s": auto["median_s"],
        "prediction_error": plan["predicted_s"] / auto["median_s"] - 1.0,
        "sweep": [[r["k"], r["tokens_per_s"]] for r in sweep], "best_key": None, "best_k": None,
        "best_tokens_per_s": None, "ratio": None, "paired_ratio": None, "target": target,
        "hit": None,
    }
    if best is not None:
        # Runs alternate: the median of per-round ratios is less sensitive to drift.
        paired = [b / a for a, b in zip(auto["times_s"], best["times_s"])]
        ratio = auto["tokens_per_s"] / best["tokens_per_s"]
        result.update(best_key=best["key"], best_k=best["k"],
                      best_tokens_per_s=best["tokens_per_s"], ratio=ratio,
                      paired_ratio=statistics.median(paired), hit=ratio >= target)
    if confirmed is not None:
        result.update(confirmation=confirmed, hit=confirmed["hit"])
    return result
