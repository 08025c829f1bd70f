"""Pictures of timelines: a PNG like the Seq1F1B paper's figures, and a Chrome trace.

Both take a :class:`~megatron_seq1f1b.schedules.replay.Timeline`, whether simulated or
measured in a real run, so simulated and measured schedules look alike.
Timelines meant to be compared share one time axis: stacked in one picture
(:func:`draw_timelines`) or in several pictures given the same ``x_max``.
One row per rank; colour per micro-batch; forwards light with a dark label,
backwards dark with a white label, weight-gradient work (``W``, zero-bubble
schedules) dark and hatched; the label is ``micro-batch.segment``
(``c<chunk>`` appended for model chunks > 0); p2p waits, when shown, are thin
grey bars. The legend names every kind of box drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from megatron_seq1f1b.schedules.replay import Interval, Timeline
from megatron_seq1f1b.schedules.schedule import Action


_CATEGORY = {"F": "forward", "B": "backward", "W": "weight-gradient"}


def _label(action) -> str:
    text = f"{action.microbatch}.{action.segment}"
    return f"{text}c{action.chunk}" if action.chunk else text


# The box kinds a picture can hold, as the legend names them (in legend order).
FORWARD_LABEL = "forward (mb.seg)"
BACKWARD_LABEL = "backward (mb.seg)"
INPUT_GRADIENT_LABEL = "input gradients B"  # a backward split from its W (zero bubble)
WEIGHT_GRADIENT_LABEL = "weight gradients W"
WAIT_LABEL = "p2p wait"
_FORWARD_ALPHA = 0.45
_WAIT_COLOUR = "0.75"
_HATCH = "////"


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "drawing needs matplotlib: pip install 'megatron-seq1f1b[plot]'"
        ) from exc
    return matplotlib, Figure, Patch


def shared_time_axis(timelines: Sequence[Timeline]) -> float:
    """The end of a time axis that holds all of `timelines`: the longest makespan."""
    return max((t.makespan for t in timelines), default=0.0) or 1.0


def box_kinds(timeline: Timeline, show_waits: bool = False) -> list[str]:
    """Legend labels of the kinds of boxes a picture of `timeline` holds, in legend order."""
    kinds = {iv.action.kind for rank in timeline.compute for iv in rank}
    labels = []
    if "F" in kinds:
        labels.append(FORWARD_LABEL)
    if "B" in kinds:
        labels.append(INPUT_GRADIENT_LABEL if "W" in kinds else BACKWARD_LABEL)
    if "W" in kinds:
        labels.append(WEIGHT_GRADIENT_LABEL)
    if show_waits and any(rank for rank in timeline.waits or []):
        labels.append(WAIT_LABEL)
    return labels


def _draw_panel(ax, timeline: Timeline, x_max: float, width: float, show_waits: bool) -> None:
    """One timeline into `ax`: a row per rank; each box's gid is its legend label."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    ranks = len(timeline.compute)
    labels = box_kinds(timeline)
    backward_label = INPUT_GRADIENT_LABEL if INPUT_GRADIENT_LABEL in labels else BACKWARD_LABEL
    for rank, intervals in enumerate(timeline.compute):
        y = ranks - 1 - rank
        for iv in intervals:
            action = iv.action
            forward = action.is_forward
            span = iv.end - iv.start
            label = (FORWARD_LABEL if forward else
                     WEIGHT_GRADIENT_LABEL if action.is_weight else backward_label)
            ax.barh(
                y, span, left=iv.start, height=0.8,
                color=cmap(action.microbatch % 10), alpha=_FORWARD_ALPHA if forward else 1.0,
                edgecolor="black", linewidth=0.5, hatch=_HATCH if action.is_weight else None,
                gid=label,
            )
            if span / x_max * width * 72 > 14:  # enough room (points) for a label
                ax.text(
                    iv.start + span / 2, y, _label(action), ha="center", va="center",
                    fontsize=7, color="black" if forward else "white", clip_on=True,
                )
        if show_waits and timeline.waits:
            for iv in timeline.waits[rank]:
                ax.barh(y, iv.end - iv.start, left=iv.start, height=0.25, color=_WAIT_COLOUR,
                        gid=WAIT_LABEL)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(ranks))])


def _legend_handles(labels: Sequence[str], Patch) -> list:
    style = {
        FORWARD_LABEL: dict(facecolor="0.6", alpha=_FORWARD_ALPHA, edgecolor="black"),
        BACKWARD_LABEL: dict(facecolor="0.3", edgecolor="black"),
        INPUT_GRADIENT_LABEL: dict(facecolor="0.3", edgecolor="black"),
        WEIGHT_GRADIENT_LABEL: dict(facecolor="0.3", edgecolor="black", hatch=_HATCH),
        WAIT_LABEL: dict(facecolor=_WAIT_COLOUR),
    }
    return [Patch(label=label, **style[label]) for label in labels]


