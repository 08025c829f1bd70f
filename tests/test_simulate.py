"""Simulator formulas, attention-aware costs, pictures and the command line."""

import json
from types import SimpleNamespace

import pytest

from megatron_seq1f1b import split_sequence
from megatron_seq1f1b.schedules.partition import CostModel
from megatron_seq1f1b.schedules.schedule import build_schedule
from megatron_seq1f1b.schedules.simulate import bubble_formula, main, segment_cost, simulate


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_equal_costs_give_the_textbook_bubble_and_peak(p, m, k):
    result = simulate(build_schedule(p, m, k))
    assert result.bubble_fraction == pytest.approx(bubble_formula(p, m, k), abs=1e-12)
    assert result.peak_inflight == [min(p - r + k - 1, m * k) for r in range(p)]
    assert result.makespan == pytest.approx(3 * (k * m + p - 1))


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
def test_one_split_gives_megatron_1f1b_numbers(p, m):
    result = simulate(build_schedule(p, m, 1))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.peak_inflight[0] == min(p, m)


def test_paper_example_p8_m16_k4():
    assert simulate(build_schedule(8, 16, 4)).bubble_fraction == pytest.approx(0.099, abs=5e-4)
    assert simulate(build_schedule(8, 16, 1)).bubble_fraction == pytest.approx(0.304, abs=5e-4)


def test_balanced_partition_beats_uniform_on_long_sequences():
    config = SimpleNamespace(hidden_size=4096, num_attention_heads=32, kv_channels=128,
                             num_query_groups=32, ffn_hidden_size=16384, gated_linear_unit=False,
                             num_layers=32)
    model = CostModel.from_config(config, 50257)
    schedule = build_schedule(8, 16, 4)
    bubbles = {}
    for method in ("uniform", "balanced"):
        lengths = split_sequence(32768, 4, method, config=config, vocab_size=50257)
        bubbles[method] = simulate(schedule, segment_cost(lengths, model)).bubble_fraction
    assert bubbles["balanced"] < 0.11
    assert bubbles["uniform"] > 0.2 > bubbles["balanced"]


def test_timeline_holds_every_action_once():
    schedule = build_schedule(3, 4, 2)
    result = simulate(schedule)
    for rank, intervals in enumerate(result.timeline.compute):
        assert [iv.action for iv in intervals] == schedule[rank]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(intervals, intervals[1:]))


