"""Context-parallel bytes and predicted stage-0 memory in results.json and results.md.

Per row, beside what was measured, what the planner counted, so that a run shows at once
whether the planner's CP traffic and memory models hold for it: ``cp_bytes_measured`` /
``cp_bytes_predicted`` (bytes one rank sends in its CP group per iteration, the most any
rank sent; None for Megatron's rows, which exchange none) and ``stage0_predicted_bytes``
(activations of one stage-0 rank) with their ratios.
"""

from __future__ import annotations

import argparse

from megatron_seq1f1b.bench.cp_bytes import predicted_bytes
from megatron_seq1f1b.bench.lineup import BenchSchedule
from megatron_seq1f1b.bench.stage0_memory import predicted_stage0_bytes
from megatron_seq1f1b.bench.units import MiB


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def add_fields(rows: list[dict], schedules: list[BenchSchedule], measured: dict[str, float],
               args: argparse.Namespace, config, documents: list | None = None) -> None:
    """Add the CP byte counts and the predicted stage-0 memory to every result row
    (``documents``: each packed micro-batch's, for the memory the planner predicts)."""
    by_key = {s.key: s for s in schedules}
    for row in rows:
        sched = by_key[row["key"]]
        row["cp_bytes_measured"] = measured.get(row["key"])
        row["cp_bytes_predicted"] = (None if sched.megatron
                                     else predicted_bytes(sched, args, config))
        row["cp_bytes_ratio"] = _ratio(row["cp_bytes_measured"], row["cp_bytes_predicted"])
        row["stage0_predicted_bytes"] = predicted_stage0_bytes(sched, args, config, documents)
        row["stage0_prediction_ratio"] = _ratio(row["stage0_predicted_bytes"],
                                                row["peak_bytes_per_stage"][0])
        saved = row.get("saved_bytes_per_stage")
        row["stage0_saved_prediction_ratio"] = _ratio(row["stage0_predicted_bytes"],
                                                      saved[0] if saved else None)


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MiB:.3f}"  # tiny models: small counts


def table(rows: list[dict], meta: dict) -> list[str]:
    """results.md's "Context parallelism" section (CP bytes and stage-0 memory per row)."""
    cp = meta.get("context_parallel_size", 1)
    lines = ["", "## Context parallelism", "",
             f"Context-parallel size {cp}. CP bytes: what one rank sends in its CP group per "
             "iteration (all-gather of keys and values, reduce-scatter of their gradients; "
             "mean over runs, the most any rank sent), measured by the executor and counted "
             "by the planner (context_parallel.exchanged_bytes). Stage-0 memory: measured "
             "peak (median over runs, above the memory resident at the run's start) and the "
             "planner's activations of one stage-0 rank (planner.stage_memory); with "
             "--count-saved also what autograd kept for backward (the activations without "
             "one layer's temporaries, such as the collectives' buffers).", "",
             "| schedule | CP MiB measured | CP MiB predicted | measured ÷ predicted | "
             "stage-0 peak MiB | stage-0 saved MiB | predicted MiB | predicted ÷ peak | "
             "predicted ÷ saved |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        saved = r.get("saved_bytes_per_stage")
        cells = [
            _mib(r.get("cp_bytes_measured")), _mib(r.get("cp_bytes_predicted")),
            _num(r.get("cp_bytes_ratio"), ".3f"), _mib(r["peak_bytes_per_stage"][0]),
            _mib(saved[0] if saved else None), _mib(r.get("stage0_predicted_bytes")),
            _num(r.get("stage0_prediction_ratio"), ".3f"),
            _num(r.get("stage0_saved_prediction_ratio"), ".3f")]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return lines
