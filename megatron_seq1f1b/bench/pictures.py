"""Pictures: the throughput/memory bar chart, and each schedule's measured/simulated timeline."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_seq1f1b.bench.lineup import BenchSchedule
from megatron_seq1f1b.bench.units import MiB
from megatron_seq1f1b.schedules.replay import Timeline


def bar_chart(rows: list[dict], path: Path, title: str) -> None:
    """tokens/s (with the ratio against Megatron) and peak memory per stage, per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"].replace(" 1F1B", "\n1F1B").replace(" k=", "\nk=") for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(rows)), 4.6))
    colours = ["0.55" if r["megatron"] else "tab:blue" for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    bars = ax1.bar(range(len(rows)), values, color=colours)
    for bar, r in zip(bars, rows):
        speed = r.get("speedup_vs_1f1b_interleaved") if r["vpp"] else None
        speed = speed or r.get("speedup_vs_1f1b")
        if speed is not None:
            ax1.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{speed:.2f}×",
                     ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(rows)))
    ax1.set_xticklabels(labels, fontsize=7)
    ax1.set_ylabel("tokens / s (median)")
    ax1.set_title("throughput", fontsize=10)
    stages = len(rows[0]["peak_bytes_per_stage"])
    width = 0.8 / stages
    for stage in range(stages):
        ax2.bar([i + (stage - (stages - 1) / 2) * width for i in range(len(rows))],
                [r["peak_bytes_per_stage"][stage] / MiB for r in rows], width=width,
                label=f"stage {stage}")
    ax2.set_xticks(range(len(rows)))
    ax2.set_xticklabels(labels, fontsize=7)
    ax2.set_ylabel("peak MiB above start")
    ax2.set_title("peak memory per pipeline stage", fontsize=10)
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _waits_note(timeline: Timeline) -> str:
    # Megatron's schedules are timed by wrapping their steps: their p2p waits are not recorded.
    return "" if any(timeline.waits) else " (p2p waits not recorded)"


def draw_measured_timelines(schedules: list[BenchSchedule], timelines: dict[str, Timeline],
                            args: argparse.Namespace, out: Path) -> None:
    """timeline_<key>_measured.png (grey bars: p2p waits) and .json (Chrome trace), all on one
    time axis, and timelines_measured.png: all of them stacked on that axis."""
    from megatron_seq1f1b.schedules import draw

    x_max = draw.shared_time_axis([timelines[s.key] for s in schedules])
    titles = []
    for s in schedules:
        title = (f"measured: {s.label}, p={args.pp}, m={args.microbatches}, "
                 f"makespan {s.timeline['makespan_s'] * 1e3:.0f} ms, bubble "
                 f"{s.timeline['bubble_fraction']:.1%}{_waits_note(timelines[s.key])}")
        titles.append(title)
        draw.draw_png(timelines[s.key], out / f"timeline_{s.key}_measured.png", title=title,
                      time_label="seconds (measured)", show_waits=True, x_max=x_max)
        draw.write_chrome_trace(timelines[s.key], out / f"timeline_{s.key}_measured.json",
                                time_unit_us=1e6)
    if len(schedules) > 1:
        draw.draw_timelines([timelines[s.key] for s in schedules], out / "timelines_measured.png",
                            titles, time_label="seconds (measured)", show_waits=True,
                            x_max=x_max)


def draw_simulated_timelines(schedules: list[BenchSchedule], timelines: dict[str, Timeline],
                             args: argparse.Namespace, variant: str, out: Path) -> None:
    """timeline_<key>_simulated.png: the primary prediction's timeline from calibrated costs,
    all on one time axis, and timelines_simulated.png: all of them stacked on that axis."""
    from megatron_seq1f1b.schedules import draw

    x_max = draw.shared_time_axis([timelines[s.key] for s in schedules])
    time_label = "seconds (simulated from calibrated costs)"
    titles = []
    for s in schedules:
        entry = s.prediction
        titles.append(f"simulated ({variant}): {s.label}, p={args.pp}, m={args.microbatches}, "
                      f"makespan {entry['makespan_s'] * 1e3:.0f} ms, bubble "
                      f"{entry['bubble_fraction']:.1%}")
        draw.draw_png(timelines[s.key], out / f"timeline_{s.key}_simulated.png",
                      title=titles[-1], time_label=time_label, x_max=x_max)
    if len(schedules) > 1:
        draw.draw_timelines([timelines[s.key] for s in schedules], out / "timelines_simulated.png",
                            titles, time_label=time_label, x_max=x_max)