def test_png_and_chrome_trace(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_seq1f1b.schedules import draw

    result = simulate(build_schedule(4, 4, 4))
    png = draw.draw_png(result.timeline, tmp_path / "t.png", title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(draw.write_chrome_trace(result.timeline, tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "p2p"]
    assert len(spans) == 4 * 4 * 4 * 2
    assert {e["tid"] for e in spans} == {0, 1, 2, 3}


def test_command_line_prints_comparison(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["--pp", "4", "--microbatches", "4", "--splits", "1", "4",
                 "--png", str(tmp_path / "s.png"), "--trace", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "1F1B" in out and "42.9%" in out and "Seq1F1B k=4" in out and "15.8%" in out
    assert (tmp_path / "s_k1.png").exists() and (tmp_path / "s_k4.json").exists()


def test_cli_compares_zero_bubble_schedules(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from megatron_seq1f1b.schedules import simulate as sim

    assert sim.main(["--pp", "8", "--microbatches", "16", "--splits", "1", "4",
                     "--schedules", "1f1b", "zb-h1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()
            if line.startswith(("1F1B", "ZB-H1", "Seq1F1B"))}
    assert rows["Seq1F1B k=4"][-4] == "9.9%" and rows["Seq1F1B ZB-H1 k=4"][-4] == "3.5%"
    assert rows["ZB-H1"][-4] == "12.7%"
    # pictures of a small pipeline (drawing pp 8's takes 20 s): one per candidate
    assert sim.main(["--pp", "2", "--microbatches", "2", "--splits", "1", "2",
                     "--schedules", "1f1b", "zb-h1", "--png", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s_k2_zb-h1.png").stat().st_size > 0


def test_cli_times_zero_bubble_as_the_executor_places_and_runs_it(capsys):
    """With attention costs a zero-bubble schedule is built and its receives placed for them,
    and timed as the executor's NCCL transport runs it (the default): zb-h1 then idles less
    than Seq1F1B's 1F1B, where built for unit costs or timed as a rendezvous it idled more
    (18.3 % and 25.7 % against 9.9 %). Unit costs time alike under every timing."""
    from megatron_seq1f1b.schedules import simulate as sim
    from megatron_seq1f1b.schedules.replay import TIMINGS

    def rows(*flags):
        assert sim.main(["--pp", "8", "--microbatches", "16", "--splits", "4",
                         "--schedules", "1f1b", "zb-h1", *flags]) == 0
        out = capsys.readouterr().out
        return {line[:26].strip(): line.split()[-4] for line in out.splitlines()
                if line.startswith("Seq1F1B")}

    attention = ("--cost", "attention")
    assert rows(*attention) == {"Seq1F1B k=4": "9.9%", "Seq1F1B ZB-H1 k=4": "7.6%"}
    assert rows(*attention, "--timing", "rendezvous") == {"Seq1F1B k=4": "9.9%",
                                                          "Seq1F1B ZB-H1 k=4": "25.7%"}
    for timing in TIMINGS:
        assert rows("--timing", timing) == {"Seq1F1B k=4": "9.9%", "Seq1F1B ZB-H1 k=4": "3.5%"}
    # the function: the same placement and timing give the command line's number
    config = SimpleNamespace(hidden_size=4096, num_attention_heads=32, kv_channels=None,
                             num_query_groups=None, ffn_hidden_size=4 * 4096,
                             gated_linear_unit=False, num_layers=32)
    model = CostModel.from_config(config, 50257)
    lengths = split_sequence(32768, 4, "balanced", config=config, vocab_size=50257)
    cost = segment_cost(lengths, model, split_backward=True)
    costs = sim.unit_costs(cost, 4)
    placed = build_schedule(8, 16, 4, schedule="zb-h1", costs=costs)
    assert f"{simulate(placed, cost, costs=costs, timing='nccl').bubble_fraction:.1%}" == "7.6%"
    assert simulate(placed, cost, costs=costs).bubble_fraction > 0.2  # rendezvous: the default


def test_cli_peak_weighs_uneven_segments_by_their_tokens(capsys):
    """A balanced cut's early segments are longer: the peak in micro-batches of a stage is
    tokens held / sequence length (the planner's measure), not units / k (2.75 here, where the
    tokens give 2.93); with uniform costs (equal segments) both are the same."""
    from megatron_seq1f1b.schedules import simulate as sim

    def peak(*flags):
        assert sim.main(["--pp", "8", "--microbatches", "16", "--splits", "4", *flags]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Seq1F1B"))
        return float(line.split()[-1])

    config = SimpleNamespace(hidden_size=4096, num_attention_heads=32, kv_channels=None,
                             num_query_groups=None, ffn_hidden_size=4 * 4096,
                             gated_linear_unit=False, num_layers=32)
    lengths = split_sequence(32768, 4, "balanced", config=config, vocab_size=50257)
    held = sim.peak_tokens(build_schedule(8, 16, 4), [lengths] * 16)[0] / 32768
    assert peak("--cost", "attention", "--partition", "balanced") == pytest.approx(held, abs=5e-3)
    assert held == pytest.approx(2.93, abs=5e-3) and peak() == 2.75


def test_lengths_compare_megatron_and_seq1f1b_on_given_micro_batches(capsys):
    """--lengths: one micro-batch per length, Megatron's 1F1B (k=1), a fixed k and a token
    budget, each cut as the executor cuts them; uneven lengths favour Seq1F1B."""
    from megatron_seq1f1b.schedules import simulate as sim

    assert sim.main(["--pp", "2", "--cost", "attention", "--lengths", "512", "4096", "256",
                     "1024", "--splits", "1", "4", "--segment-tokens", "1024",
                     "--hidden-size", "256", "--num-layers", "4",
                     "--num-attention-heads", "4"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()
            if line.startswith(("1F1B", "Seq1F1B"))}
    assert set(rows) == {"1F1B", "Seq1F1B k=4", "Seq1F1B 1024 tokens/segment"}
    assert " 1.00x" in rows["1F1B"]
    speed = float(rows["Seq1F1B 1024 tokens/segment"].split("x")[0].split()[-1])
    assert speed > 1.1
    with pytest.raises(SystemExit):
        sim.main(["--lengths", "512", "1024"])  # uniform costs have no tokens
    assert "add --cost attention" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no timeline is drawn: said, not ignored
        sim.main(["--cost", "attention", "--lengths", "512", "1024", "--png", "t.png"])
    assert "draws no timeline: drop --png / --trace" in capsys.readouterr().err
