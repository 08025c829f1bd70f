"""Measurements -> result rows: medians, tokens/s and ratios against Megatron's schedules.

The rows are the ``schedules`` list of results.json; the markdown tables and
the bar chart are drawn from them.
"""

from __future__ import annotations

import statistics

from megatron_seq1f1b.bench.confirm import AUTO_TARGET
from megatron_seq1f1b.bench.lineup import AUTO_KEY, SWEEP_KEY, BenchSchedule


def reference_key(schedules: list[BenchSchedule]) -> str | None:
    """The row the ``*_vs_1f1b`` ratios are against: Megatron 1F1B, or where it did not run
    (context parallelism) Seq1F1B k=1, the same schedule with the whole sequence as one
    segment."""
    keys = [s.key for s in schedules]
    return next((k for k in ("1f1b", "seq1f1b-k1") if k in keys), None)


#: Backends whose kernels skip masked attention work in Megatron's rows as in ours.
FUSED_BACKENDS = ("flash", "te", "transformer_engine")
#: On a fused backend, a Seq1F1B row computing less than this share of Megatron's CPU time
#: points at a slower baseline path, not at the schedule.
FAIR_CPU_RATIO = 0.95


def fairness_note(row: dict, attention_backend: str | None) -> str | None:
    """Why a row's ratio is suspect: on a fused backend segments cannot do less work than
    whole micro-batches, so a Seq1F1B row whose compute (CPU time) is clearly below
    Megatron's points at a baseline defect (the baseline ran slower code) or at the CPU
    (smaller tensors run faster there; noise), not at the schedule."""
    ratio = row.get("cpu_ratio_vs_1f1b")
    if row["megatron"] or ratio is None or attention_backend not in FUSED_BACKENDS \
            or ratio >= FAIR_CPU_RATIO:
        return None
    return (f"computes {ratio:.2f}x of Megatron's CPU time on {attention_backend} attention, "
            f"below {FAIR_CPU_RATIO}: segments cannot do less work than whole micro-batches on "
            "a fused kernel, so either the baseline row ran slower code (a baseline defect), or "
            "the CPU ran the same work faster on smaller tensors (caches, page faults) or "
            "noisily: until --profile-ops or other invocations show which, this row's speed-up "
            "may overstate the schedule's")


def split_parts(base: dict | None, row: dict) -> tuple[float, float] | None:
    """The speed-up of `row` over `base` from their recorded timelines, split as (bubble part,
    busy-time part): makespan = busy of all ranks / (ranks x (1 - bubble)), so speed-up =
    (1 - bubble_row) / (1 - bubble_base) x busy_base / busy_row."""
    a, b = (base or {}).get("timeline"), row.get("timeline")
    if not a or not b or not sum(b.get("busy_s") or ()) or a["bubble_fraction"] >= 1:
        return None
    return ((1 - b["bubble_fraction"]) / (1 - a["bubble_fraction"]),
            sum(a["busy_s"]) / sum(b["busy_s"]))


def summarize(schedules: list[BenchSchedule], tokens_per_iter: int,
              attention_backend: str | None = None) -> list[dict]:
    """One row per schedule, with ratios against the reference row (:func:`reference_key`)
    and Megatron interleaved 1F1B; each ratio split into its bubble and busy-time parts where
    timelines were recorded, and rows flagged by :func:`fairness_note`."""
    ref_key = reference_key(schedules)
    base = next((s for s in schedules if s.key == ref_key), None)
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
            "first_iteration_loss": s.first_loss, "saved_bytes_per_stage": s.saved_peaks,
            "timeline": s.timeline, "prediction": s.prediction,
            "form": getattr(s, "form", "plain"),
            "documents": getattr(s, "document_stats", None),  # bench/document_stats.py
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
            r[f"parts_{name}"] = split_parts(b, r)
            r[f"peak_ratio_{name}"] = [
                (x / y if y else None) for x, y in zip(r["peak_bytes_per_stage"],
                                                      b["peak_bytes_per_stage"])]
    for r in rows:
        r["fairness"] = fairness_note(r, attention_backend)
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


def auto_vs_sweep(rows: list[dict], plan: dict, target: float = AUTO_TARGET,
                  confirmed: dict | None = None) -> dict:
    """The ``seq1f1b-auto`` row against the best ``seq1f1b-k{K}`` row, and the planner's
    prediction error (its predicted iteration against the auto row's measured median).

    ``confirmed`` (:func:`~megatron_seq1f1b.bench.confirm.confirmation`): the verdict
    comes from the confirmation race, new samples of auto and its closest rivals, rather
    than from the sweep that chose them.
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
