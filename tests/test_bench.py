"""The pure parts of megatron_seq1f1b.bench: fits, cost functions, replay with shared cores."""

import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_seq1f1b.bench.fit import fitted_cost, message_latency, virtual_fits
from megatron_seq1f1b.bench.predict import matching_mode, predict, shared_cores_per_pipeline
from megatron_seq1f1b.bench.sharing import pipeline_replay
from megatron_seq1f1b.bench.summary import summarize
from megatron_seq1f1b.planner.fit import (
    QUADRATIC, best_quadratic, extrapolated_fits, fit_costs, fit_p2p, nonneg_lstsq, quadratic_for,
)
from megatron_seq1f1b.schedules.schedule import B, F, W, build_schedule
from megatron_seq1f1b.schedules.simulate import simulate, uniform_cost

ROOT = Path(__file__).resolve().parents[1]


def test_nonneg_lstsq_recovers_exact_coefficients():
    xs = [1.0, 2.0, 3.0, 5.0]
    coef = nonneg_lstsq([[x, 1.0] for x in xs], [2 * x + 3 for x in xs])
    assert coef == pytest.approx([2.0, 3.0])


def test_nonneg_lstsq_drops_a_negative_coefficient():
    # y = 10 - x: the unconstrained slope is negative; the best non-negative fit is the mean.
    xs = [0.0, 1.0, 2.0, 3.0, 4.0]
    coef = nonneg_lstsq([[x, 1.0] for x in xs], [10 - x for x in xs])
    assert coef == pytest.approx([0.0, 8.0])
    assert all(c >= 0 for c in coef)


def _samples(quadratic, a, c, d, cases):
    """Calibration rows [length, end, forward_s, backward_s] from a known cost law."""
    rows = []
    for lengths in cases:
        end = 0
        for length in lengths:
            end += length
            t = a * length + c * QUADRATIC[quadratic](length, end) + d
            rows.append([length, end, t, 2 * t])
    return rows


CASES = [[1024], [512, 512], [256, 256, 256, 256], [384, 256, 224, 160]]


@pytest.mark.parametrize("quadratic", sorted(QUADRATIC))
def test_fit_costs_recovers_the_law_and_best_quadratic_picks_it(quadratic):
    rows = _samples(quadratic, a=2e-6, c=3e-9, d=1e-3, cases=CASES)
    fits = fit_costs({(0, 0): rows, (1, 0): rows}, quadratic)
    forward, backward = fits[(0, 0)]["F"], fits[(0, 0)]["B"]
    assert (forward["a"], forward["c"], forward["d"]) == pytest.approx((2e-6, 3e-9, 1e-3))
    assert (backward["a"], backward["c"], backward["d"]) == pytest.approx((4e-6, 6e-9, 2e-3))
    assert forward["mean_rel_err"] < 1e-9 and forward["max_rel_err"] < 1e-9
    chosen, errors = best_quadratic({"plain": {(0, 0): rows}})
    assert chosen == quadratic and set(errors) == set(QUADRATIC)
    # Megatron's local attention computes the whole score rectangle: that shape, even where
    # the other fits better; other kernels: the better fit.
    assert quadratic_for({"plain": {(0, 0): rows}}, dense_attention=True) == ("rectangle",
                                                                              errors)
    assert quadratic_for({"plain": {(0, 0): rows}}, dense_attention=False)[0] == quadratic
    from megatron_seq1f1b.planner import Calibration

    samples = {(0, 0): rows, (1, 0): rows}
    assert Calibration.from_samples(samples).quadratic == quadratic
    assert Calibration.from_samples(samples, dense_attention=True).quadratic == "rectangle"


def test_fit_p2p_and_message_latency():
    fit = fit_p2p([[1000.0, 1e-3 + 1000 * 1e-9], [3000.0, 1e-3 + 3000 * 1e-9]])
    assert (fit["alpha"], fit["beta"]) == pytest.approx((1e-3, 1e-9))
    config = SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=True,
                             pipeline_dtype=torch.float32, hidden_size=8)
    # segments of 4 and 2 tokens, halved by sequence parallelism: 2*8*4 and 1*8*4 bytes
    latency = message_latency(fit, [4, 2], 1, config)
    assert latency == pytest.approx(1e-3 + 1e-9 * (64 + 32) / 2)


