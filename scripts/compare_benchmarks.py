#!/usr/bin/env python
"""Stage-0 peak memory of the rows two benchmark runs share, side by side.

    python scripts/compare_benchmarks.py out/bench_pp2_cp1/results.json \
        out/bench_pp2_cp2/results.json --max-ratio 0.6

Made for context parallelism (issue 32): the same model and k on pp2 x cp1 (BASE) and pp2 x
cp2 (RUN); per row measured stage-0 peak of both, RUN / BASE, and the planner's prediction
beside each measurement (predicted / measured). ``--measure saved`` compares what autograd
kept for backward (runs with ``--count-saved``) instead of the resident peak, which also holds
one layer's temporaries. With ``--max-ratio R`` the exit status is 1 when a shared row's
RUN / BASE exceeds R (``--keys`` picks the rows), 0 otherwise.
(scripts/compare_runs.py compares pretrain_gpt.py logs, not benchmark results.)
"""

from __future__ import annotations

import argparse
import json
import sys

MiB = 2 ** 20


def _rows(path: str) -> tuple[dict, dict[str, dict]]:
    result = json.loads(open(path).read())
    return result["meta"], {row["key"]: row for row in result["schedules"]}


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


#: --measure: (the row's per-stage bytes, its predicted / measured field)
MEASURES = {"peak": ("peak_bytes_per_stage", "stage0_prediction_ratio"),
            "saved": ("saved_bytes_per_stage", "stage0_saved_prediction_ratio")}


def compare(base_path: str, run_path: str, keys: list[str] | None = None,
            measure: str = "peak") -> list[tuple[str, float | None]]:
    """Print the table; (key, RUN / BASE stage-0 bytes) per shared row."""
    field, predicted = MEASURES[measure]
    base_meta, base = _rows(base_path)
    run_meta, run = _rows(run_path)
    shared = [k for k in run if k in base and (not keys or k in keys)]
    print(f"BASE {base_path}: cp {base_meta.get('context_parallel_size', 1)}, "
          f"{base_meta['world_size']} ranks; RUN {run_path}: cp "
          f"{run_meta.get('context_parallel_size', 1)}, {run_meta['world_size']} ranks")
    print(f"stage-0 {measure} memory")
    print("| row | BASE stage-0 MiB (pred. ÷ meas.) | RUN stage-0 MiB (pred. ÷ meas.) | "
          "RUN ÷ BASE | RUN CP MiB measured ÷ predicted |")
    print("|---|---:|---:|---:|---:|")
    ratios = []
    for key in shared:
        if not (base[key].get(field) and run[key].get(field)):
            print(f"| {key} | - | - | - | - |  ({field} missing: run with --count-saved)")
            ratios.append((key, None))
            continue
        a, b = base[key][field][0], run[key][field][0]
        ratio = b / a if a else None
        ratios.append((key, ratio))
        print(f"| {key} | {a / MiB:.1f} ({_cell(base[key].get(predicted), '.3f')})"
              f" | {b / MiB:.1f} ({_cell(run[key].get(predicted), '.3f')}) | "
              f"{_cell(ratio, '.3f')} | {_cell(run[key].get('cp_bytes_ratio'), '.3f')} |")
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="results.json of the baseline run (e.g. pp2 x cp1)")
    p.add_argument("run", help="results.json of the run compared with it (e.g. pp2 x cp2)")
    p.add_argument("--keys", nargs="+", default=None, help="rows to compare (default: shared)")
    p.add_argument("--measure", choices=sorted(MEASURES), default="peak",
                   help="peak: resident peak above the run's start; saved: bytes autograd "
                        "kept for backward (--count-saved)")
    p.add_argument("--max-ratio", type=float, default=None,
                   help="exit 1 when a row's RUN / BASE stage-0 peak exceeds this")
    args = p.parse_args(argv)
    ratios = compare(args.base, args.run, args.keys, args.measure)
    if not ratios:
        print("no shared rows", file=sys.stderr)
        return 1
    if args.max_ratio is not None:
        over = [k for k, r in ratios if r is None or r > args.max_ratio]
        print(f"RUN / BASE <= {args.max_ratio}: "
              + ("all rows" if not over else "NOT for " + ", ".join(over)))
        return 1 if over else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
