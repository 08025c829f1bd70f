#!/usr/bin/env python
"""Side-by-side summary of training runs written by pretrain_gpt.py --log-json.

    python scripts/compare_runs.py out/demo/1f1b.json out/demo/seq1f1b.json \
        out/demo/1f1b-flash.json out/demo/seq1f1b-flash.json --timelines out/demo/timelines.png

Runs are grouped by attention backend (unfused ``local`` or ``flash``); in each group the
first run is the baseline the others are compared with: tokens/s, stage-0 peak memory and the
measured bubble, one column per backend, and the timed iteration's speed-up split into the
part of the bubble (the schedule's) and the part of busy time (the work done). With
``--timelines`` every run's measured timeline is redrawn on one shared time axis (its own
timeline.png) and all of them are stacked into that picture. Exit status 1 if a run's loss
curve differs from its baseline's by more than 1e-5 (relative).
"""

from __future__ import annotations

import argparse
import json
import statistics

BACKENDS = {"local": "unfused", "flash": "flash"}


def _timed(summary: dict) -> list[dict]:
    """Every timed iteration's stats (older logs: the last iteration's only)."""
    return summary.get("timelines") or ([summary["timeline"]] if summary.get("timeline") else [])


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _bubble(summary: dict) -> str:
    timed = _timed(summary)
    return f"{_median([t['bubble_fraction'] for t in timed]):.1%}" if timed else "-"


def _backend(summary: dict) -> str:
    return BACKENDS.get(summary.get("attention_backend", "local"),
                        summary.get("attention_backend", "local"))


def _parts(a: dict, b: dict) -> tuple[float, float] | None:
    """One iteration's speed-up of `b` over `a` as (bubble part, busy-time part).

    makespan = busy time of all ranks / (ranks * (1 - bubble)), so the speed-up is exactly
    (1 - bubble_b) / (1 - bubble_a) times busy_a / busy_b.
    """
    if not sum(b["busy_s"]) or a["bubble_fraction"] >= 1:
        return None
    return ((1 - b["bubble_fraction"]) / (1 - a["bubble_fraction"]),
            sum(a["busy_s"]) / sum(b["busy_s"]))


def split_speedup(base: dict, run: dict) -> tuple[tuple[float, float], list] | None:
    """The speed-up of `run` over `base` split as (bubble part, busy-time part), from the
    medians of their timed iterations (one slow iteration does not move it), and every
    iteration's parts (iterations paired by number) for the spread."""
    timed_a, timed_b = _timed(base), _timed(run)
    if not timed_a or not timed_b:
        return None
    median = {key: [_median([t["bubble_fraction"] for t in timed]),
                    _median([sum(t["busy_s"]) for t in timed])]
              for key, timed in (("a", timed_a), ("b", timed_b))}
    parts = _parts(*({"bubble_fraction": m[0], "busy_s": [m[1]]} for m in median.values()))
    if parts is None:
        return None
    spread = [p for p in map(_parts, timed_a, timed_b) if p]
    return parts, spread


def _with_spread(value: float, values: list[float]) -> str:
    if len(values) < 2:
        return f"{value:.2f}x"
    return f"{value:.2f}x ({min(values):.2f}-{max(values):.2f})"


def _table(rows: list[tuple[str, list[str]]], head: list[str]) -> None:
    width = max(len(name) for name, _ in rows + [("", head)]) + 2
    cells = max(len(c) for _, values in rows for c in values + head) + 3
    print(f"{'':<{width}}" + "".join(f"{h:>{cells}}" for h in head))
    for name, values in rows:
        print(f"{name:<{width}}" + "".join(f"{v:>{cells}}" for v in values))