def _fit(a, d):
    return {"a": a, "c": 0.0, "d": d}


def test_fitted_cost_virtual_stages_and_recompute():
    # p=2, v=2: virtual stage = chunk * p + rank
    per_stage = {(rank, chunk): {"F": _fit(1.0 + rank + 10 * chunk, 0.0), "B": _fit(2.0, 0.5)}
                 for rank in range(2) for chunk in range(2)}
    ordered = virtual_fits(per_stage, 2, 2)
    assert [f["F"]["a"] for f in ordered] == [1.0, 2.0, 11.0, 12.0]
    cost = fitted_cost(ordered, [3, 1], 2, "rectangle")
    assert cost(F(0, 0, 1), 1) == 12.0 * 3
    assert cost(B(0, 1, 0), 0) == 2.0 * 1 + 0.5
    with_recompute = fitted_cost(ordered, [3, 1], 2, "rectangle", recompute=True)
    assert with_recompute(B(0, 1, 0), 0) == 2.0 * 1 + 0.5 + 1.0 * 1


def test_weight_gradients_timed_apart_get_their_own_fit():
    """Rows with a fifth column (W timed apart, zero-bubble deferral) fit W; zero-bubble
    costs then split the backward by it instead of halving it."""
    rows = [r + [0.25 * r[3], 0.8 * r[3]] for r in _samples("causal_pairs", a=2e-6, c=3e-9,
                                                             d=1e-3, cases=CASES)]
    fits = fit_costs({(0, 0): rows}, "causal_pairs")
    weight = fits[(0, 0)]["W"]
    assert (weight["a"], weight["c"], weight["d"]) == pytest.approx((1e-6, 1.5e-9, 5e-4))
    whole = fitted_cost([fits[(0, 0)]], [512, 512], 1, "causal_pairs")(B(0, 1), 0)
    cost = fitted_cost([fits[(0, 0)]], [512, 512], 1, "causal_pairs", split_backward=True)
    # deferring W costs extra: B (W deferred) + W = 1.05 of the whole backward
    assert cost(W(0, 1), 0) == pytest.approx(0.25 * whole)
    assert cost(B(0, 1), 0) == pytest.approx(0.8 * whole)
    without_b = {(0, 0): [r[:5] for r in rows]}
    cost = fitted_cost([fit_costs(without_b, "causal_pairs")[(0, 0)]], [512, 512], 1,
                       "causal_pairs", split_backward=True)
    assert cost(B(0, 1), 0) == pytest.approx(0.75 * whole)  # whole less W
    assert "W" not in fit_costs({(0, 0): [r[:4] for r in rows]}, "causal_pairs")[(0, 0)]


def test_extrapolated_fits_keep_first_and_last():
    ordered = ["first", "middle", "last"]
    assert extrapolated_fits(ordered, 3) == ordered
    assert extrapolated_fits(ordered, 5) == ["first", "middle", "middle", "middle", "last"]
    assert extrapolated_fits(["first", "last"], 4) == ["first", "first", "first", "last"]
    assert extrapolated_fits(ordered, 1) == ["first"]


@pytest.mark.parametrize("shape", [(2, 3, 1, 1), (3, 4, 2, 1), (2, 4, 2, 2)])
def test_pipeline_replay_without_effects_is_simulate(shape):
    schedule = build_schedule(*shape)
    plain, shared = simulate(schedule), pipeline_replay(schedule, uniform_cost())
    assert shared.makespan == pytest.approx(plain.makespan)
    assert shared.bubble_fraction == pytest.approx(plain.bubble_fraction)
    assert shared.busy == pytest.approx(plain.busy)
    assert shared.peak_inflight == plain.peak_inflight
    starts = [[(iv.action, iv.start) for iv in rank] for rank in shared.timeline.compute]
    assert starts == [[(iv.action, pytest.approx(iv.start)) for iv in rank]
                      for rank in plain.timeline.compute]


def test_pipeline_replay_latency_on_a_tiny_schedule():
    # p=2, m=1, k=1: F on rank 0, message, F then B on rank 1, message, B on rank 0.
    result = pipeline_replay(build_schedule(2, 1, 1), uniform_cost(), latency=0.25)
    assert result.makespan == pytest.approx(1 + 0.25 + 1 + 2 + 0.25 + 2)


