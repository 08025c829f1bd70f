#!/usr/bin/env python
"""Side-by-side summary of training runs written by pretrain_gpt.py --log-json.

    python scripts/compare_runs.py out/demo/1f1b.json out/demo/seq1f1b.json

The first run is the baseline. Exit status 1 if the loss curves differ by more
than 1e-5 (relative).
"""

from __future__ import annotations

import json
import sys


def _bubble(summary: dict) -> str:
    timeline = summary.get("timeline")
    return f"{timeline['bubble_fraction']:.1%}" if timeline else "-"


def main(paths: list[str]) -> int:
    runs = [json.load(open(path))["summary"] for path in paths]
    base = runs[0]
    width = max(len(run["schedule"]) for run in runs) + 2
    print(f"{'schedule':<{width}}{'final loss':>12}{'ms/iter':>10}{'tokens/s':>10}"
          f"{'bubble':>9}   peak memory per stage (MiB, above start of iteration)")
    for run in runs:
        peaks = " / ".join(f"{p * 1024:.0f}" for p in run["peak_gib_per_stage"])
        print(f"{run['schedule']:<{width}}{run['final_lm_loss']:>12.6f}"
              f"{run['mean_ms_per_iter']:>10.0f}{run['tokens_per_s']:>10.0f}{_bubble(run):>9}"
              f"   {peaks}")
    worst = max(abs(a - b) / abs(b) for run in runs[1:]
                for a, b in zip(run["losses"], base["losses"]))
    equal = worst < 1e-5
    print()
    print(f"loss curves: {len(base['losses'])} iterations, largest relative difference "
          f"{worst:.1e}: {'equal' if equal else 'DIFFERENT'} within 1e-5")
    for run in runs[1:]:
        speed = run["tokens_per_s"] / base["tokens_per_s"]
        memory = run["peak_gib_per_stage"][0] / max(base["peak_gib_per_stage"][0], 1e-12)
        line = (f"{run['schedule']} vs {base['schedule']}: tokens/s {speed:.2f}x, stage-0 peak "
                f"memory {memory:.2f}x")
        if run.get("timeline") and base.get("timeline"):
            line += f", measured bubble {_bubble(base)} -> {_bubble(run)}"
        print(line)
    pictures = [run["timeline"][key] for run in runs if run.get("timeline")
                for key in ("png", "trace") if run["timeline"].get(key)]
    if pictures:
        print("measured timelines (open the .json in https://ui.perfetto.dev): "
              + ", ".join(pictures))
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