def timeline_figure(
    timelines: Sequence[Timeline],
    titles: Sequence[str] = (),
    *,
    time_label: str = "time",
    show_waits: bool = False,
    x_max: float | None = None,
):
    """A matplotlib Figure with one panel per timeline, stacked on one shared time axis.

    The axis runs from 0 to `x_max` (default: the longest makespan), so schedules drawn
    together, or in several figures given the same `x_max`, compare by length. One legend
    lists every kind of box drawn in any panel (forward, backward or B, W, p2p wait).
    """
    _, Figure, Patch = _matplotlib()
    timelines = list(timelines)
    if not timelines:
        raise ValueError("no timeline to draw")
    titles = list(titles) + [""] * (len(timelines) - len(titles))
    x_max = x_max if x_max is not None else shared_time_axis(timelines)
    if x_max <= 0:
        raise ValueError(f"x_max must be positive, not {x_max}")
    # Wide enough that the most crowded panel (boxes per rank per unit of axis) keeps labels.
    crowd = max(sum(len(r) for r in t.compute) / max(len(t.compute), 1)
                * x_max / (t.makespan or x_max) for t in timelines)
    width = min(max(8.0, crowd * 0.45), 28.0)
    rows = [max(len(t.compute), 1) for t in timelines]
    legend_in, label_in = 0.3, 0.45  # the legend's strip and the time axis' label, inches
    panels_in = sum(0.6 * r + (0.4 if title else 0.15) for r, title in zip(rows, titles))
    height = panels_in + label_in + legend_in + 0.2
    fig = Figure(figsize=(width, height))
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": rows})[:, 0]
    labels: list[str] = []
    for ax, timeline, title in zip(axes, timelines, titles):
        _draw_panel(ax, timeline, x_max, width, show_waits)
        labels += [k for k in box_kinds(timeline, show_waits) if k not in labels]
        if title:
            ax.set_title(title, fontsize=10)
    order = [FORWARD_LABEL, BACKWARD_LABEL, INPUT_GRADIENT_LABEL, WEIGHT_GRADIENT_LABEL,
             WAIT_LABEL]
    labels.sort(key=order.index)
    axes[0].set_xlim(0, x_max)
    axes[-1].set_xlabel(time_label)
    fig.legend(handles=_legend_handles(labels, Patch), loc="lower center",
               bbox_to_anchor=(0.5, 0.0), ncol=max(len(labels), 1), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))
    return fig


def draw_timelines(
    timelines: Sequence[Timeline],
    path: str | Path,
    titles: Sequence[str] = (),
    *,
    time_label: str = "time",
    show_waits: bool = False,
    x_max: float | None = None,
) -> Path:
    """Draw `timelines` stacked on one time axis into a PNG file (see :func:`timeline_figure`);
    the path written: '.png' added where `path` has no suffix (as matplotlib does)."""
    path = Path(path)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = timeline_figure(timelines, titles, time_label=time_label, show_waits=show_waits,
                          x_max=x_max)
    fig.savefig(path, dpi=110)
    return path


def draw_png(
    timeline: Timeline,
    path: str | Path,
    title: str = "",
    *,
    time_label: str = "time",
    show_waits: bool = False,
    x_max: float | None = None,
) -> Path:
    """Draw `timeline` into a PNG file (needs matplotlib: pip install matplotlib).

    Give pictures meant to be compared the same `x_max` (e.g. :func:`shared_time_axis`
    of all their timelines); by default the axis ends at this timeline's makespan.
    """
    return draw_timelines([timeline], path, [title], time_label=time_label,
                          show_waits=show_waits, x_max=x_max)


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
                "args": {"microbatch": a.microbatch, "segment": a.segment, "chunk": a.chunk,
                         "step": iv.step},
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


def read_chrome_trace(trace: str | Path | dict, time_unit_us: float = 1.0) -> Timeline:
    """The Timeline a :func:`write_chrome_trace` file holds (e.g. to redraw several runs'
    measured timelines on one time axis); `time_unit_us` as it was written with."""
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    events = trace["traceEvents"]
    ranks = 1 + max((e["tid"] for e in events), default=-1)
    timeline = Timeline([[] for _ in range(ranks)], [[] for _ in range(ranks)])
    for e in events:
        if e["ph"] != "X":
            continue
        start = e["ts"] / time_unit_us
        end = (e["ts"] + e["dur"]) / time_unit_us
        step = e.get("args", {}).get("step", -1)
        if e["cat"] == "p2p":
            timeline.waits[e["tid"]].append(Interval(e["tid"], start, end, None, step))
        else:
            action = Action.parse(e["name"])
            timeline.compute[e["tid"]].append(Interval(e["tid"], start, end, action, step))
    for intervals in timeline.compute + timeline.waits:
        intervals.sort(key=lambda iv: iv.start)
    return timeline