def test_pipeline_replay_one_shared_core_does_all_work_in_turn():
    schedule = build_schedule(2, 4, 2)
    result = pipeline_replay(schedule, uniform_cost(), cores=1.0)
    work = sum(1.0 if a.is_forward else 2.0 for rank in schedule for a in rank)
    assert result.makespan == pytest.approx(work)
    # overlapping actions run at half speed, so they last longer than in isolation
    isolated = simulate(schedule)
    assert all(shared >= alone for shared, alone in zip(result.busy, isolated.busy))
    assert result.bubble_fraction < isolated.bubble_fraction


def test_predict_uses_simulate_when_every_rank_has_a_core():
    fits = [{"F": _fit(1.0, 0.0), "B": _fit(2.0, 0.0)}] * 2
    result = predict(fits, 2, 4, [1, 1], 1, "rectangle", cores=2.0)
    expected = simulate(build_schedule(2, 4, 2))
    assert result.makespan == pytest.approx(expected.makespan)
    shared = predict(fits, 2, 4, [1, 1], 1, "rectangle", cores=1.0)
    assert shared.makespan > result.makespan


def test_matching_calibration_mode_and_shared_cores():
    assert shared_cores_per_pipeline(4, False, 4, 1, 2) == pytest.approx(2.0)
    assert shared_cores_per_pipeline(2, False, 2, 1, 2) is None
    assert shared_cores_per_pipeline(4, True, 4, 1, 2) is None
    both = ("isolated", "concurrent")
    assert matching_mode(both, 2.0) == "isolated"
    assert matching_mode(both, None) == "concurrent"
    assert matching_mode(("isolated",), None) == "isolated"


def _measured(key, times, peaks, vpp=None):
    return SimpleNamespace(key=key, label=key, megatron=key.startswith("1f1b"), k=1,
                           partition=None, lengths=[8], layout=SimpleNamespace(vpp=vpp),
                           times=times, peaks=[peaks] * len(times), cpu=[[1.0, 1.0]] * len(times),
                           first_loss=1.0, timeline=None, prediction=None, schedule="1f1b",
                           saved_peaks=None, recompute=False)


def test_summarize_ratios_against_megatron():
    rows = summarize([_measured("1f1b", [2.0, 4.0], [100, 50]),
                      _measured("seq1f1b-uniform", [1.0, 4.0], [50, 50])], tokens_per_iter=6)
    base, ours = rows
    assert base["speedup_vs_1f1b"] == 1.0 and base["tokens_per_s"] == 2.0
    assert ours["speedup_vs_1f1b"] == pytest.approx(3.0 / 2.5)
    assert ours["paired_speedup_vs_1f1b"] == pytest.approx(1.5)  # median of 2.0 and 1.0
    assert ours["paired_speedup_vs_1f1b_range"] == [1.0, 2.0]
    assert ours["peak_ratio_vs_1f1b"] == [0.5, 1.0]


def test_fused_backend_row_computing_less_than_megatron_is_flagged():
    """On flash or TE segments cannot compute less than whole micro-batches: a Seq1F1B row
    whose CPU time is below 0.95x Megatron's says the baseline ran slower code."""
    base = _measured("1f1b", [2.0], [100])
    base.timeline = {"bubble_fraction": 0.4, "busy_s": [1.0, 1.4], "makespan_s": 2.0}
    ours = _measured("seq1f1b-uniform", [1.5], [50])
    ours.cpu = [[0.4, 0.4]]  # 0.8 s against Megatron's 2.0 s: 0.40x
    ours.timeline = {"bubble_fraction": 0.2, "busy_s": [1.2, 1.2], "makespan_s": 1.5}
    for backend, flagged in (("flash", True), ("te", True), ("local", False)):
        rows = summarize([base, ours], tokens_per_iter=6, attention_backend=backend)
        assert (rows[1]["fairness"] is not None) == flagged, backend
        assert rows[0]["fairness"] is None
        assert not flagged or "baseline defect" in rows[1]["fairness"]
    bubble, busy = summarize([base, ours], 6, "flash")[1]["parts_vs_1f1b"]
    assert bubble == pytest.approx(0.8 / 0.6) and busy == pytest.approx(1.0)
    ours.cpu = [[1.0, 0.95]]  # 0.975x: within noise, not flagged
    assert summarize([base, ours], 6, "flash")[1]["fairness"] is None