def compare(runs: list[dict]) -> bool:
    """Print the summary; True if every loss curve equals its baseline's within 1e-5."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(_backend(run), []).append(run)
    width = max(len(run["schedule"]) for run in runs) + 2
    print(f"{'schedule':<{width}}{'attention':<11}{'final loss':>10}{'ms/iter':>10}"
          f"{'tokens/s':>10}{'bubble':>9}   peak memory per stage (MiB, above start of "
          f"iteration)")
    for run in runs:
        peaks = " / ".join(f"{p * 1024:.0f}" for p in run["peak_gib_per_stage"])
        print(f"{run['schedule']:<{width}}{_backend(run):<11}{run['final_lm_loss']:>10.6f}"
              f"{run['mean_ms_per_iter']:>10.0f}{run['tokens_per_s']:>10.0f}{_bubble(run):>9}"
              f"   {peaks}")

    worst = max((abs(a - b) / abs(b) for group in groups.values() for run in group[1:]
                 for a, b in zip(run["losses"], group[0]["losses"])), default=0.0)
    equal = worst < 1e-5
    print()
    print(f"loss curves: {len(runs[0]['losses'])} iterations, largest relative difference "
          f"from the same attention's baseline {worst:.1e}: "
          f"{'equal' if equal else 'DIFFERENT'} within 1e-5")

    names = list(dict.fromkeys(run["schedule"] for group in groups.values()
                               for run in group[1:]))
    for name in names:
        columns = [(backend, group[0], run) for backend, group in groups.items()
                   for run in group[1:] if run["schedule"] == name]
        bases = {base["schedule"] for _, base, _ in columns}
        print()
        head = [f"{backend} attention" for backend, _, _ in columns]
        rows = [("tokens/s", [f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x"
                              for _, b, r in columns]),
                ("stage-0 peak memory", [
                    f"{r['peak_gib_per_stage'][0] / max(b['peak_gib_per_stage'][0], 1e-12):.2f}x"
                    for _, b, r in columns]),
                ("measured bubble", [f"{_bubble(b)} -> {_bubble(r)}" for _, b, r in columns])]
        splits = [split_speedup(b, r) for _, b, r in columns]
        if all(splits):
            timed = min(len(spread) for _, spread in splits)
            rows += [(f"bubble part (median of {timed} it.)",
                      [_with_spread(p[0], [s[0] for s in spread]) for p, spread in splits]),
                     (f"busy-time part (median of {timed} it.)",
                      [_with_spread(p[1], [s[1] for s in spread]) for p, spread in splits])]
        print(f"{name} vs {' / '.join(sorted(bases))}:")
        _table(rows, head)
        if all(splits):
            print(_explanation(columns))
    return equal


def _explanation(columns: list) -> str:
    """Three plain lines: which part is the schedule's, which the kernels'."""
    backends = {backend for backend, _, _ in columns}
    lines = ["speed-up = bubble part x busy-time part (medians; the range over iterations in "
             "brackets).",
             "bubble part: the schedule's gain, less time idle waiting for other stages.",
             "busy-time part: the compute's, what segments cost against the work they save"]
    if "unfused" in backends:
        lines[-1] += ("; unfused attention computes masked scores that segments skip, flash "
                      "does not, so the flash column is what flash and TE users get.")
    else:
        lines[-1] += "."
    return "\n".join(_wrap(line) for line in lines)


def _wrap(text: str, width: int = 100) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def draw_timelines(runs: list[dict], path: str) -> list[str]:
    """Redraw every run's measured timeline on one time axis; stack them all into `path`."""
    from megatron_seq1f1b.schedules import draw

    drawn = [run for run in runs if (run.get("timeline") or {}).get("trace")]
    if not drawn:
        return []
    timelines = [draw.read_chrome_trace(run["timeline"]["trace"], time_unit_us=1e6)
                 for run in drawn]
    x_max = draw.shared_time_axis(timelines)
    titles = []
    for run, timeline in zip(drawn, timelines):
        # Megatron's schedules are timed by wrapping their steps: no p2p waits recorded.
        note = "" if any(timeline.waits) else " (p2p waits not recorded)"
        titles.append(f"{run['schedule']}, {_backend(run)} attention: bubble "
                      f"{_bubble(run)}{note}")
        if run["timeline"].get("png"):
            draw.draw_png(timeline, run["timeline"]["png"], titles[-1],
                          time_label="seconds (measured)", show_waits=True, x_max=x_max)
    draw.draw_timelines(timelines, path, titles, time_label="seconds (measured)",
                        show_waits=True, x_max=x_max)
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="--log-json files; per attention backend, "
                                                "the first is the baseline")
    parser.add_argument("--timelines", help="stack all measured timelines, on one time axis, "
                                            "into this PNG (and redraw each on that axis)")
    args = parser.parse_args(argv)
    runs = [json.load(open(path))["summary"] for path in args.runs]
    equal = compare(runs)
    pictures, shared = [], ""
    if args.timelines:
        try:
            pictures = draw_timelines(runs, args.timelines)
            shared = "PNGs on one time axis; " if pictures else ""
        except ImportError as exc:  # matplotlib is optional
            print(f"no timeline pictures: {exc}")
    pictures += [run["timeline"][key] for run in runs if run.get("timeline")
                 for key in ("png", "trace") if run["timeline"].get(key)]
    if pictures:
        print()
        print(f"measured timelines ({shared}open the .json in https://ui.perfetto.dev):\n  "
              + "\n  ".join(pictures))
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
