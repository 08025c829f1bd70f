#!/usr/bin/env python
"""Side-by-side summary of training runs written by pretrain_gpt.py --log-json.

    python scripts/compare_runs.py out/demo_1f1b.json out/demo_seq1f1b.json
"""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> int:
    runs = [json.load(open(path)) for path in paths]
    names = [run["summary"]["schedule"] for run in runs]
    base = runs[0]["summary"]
    width = max(len(n) for n in names) + 2
    print(f"{'schedule':<{width}}{'final loss':>12}{'ms/iter':>10}{'tokens/s':>10}{'speed-up':>10}"
          "   peak memory per stage (GiB, above start of iteration)")
    for name, run in zip(names, runs):
        s = run["summary"]
        peaks = " ".join(f"{p:.3f}" for p in s["peak_gib_per_stage"])
        ratio = s["tokens_per_s"] / base["tokens_per_s"]
        print(f"{name:<{width}}{s['final_lm_loss']:>12.6f}{s['mean_ms_per_iter']:>10.1f}"
              f"{s['tokens_per_s']:>10.0f}{ratio:>9.2f}x   {peaks}")
    losses = [run["summary"]["losses"] for run in runs]
    worst = max(abs(a - b) / abs(b) for other in losses[1:] for a, b in zip(other, losses[0]))
    print(f"loss curves: {len(losses[0])} iterations, largest relative difference {worst:.1e} "
          f"({'equal' if worst < 1e-5 else 'DIFFERENT'} within 1e-5)")
    peak_ratio = [
        run["summary"]["peak_gib_per_stage"][0] / max(base["peak_gib_per_stage"][0], 1e-12)
        for run in runs[1:]
    ]
    print("stage-0 peak memory vs the first run: " + ", ".join(f"{r:.2f}x" for r in peak_ratio))
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