def test_bench_imports_no_megatron():
    code = ("import sys, pkgutil, importlib, megatron_seq1f1b.bench as b\n"
            "for m in pkgutil.iter_modules(b.__path__):\n"
            "    importlib.import_module('megatron_seq1f1b.bench.' + m.name)\n"
            "assert not [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_splits_auto_adds_the_sweep_and_auto_rows():
    from megatron_seq1f1b.bench.cli import parse_args

    args = parse_args(["--splits", "auto", "--sweep-splits", "4", "1", "2", "2",
                       "--min-segment-length", "16"])
    assert args.splits == "auto" and args.min_segment_length == 16
    assert args.schedules == ["1f1b", "seq1f1b-k1", "seq1f1b-k2", "seq1f1b-k4", "seq1f1b-auto"]
    fixed = parse_args(["--splits", "3", "--sweep-splits", "2"])
    assert fixed.splits == 3 and fixed.schedules[-1] == "seq1f1b-k2"
    assert "seq1f1b-auto" not in fixed.schedules and "seq1f1b-balanced" in fixed.schedules
    for bad in (["--splits", "auto", "--no-calibration"], ["--memory-budget", "2"],
                ["--splits", "0"], ["--splits", "many"], ["--sweep-splits", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_confirmation_rounds_decide_against_the_closest_rivals(monkeypatch):
    import math

    from megatron_seq1f1b.bench import runner
    from megatron_seq1f1b.bench.cli import parse_args
    from megatron_seq1f1b.bench.confirm import (
        Race, closest_rivals, confirmation, ratio_interval,
    )
    from megatron_seq1f1b.bench.markdown import confirmation_lines
    from megatron_seq1f1b.bench.summary import auto_vs_sweep

    sweep = [_measured(f"seq1f1b-k{k}", [t, t], [1]) for k, t in ((2, 3.0), (4, 1.0), (8, 1.5))]
    auto = _measured("seq1f1b-auto", [1.2, 1.2], [1])
    assert [s.key for s in closest_rivals([auto, *sweep], 2)] == ["seq1f1b-k4", "seq1f1b-k8"]

    order = []  # mirrored: auto first, then auto last
    monkeypatch.setattr(runner, "say", lambda text: None)
    monkeypatch.setattr(runner, "run_once", lambda s, *a, **kw: order.append(s.key) or
                        {"time": {"seq1f1b-auto": 1.0, "seq1f1b-k4": 0.99,
                                  "seq1f1b-k8": 1.05}[s.key]})
    times = runner.confirm_rounds(auto, sweep[1:], Race(2), [], None, None, None, 8)
    assert order == ["seq1f1b-auto", "seq1f1b-k4", "seq1f1b-k8",
                     "seq1f1b-k8", "seq1f1b-k4", "seq1f1b-auto"]
    assert times == {"seq1f1b-auto": [1.0, 1.0], "seq1f1b-k4": [0.99, 0.99],
                     "seq1f1b-k8": [1.05, 1.05]}

    mean, low, high = ratio_interval([0.9, 1.1])
    assert mean == pytest.approx(math.sqrt(0.99))
    assert low < mean < high and math.log(high / mean) == pytest.approx(
        12.706 * statistics.stdev([math.log(0.9), math.log(1.1)]) / math.sqrt(2), rel=1e-3)
    jitter = [1.0, 1.01, 0.99, 1.0]
    sure = confirmation({"seq1f1b-auto": [1.0] * 4, "seq1f1b-k4": [0.99 * j for j in jitter],
                         "seq1f1b-k8": [1.05] * 4})
    assert sure["against"] == "seq1f1b-k4" and sure["ratio"] == pytest.approx(0.99, rel=1e-3)
    assert sure["verdict"] == "hit" and sure["hit"] and sure["interval"][0] > 0.97
    far = confirmation({"seq1f1b-auto": [1.0] * 4, "seq1f1b-k4": [0.9 * j for j in jitter]})
    assert far["verdict"] == "miss" and not far["hit"]
    noisy = confirmation({"seq1f1b-auto": [1.0] * 4, "seq1f1b-k4": [0.9, 1.1, 0.93, 1.05]})
    assert noisy["verdict"].endswith("within noise")
    text = "\n".join(confirmation_lines(sure, 0.97))
    assert "auto / seq1f1b-k4 = **0.990**" in text and "**hit**" in text and "seq1f1b-k8" in text

    rows = summarize([_measured("seq1f1b-k4", [1.0], [1]), _measured("seq1f1b-auto", [1.2], [1])],
                     tokens_per_iter=8)
    plan = {"predicted_s": 1.0}
    assert auto_vs_sweep(rows, plan)["hit"] is False  # the sweep's runs alone: 0.83
    confirmed = auto_vs_sweep(rows, plan, confirmed=sure)
    assert confirmed["hit"] is True and confirmed["ratio"] == pytest.approx(1 / 1.2)

    assert parse_args(["--splits", "auto", "--sweep-splits", "2"]).confirm_rounds == 40
    assert parse_args(["--splits", "auto"]).confirm_rounds == 0
    assert parse_args(["--splits", "auto", "--sweep-splits", "2", "--confirm-rounds", "0"]
                      ).confirm_rounds == 0
    for bad in (["--confirm-rounds", "4"], ["--splits", "auto", "--confirm-rounds", "4"],
                ["--splits", "auto", "--sweep-splits", "2", "--confirm-rounds", "-1"],
                ["--splits", "auto", "--sweep-splits", "2", "--confirm-rivals", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_confirmation_uses_the_sweep_row_that_runs_the_auto_plan_as_a_control():
    import math

    from megatron_seq1f1b.bench.confirm import Race, closest_rivals, confirmation, sweep_twin
    from megatron_seq1f1b.bench.markdown import confirmation_lines

    auto = _measured("seq1f1b-auto", [1.2, 1.2], [1])
    sweep = [_measured(f"seq1f1b-k{k}", [t, t], [1]) for k, t in ((4, 1.0), (5, 1.1), (8, 1.5))]
    sweep[1].lengths = auto.lengths = [600, 424]
    assert sweep_twin([auto, *sweep], auto) is sweep[1]
    # The twin is the second fastest, but beating itself is noise: not a rival.
    assert [s.key for s in closest_rivals([auto, *sweep], 2, auto)] == ["seq1f1b-k4",
                                                                         "seq1f1b-k8"]
    sweep[1].schedule = "zb-h1"  # same segments, another schedule: a rival, not a twin
    assert sweep_twin([auto, *sweep], auto) is None
    assert len(closest_rivals([auto, *sweep], 3, auto)) == 3

    # Auto's runs were unlucky (slow rounds 1 and 3); the twin's were not: pooling the two
    # samples of one plan halves auto's noise, and the control shows how large it was.
    times = {"seq1f1b-auto": [1.10, 1.00, 1.10, 1.00], "seq1f1b-k5": [1.00, 1.00, 1.00, 1.00],
             "seq1f1b-k4": [1.02, 0.98, 1.02, 0.98]}
    alone = confirmation({k: v for k, v in times.items() if k != "seq1f1b-k5"})
    pooled = confirmation(times, Race(4, twin="seq1f1b-k5"))
    assert "seq1f1b-k5" not in pooled["rivals"] and pooled["against"] == "seq1f1b-k4"
    control = pooled["same_plan"]
    assert control["key"] == "seq1f1b-k5"
    assert control["ratio"] == pytest.approx(math.sqrt(1 / 1.1))  # geometric mean of 1/1.1, 1
    assert pooled["ratio"] == pytest.approx(
        math.exp(statistics.fmean(math.log(r / math.sqrt(a)) for a, r in
                                  zip([1.1, 1.0, 1.1, 1.0], [1.02, 0.98, 1.02, 0.98]))))
    assert alone["ratio"] < pooled["ratio"] < 1.0
    assert alone["same_plan"] is None
    text = "\n".join(confirmation_lines(pooled, 0.97))
    assert "seq1f1b-k5 (same plan as auto: control, true ratio 1)" in text


def test_t_bound_is_students_t_with_the_normal_tail():
    from megatron_seq1f1b.bench.confirm import t_bound

    # Tabulated quantiles of Student's t (two-sided 5 % and 1 %).
    for z, df, t in ((1.96, 1, 12.706), (1.96, 2, 4.303), (1.96, 7, 2.365), (1.96, 20, 2.086),
                     (2.5758, 10, 3.169), (2.5758, 3, 5.841)):
        assert t_bound(z, df) == pytest.approx(t, rel=2e-3)
    assert t_bound(1.96, 10_000) == pytest.approx(1.96, rel=1e-3)


@pytest.mark.parametrize("looks", [1, 2, 5, 9, 12])
def test_pocock_bound_keeps_repeated_looks_at_five_percent(looks):
    """Monte Carlo of a statistic with no true effect, looked at `looks` times (equally
    spaced): it crosses the bound at some look with chance 5 %; 1.96 at every look would
    cross far more often."""
    from megatron_seq1f1b.bench.confirm import pocock

    gen = torch.Generator().manual_seed(0)
    paths = torch.randn(200_000, looks, generator=gen, dtype=torch.float64).cumsum(dim=1)
    z = paths / torch.arange(1, looks + 1, dtype=torch.float64).sqrt()
    crossed = (z.abs() >= pocock(looks)).any(dim=1).double().mean().item()
    assert crossed == pytest.approx(0.05, abs=0.003)
    if looks > 1:
        assert (z.abs() >= 1.96).any(dim=1).double().mean().item() > 0.08


def test_confirmation_race_drops_decided_rivals_at_looks_only(monkeypatch):
    from megatron_seq1f1b.bench import runner
    from megatron_seq1f1b.bench.confirm import Race, confirmation

    race = Race(max_rounds=20, twin="seq1f1b-k5")
    assert race.looks() == [8, 12, 16, 20] and race.z == pytest.approx(2.361)
    assert Race(12).looks() == [8, 12] and Race(6).looks() == [6] and Race(6).z == 1.96

    auto = _measured("seq1f1b-auto", [1.0], [1])
    twin, close, far = (_measured(key, [1.0], [1]) for key in
                        ("seq1f1b-k5", "seq1f1b-k6", "seq1f1b-k2"))
    # k2 is 20 % slower than auto: decided at the first look. k6 runs auto's speed within
    # +-10 % noise: never surely within 3 %, it races to the end. The twin runs with it.
    wobble = [1.1, 0.9, 1.0, 1.05, 0.95]
    runs = {"seq1f1b-auto": iter([1.0] * 40), "seq1f1b-k5": iter([1.0] * 40),
            "seq1f1b-k6": iter(wobble * 8), "seq1f1b-k2": iter([1.2, 1.25] * 20)}
    monkeypatch.setattr(runner, "say", lambda text: None)
    monkeypatch.setattr(runner, "run_once", lambda s, *a, **kw: {"time": next(runs[s.key])})
    times = runner.confirm_rounds(auto, [twin, close, far], race, [], None, None, None, 8)
    assert {key: len(t) for key, t in times.items()} == {
        "seq1f1b-auto": 20, "seq1f1b-k5": 20, "seq1f1b-k6": 20, "seq1f1b-k2": 8}
    result = confirmation(times, race)
    assert result["rivals"]["seq1f1b-k2"]["decided"] == "hit"  # auto surely within 3 %
    assert result["rivals"]["seq1f1b-k2"]["rounds"] == 8
    assert result["rivals"]["seq1f1b-k6"]["decided"] is None
    assert result["against"] == "seq1f1b-k6" and result["verdict"] == "hit within noise"
    assert result["looks"] == [8, 12, 16, 20] and result["max_rounds"] == 20

    # Every rival decided early: the race ends there.
    runs = {"seq1f1b-auto": iter([1.0] * 40), "seq1f1b-k2": iter([1.2, 1.25] * 20)}
    times = runner.confirm_rounds(auto, [far], Race(40), [], None, None, None, 8)
    assert len(times["seq1f1b-auto"]) == 8


def test_confirmation_verdict_needs_every_rival_decided():
    from megatron_seq1f1b.bench.confirm import Race, confirmation

    steady = [1.0, 1.002, 0.998, 1.0] * 3
    times = {"seq1f1b-auto": [1.0] * 12,
             "seq1f1b-k4": [0.99 * j for j in steady],                # surely within 3 %
             "seq1f1b-k6": [x * 1.0 for x in [0.9, 1.1, 1.05, 0.97] * 3]}  # unsure
    result = confirmation(times, Race(12))
    assert result["rivals"]["seq1f1b-k4"]["decided"] == "hit"
    assert result["rivals"]["seq1f1b-k6"]["decided"] is None
    # k4 beats auto most (0.99 < 1.0), but k6 is undecided: not a sure hit.
    assert result["against"] == "seq1f1b-k4" and result["verdict"] == "hit within noise"
    short = dict(times, **{"seq1f1b-k8": [0.9 * j for j in steady]})
    assert confirmation(short, Race(12))["verdict"] == "miss"


def test_auto_vs_sweep_ratio_and_prediction_error():
    from megatron_seq1f1b.bench.markdown import auto_plan_lines
    from megatron_seq1f1b.bench.summary import auto_vs_sweep

    def row(key, k, times):
        measured = _measured(key, times, [10, 10])
        measured.k = k
        return measured

    rows = summarize([row("1f1b", 1, [4.0, 4.0]), row("seq1f1b-k1", 1, [4.0, 4.0]),
                      row("seq1f1b-k2", 2, [2.0, 2.2]), row("seq1f1b-auto", 2, [2.0, 2.0])],
                     tokens_per_iter=8)
    plan = {"k": 2, "partition": "measured", "schedule": "1f1b", "lengths": [5, 3],
            "predicted_s": 2.2, "calibration_mode": "concurrent", "timing": "gloo",
            "table": "(table)"}
    auto = auto_vs_sweep(rows, plan)
    assert (auto["best_key"], auto["best_k"]) == ("seq1f1b-k2", 2)
    assert auto["ratio"] == pytest.approx(2.1 / 2.0) and auto["hit"] is True
    assert auto["paired_ratio"] == pytest.approx(1.05)  # median of 1.0 and 1.1
    assert auto["prediction_error"] == pytest.approx(0.1)
    assert auto["sweep"] == [[1, 2.0], [2, pytest.approx(8 / 2.1)]]
    text = "\n".join(auto_plan_lines(auto))
    assert "Automatic plan vs a sweep of k" in text and "**hit**" in text and "+10.0%" in text
    slow = auto_vs_sweep(summarize([row("seq1f1b-k2", 2, [1.0]), row("seq1f1b-auto", 3, [2.0])],
                                   tokens_per_iter=8), plan)
    assert slow["ratio"] == pytest.approx(0.5) and slow["hit"] is False
    alone = auto_vs_sweep(summarize([row("seq1f1b-auto", 3, [2.0])], tokens_per_iter=8), plan)
    assert alone["best_key"] is None and alone["hit"] is None


def _mock_batch(b: int, s: int, vocab: int, seed: int = 0) -> dict:
    text = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    text[:, 5] = vocab - 1  # a stray end-of-document token the packing must remove
    return {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).repeat(b, 1)}


def test_packing_places_documents_as_megatrons_data_loader_would():
    from megatron_seq1f1b.bench import packing
    from megatron_seq1f1b.segments.documents import Documents, long_tailed

    eod, s = 63, 200
    batch = _mock_batch(2, s, 64)
    documents = long_tailed(s, 30, seed=7, micro_batch_size=2)
    out = packing.pack(batch, documents, eod)
    assert Documents.from_eod(out["tokens"], eod) == documents
    for sample in range(2):
        ends = documents.bounds(sample)[1:-1]  # documents that end inside the sequence
        assert (out["tokens"][sample] == eod).nonzero().flatten().tolist() == [e - 1 for e in ends]
        assert out["position_ids"][sample].tolist() == documents.positions(sample, 0, s)
        assert out["loss_mask"][sample].tolist() == [0.0 if t == eod else 1.0
                                                     for t in out["tokens"][sample].tolist()]
    assert torch.equal(out["labels"][:, :-1], out["tokens"][:, 1:])  # shifted tokens
    assert (out["labels"][:, -1] != eod).all()
    # micro-batch i draws with seed --seed + i
    args = SimpleNamespace(document_length=30, seed=7)
    packed = packing.pack_all([batch, batch], args, eod)
    assert [Documents.from_eod(p["tokens"], eod) for p in packed] == [
        long_tailed(s, 30, seed=7 + i, micro_batch_size=2) for i in range(2)]


def test_packing_forms_follow_the_trainers_table():
    from megatron_seq1f1b.bench import packing

    assert packing.form_of(True, "local", True) == "megatron-local"
    assert packing.form_of(False, "local", True) == "seq1f1b-local"
    assert packing.form_of(True, "flash", True) == packing.form_of(False, "flash", True) == "packed"
    assert packing.form_of(True, "local", False) == "plain"
    eod = 63
    batch = packing.pack_all([_mock_batch(1, 64, 64)], SimpleNamespace(document_length=10,
                                                                     seed=1), eod)[0]
    mask = packing.form(batch, "megatron-local", eod)["attention_mask"]
    assert mask.shape == (1, 1, 64, 64) and mask.dtype == torch.bool
    thd = packing.form(batch, "packed", eod)
    assert thd["tokens"].shape == (1, 64) and thd["cu_seqlens"][0, -1] == 64
    assert packing.form(batch, "seq1f1b-local", eod) is batch


def test_document_cost_spread_and_pairs_skipped():
    from megatron_seq1f1b.bench.document_stats import attention_pairs, cost_spread, row_stats
    from megatron_seq1f1b.schedules.partition import MAX_SPREAD, CostModel, split_sequence
    from megatron_seq1f1b.segments.documents import Documents, long_tailed

    s, k = 256, 4
    cost = CostModel(100.0, 1.0)
    found = [long_tailed(s, 40, seed=i) for i in range(4)]
    balanced = split_sequence(s, k, "balanced", cost=cost)
    fixed, cut = row_stats(balanced, found, k, cost, 1), row_stats(None, found, k, cost, 1)
    assert cut["cost_spread"] <= MAX_SPREAD < fixed["cost_spread"]
    assert fixed["segments_per_microbatch"] == [balanced] * 4
    assert all(sum(seg) == s for seg in cut["segments_per_microbatch"])
    whole = Documents.whole(s)
    assert cost_spread(balanced, whole, cost) < 1.05  # balanced is balanced without documents
    unpacked = row_stats(None, [whole] * 4, k, cost, 1)  # the documents row cuts as balanced
    assert unpacked["segments_per_microbatch"] == [balanced] * 4
    assert cost_spread([s], found[0], cost) == 1.0
    # flash-like: each document's causal pairs; a dense causal run: the whole triangle
    computed, causal = attention_pairs([s], found[0], dense=False)
    assert causal == s * (s + 1) / 2 and computed == found[0].pairs(0, s)
    assert 0 < fixed["attention_pairs_skipped"] < 1
    # local (dense scores): one segment skips nothing; later segments skip earlier documents
    assert attention_pairs([s], found[0], dense=True) == (s * s, s * s)
    dense = row_stats(balanced, found, k, CostModel(100.0, 1.0, dense_attention=True), 1)
    assert 0 < dense["attention_pairs_skipped"] < fixed["attention_pairs_skipped"]


def test_document_length_adds_the_documents_row():
    from megatron_seq1f1b.bench.cli import parse_args

    args = parse_args(["--document-length", "100", "--attention-backend", "flash"])
    assert "seq1f1b-documents" in args.schedules and args.attention_backend == "flash"
    assert "seq1f1b-documents" not in parse_args([]).schedules
    assert parse_args(["--schedules", "1f1b", "seq1f1b-documents"]).schedules[-1] == \
        "seq1f1b-documents"  # unpacked: the executor cuts one document per sample
    for bad in (["--document-length", "0"], ["--document-length", "2000"],
                ["--document-length", "100", "--attention-backend", "flash",
                 "--micro-batch-size", "2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_published_fused_rows_are_fair_or_say_why():
    """Every flash/TE row of docs/benchmarks/*.json computes at least 0.95x of Megatron's CPU
    time, or carries the benchmark's explanation (a baseline defect, not a result)."""
    import json

    from megatron_seq1f1b.bench.summary import FAIR_CPU_RATIO, FUSED_BACKENDS

    checked = 0
    for path in sorted((ROOT / "docs" / "benchmarks").glob("*.json")):
        results = json.loads(path.read_text())
        if (results.get("meta") or {}).get("attention_backend") not in FUSED_BACKENDS:
            continue
        for row in results["schedules"]:
            ratio = row.get("cpu_ratio_vs_1f1b")
            if row["megatron"] or ratio is None:
                continue
            checked += 1
            assert ratio >= FAIR_CPU_RATIO or "baseline defect" in (row.get("fairness") or ""), \
                (path.name, row["key"], ratio)
    assert checked

