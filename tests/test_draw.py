"""Timeline pictures: schedules meant to be compared share one time axis, and the legend names
every kind of box drawn. Inspects matplotlib's figure objects (no display needed)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_seq1f1b.schedules.replay import Interval, Timeline
from megatron_seq1f1b.schedules.schedule import build_schedule
from megatron_seq1f1b.schedules.simulate import simulate

pytest.importorskip("matplotlib")

from megatron_seq1f1b.schedules import draw  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _legend_labels(fig) -> list[str]:
    (legend,) = fig.legends
    return [text.get_text() for text in legend.get_texts()]


def _box_kinds_drawn(fig) -> set[str]:
    """The kinds of the boxes in every panel (each box's gid is its legend label)."""
    return {patch.get_gid() for ax in fig.axes for patch in ax.patches}


def _timelines():
    return {
        "1F1B": simulate(build_schedule(4, 4, 1)).timeline,
        "Seq1F1B k=4": simulate(build_schedule(4, 4, 4)).timeline.scaled(0.25),
        "ZB-H1 k=2": simulate(build_schedule(4, 4, 2, schedule="zb-h1")).timeline.scaled(0.5),
    }


def test_stacked_timelines_share_one_time_axis():
    timelines = _timelines()
    fig = draw.timeline_figure(list(timelines.values()), list(timelines))
    assert len(fig.axes) == 3
    longest = max(t.makespan for t in timelines.values())
    assert {ax.get_xlim() for ax in fig.axes} == {(0.0, longest)}
    # shared: zooming one panel moves them all
    fig.axes[0].set_xlim(1.0, 2.0)
    assert {ax.get_xlim() for ax in fig.axes} == {(1.0, 2.0)}
    assert [ax.get_title() for ax in fig.axes] == list(timelines)


def test_separate_pictures_on_one_axis():
    timelines = list(_timelines().values())
    x_max = draw.shared_time_axis(timelines)
    limits = {draw.timeline_figure([t], x_max=x_max).axes[0].get_xlim() for t in timelines}
    assert limits == {(0.0, x_max)}
    # without x_max, each picture ends at its own makespan
    assert draw.timeline_figure([timelines[1]]).axes[0].get_xlim() == (0.0, 14.25)


@pytest.mark.parametrize("names, show_waits, expected", [
    (["1F1B"], False, {draw.FORWARD_LABEL, draw.BACKWARD_LABEL}),
    (["1F1B"], True, {draw.FORWARD_LABEL, draw.BACKWARD_LABEL, draw.WAIT_LABEL}),
    (["ZB-H1 k=2"], True, {draw.FORWARD_LABEL, draw.INPUT_GRADIENT_LABEL,
                           draw.WEIGHT_GRADIENT_LABEL, draw.WAIT_LABEL}),
    (["1F1B", "Seq1F1B k=4", "ZB-H1 k=2"], True, {
        draw.FORWARD_LABEL, draw.BACKWARD_LABEL, draw.INPUT_GRADIENT_LABEL,
        draw.WEIGHT_GRADIENT_LABEL, draw.WAIT_LABEL}),
])
def test_legend_names_every_kind_of_box_drawn(names, show_waits, expected):
    timelines = _timelines()
    fig = draw.timeline_figure([timelines[n] for n in names], names, show_waits=show_waits)
    labels = _legend_labels(fig)
    assert len(labels) == len(set(labels))
    assert set(labels) == _box_kinds_drawn(fig) == expected


def test_no_wait_in_the_legend_when_none_was_recorded():
    """A measured Megatron timeline has no waits: nothing grey drawn, none in the legend."""
    timeline = _timelines()["1F1B"]
    bare = Timeline(timeline.compute, [[] for _ in timeline.compute])
    fig = draw.timeline_figure([bare], show_waits=True)
    assert draw.WAIT_LABEL not in _legend_labels(fig)
    assert draw.WAIT_LABEL not in _box_kinds_drawn(fig)


def test_pictures_are_written(tmp_path):
    timelines = list(_timelines().values())
    one = draw.draw_png(timelines[0], tmp_path / "one.png", "one", x_max=30.0)
    many = draw.draw_timelines(timelines, tmp_path / "sub" / "many.png", ["a", "b", "c"],
                               show_waits=True)
    for path in (one, many):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        draw.timeline_figure([])


def test_chrome_trace_reads_back(tmp_path):
    timeline = _timelines()["ZB-H1 k=2"]
    path = draw.write_chrome_trace(timeline, tmp_path / "t.json", time_unit_us=1e6)
    back = draw.read_chrome_trace(path, time_unit_us=1e6)
    for mine, theirs in ((timeline.compute, back.compute), (timeline.waits, back.waits)):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            assert [(i.rank, i.action, i.step) for i in a] == [(i.rank, i.action, i.step) for i in b]
            times = [t for i in a for t in (i.start, i.end)]
            assert times == pytest.approx([t for i in b for t in (i.start, i.end)])


def test_simulate_cli_draws_every_k_on_one_axis(tmp_path, monkeypatch):
    """Units of one micro-batch's forward per stage, so k=1 and k=4 compare by length."""
    from megatron_seq1f1b.schedules.simulate import main

    drawn = []
    monkeypatch.setattr(draw, "draw_png", lambda timeline, path, **kw: drawn.append(
        (timeline.makespan, kw["x_max"])))
    assert main(["--pp", "4", "--microbatches", "4", "--splits", "1", "4",
                 "--png", str(tmp_path / "s.png")]) == 0
    # 1F1B: (m + p - 1) * 3 forwards; Seq1F1B k=4: (k*m + p - 1) * 3 / k
    assert drawn == [(21.0, 21.0), (14.25, 21.0)]
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def _trace_run(tmp_path, name, backend, timeline, tokens_per_s, peak0):
    from megatron_seq1f1b.runtime.trace import timeline_stats

    trace = draw.write_chrome_trace(timeline, tmp_path / name / "timeline.json", time_unit_us=1e6)
    stats = timeline_stats(timeline)
    stats.update(png=str(tmp_path / name / "timeline.png"), trace=str(trace))
    summary = {"schedule": "Megatron-Core 1F1B" if name.startswith("1f1b") else "Seq1F1B k=4",
               "attention_backend": backend, "final_lm_loss": 5.0, "mean_ms_per_iter": 100.0,
               "tokens_per_s": tokens_per_s, "peak_gib_per_stage": [peak0, 0.1],
               "losses": [6.0, 5.0], "timeline": stats}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"summary": summary}))
    return str(path)


