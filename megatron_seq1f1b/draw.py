"""Pictures of timelines: a PNG like the Seq1F1B paper's figures, and a Chrome trace.

Both take a :class:`~megatron_seq1f1b.replay.Timeline`, whether simulated or
measured in a real run, so simulated and measured schedules look alike.
One row per rank; colour per micro-batch; forwards light with a dark label,
backwards dark with a white label, weight-gradient work (``W``, zero-bubble
schedules) dark and hatched; the label is ``micro-batch.segment``
(``c<chunk>`` appended for model chunks > 0).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_seq1f1b.replay import Timeline


_CATEGORY = {"F": "forward", "B": "backward", "W": "weight-gradient"}


def _label(action) -> str:
    text = f"{action.microbatch}.{action.segment}"
    return f"{text}c{action.chunk}" if action.chunk else text


def draw_png(
    timeline: Timeline,
    path: str | Path,
    title: str = "",
    *,
    time_label: str = "time",
    show_waits: bool = False,
) -> Path:
    """Draw `timeline` into a PNG file (needs matplotlib: pip install matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "drawing needs matplotlib: pip install 'megatron-seq1f1b[plot]'"
        ) from exc

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = len(timeline.compute)
    makespan = timeline.makespan or 1.0
    count = sum(len(r) for r in timeline.compute)
    width = min(max(8.0, count / ranks * 0.45), 28.0)
    fig, ax = plt.subplots(figsize=(width, 0.6 * ranks + 1.3))
    cmap = plt.get_cmap("tab10")
    for rank, intervals in enumerate(timeline.compute):
        y = ranks - 1 - rank
        for iv in intervals:
            action = iv.action
            colour = cmap(action.microbatch % 10)
            forward = action.is_forward
            ax.barh(
                y, iv.end - iv.start, left=iv.start, height=0.8,
                color=colour, alpha=0.45 if forward else 1.0,
                edgecolor="black", linewidth=0.5, hatch="////" if action.is_weight else None,
            )
            span = iv.end - iv.start
            if span / makespan * width * 72 > 14:  # enough room (points) for a label
                ax.text(
                    iv.start + span / 2, y, _label(action), ha="center", va="center",
                    fontsize=7, color="black" if forward else "white",
                )
        if show_waits:
            for iv in timeline.waits[rank]:
                ax.barh(y, iv.end - iv.start, left=iv.start, height=0.25, color="0.75")
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(ranks))])
    ax.set_xlim(0, makespan)
    ax.set_xlabel(time_label)
    handles = [
        Patch(facecolor="0.6", alpha=0.45, edgecolor="black", label="forward (mb.seg)"),
        Patch(facecolor="0.3", edgecolor="black", label="backward (mb.seg)"),
    ]
    if any(iv.action.is_weight for intervals in timeline.compute for iv in intervals):
        handles[1] = Patch(facecolor="0.3", edgecolor="black", label="input gradients B")
        handles.append(Patch(facecolor="0.3", edgecolor="black", hatch="////",
                             label="weight gradients W"))
    ax.legend(
        handles=handles,
        loc="upper center", bbox_to_anchor=(0.5, -0.18 if ranks > 2 else -0.3),
        ncol=len(handles), fontsize=8, frameon=False,
    )
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def chrome_trace(timeline: Timeline, time_unit_us: float = 1.0) -> dict:
    """Trace events (load in https://ui.perfetto.dev or chrome://tracing)."""
    events = []
    for rank, intervals in enumerate(timeline.compute):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        for iv in intervals:
            a = iv.action
            events.append({
                "name": str(a), "cat": _CATEGORY[a.kind], "ph": "X",
                "pid": 0, "tid": rank, "ts": iv.start * time_unit_us,
                "dur": (iv.end - iv.start) * time_unit_us,
                "args": {"microbatch": a.microbatch, "segment": a.segment, "chunk": a.chunk},
            })
        for iv in timeline.waits[rank] if timeline.waits else []:
            events.append({
                "name": "p2p wait", "cat": "p2p", "ph": "X", "pid": 0, "tid": rank,
                "ts": iv.start * time_unit_us, "dur": (iv.end - iv.start) * time_unit_us,
                "args": {"step": iv.step},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(timeline: Timeline, path: str | Path, time_unit_us: float = 1.0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timeline, time_unit_us)))
    return path