def test_demo_summary_compares_both_attention_backends(tmp_path, capsys, monkeypatch):
    """compare_runs (the demo's summary): one column per attention backend, the speed-up split
    into the bubble's part and busy time's, and all measured timelines on one axis."""
    spec = importlib.util.spec_from_file_location("compare_runs",
                                                  ROOT / "scripts" / "compare_runs.py")
    compare_runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare_runs)
    ours = Timeline([[Interval(r, 0.1 * r, 0.1 * r + 0.3, iv.action, iv.step)
                      for iv in rank[:1]] for r, rank in enumerate(_timelines()["1F1B"].compute)],
                    [[Interval(r, 0.0, 0.1 * r, None, 0)] for r in range(4)])
    theirs = _timelines()["1F1B"].scaled(0.1)
    paths = [_trace_run(tmp_path, "1f1b", "local", theirs, 100.0, 0.4),
             _trace_run(tmp_path, "seq1f1b", "local", ours, 150.0, 0.2),
             _trace_run(tmp_path, "1f1b-flash", "flash", theirs, 200.0, 0.3),
             _trace_run(tmp_path, "seq1f1b-flash", "flash", ours, 220.0, 0.15)]
    picture = tmp_path / "timelines.png"
    original, axes = draw.draw_png, []
    monkeypatch.setattr(draw, "draw_png", lambda *a, **kw: axes.append(kw["x_max"])
                        or original(*a, **kw))
    assert compare_runs.main(paths + ["--timelines", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "unfused attention" in out and "flash attention" in out
    assert "1.50x" in out and "1.10x" in out  # tokens/s per backend
    assert "0.50x" in out  # stage-0 memory
    base, run = (json.loads(Path(p).read_text())["summary"] for p in paths[:2])
    (bubble, busy), spread = compare_runs.split_speedup(base, run)
    assert spread == [(bubble, busy)]  # these logs hold one timed iteration
    assert bubble * busy == pytest.approx(
        base["timeline"]["makespan_s"] / run["timeline"]["makespan_s"])
    assert f"{bubble:.2f}x" in out and f"{busy:.2f}x" in out
    assert "schedule's" in out and "masked scores" in out
    assert picture.read_bytes()[:4] == b"\x89PNG"
    assert axes == [pytest.approx(theirs.makespan)] * 4  # every run's picture on one axis
    assert all((tmp_path / name / "timeline.png").exists()
               for name in ("1f1b", "seq1f1b", "1f1b-flash", "seq1f1b-flash"))


def test_demo_split_is_from_medians_with_the_spread(capsys):
    """One slow iteration (a busy time of 30 against 11) moves neither part: medians, with
    every iteration's parts as the printed range."""
    spec = importlib.util.spec_from_file_location("compare_runs",
                                                  ROOT / "scripts" / "compare_runs.py")
    compare_runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare_runs)

    def summary(name, bubbles, busy):
        return {"schedule": name, "attention_backend": "flash", "final_lm_loss": 5.0,
                "mean_ms_per_iter": 1.0, "tokens_per_s": 1.0, "peak_gib_per_stage": [1.0],
                "losses": [5.0], "timelines": [{"bubble_fraction": b, "busy_s": [s / 2] * 2}
                                               for b, s in zip(bubbles, busy)]}

    base = summary("Megatron-Core 1F1B", [0.3, 0.3, 0.3], [10, 10, 10])
    run = summary("Seq1F1B k=4", [0.15, 0.2, 0.15], [11, 30, 11])
    (bubble, busy), spread = compare_runs.split_speedup(base, run)
    assert bubble == pytest.approx(0.85 / 0.7) and busy == pytest.approx(10 / 11)
    assert [s[1] for s in spread] == pytest.approx([10 / 11, 10 / 30, 10 / 11])
    compare_runs.compare([base, run])
    out = capsys.readouterr().out
    assert "bubble part (median of 3 it.)" in out and "0.91x (0.33-0.91)" in out
    assert "30.0% -> 15.0%" in out  # the measured bubble: medians too


def test_benchmark_pictures_share_one_axis(tmp_path, monkeypatch):
    """scripts/benchmark.py's measured and simulated pictures: each set on one axis, stacked."""
    from megatron_seq1f1b.bench import pictures

    timelines = _timelines()
    schedules = [SimpleNamespace(key=f"s{i}", label=name, megatron=False,
                                 timeline={"makespan_s": t.makespan, "bubble_fraction": 0.1},
                                 prediction={"makespan_s": t.makespan, "bubble_fraction": 0.1})
                 for i, (name, t) in enumerate(timelines.items())]
    by_key = {s.key: timelines[s.label] for s in schedules}
    args = SimpleNamespace(pp=4, microbatches=4)
    original, axes = draw.draw_png, []
    monkeypatch.setattr(draw, "draw_png", lambda *a, **kw: axes.append(kw["x_max"])
                        or original(*a, **kw))
    pictures.draw_measured_timelines(schedules, by_key, args, tmp_path)
    pictures.draw_simulated_timelines(schedules, by_key, args, "test", tmp_path)
    assert axes == [draw.shared_time_axis(list(timelines.values()))] * 6
    for name in ("timelines_measured.png", "timelines_simulated.png", "timeline_s2_measured.png",
                 "timeline_s0_simulated.png", "timeline_s1_measured.json"):
        assert (tmp_path / name).stat().st_size > 0, name
