"""Automatic plan (planner/) and the "measured" partition: choices equal brute force.

The brute force here is written independently of the planner: costs straight
from the synthetic tables' formulas, the measured split by the numeric
solver, memory from a set of live units; time by replaying the steps the
executor would plan (receives placed with the zero-bubble costs).
"""

import functools
from dataclasses import replace
import itertools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import os

import pytest

from megatron_seq1f1b import split_sequence
from megatron_seq1f1b.planner.choice import _rank_key
from megatron_seq1f1b.planner import (
    BudgetError,
    Calibration,
    Fit,
    Plan,
    StageCosts,
    activation_peak,
    choose_plan,
    format_table,
    load_calibration,
    main,
    save_calibration,
)
from megatron_seq1f1b.schedules.partition import METHODS, CostModel, causal_pairs
from megatron_seq1f1b.schedules.plan import plan_steps
from megatron_seq1f1b.schedules.replay import replay
from megatron_seq1f1b.schedules.schedule import SCHEDULES, B, F, W, build_schedule
from megatron_seq1f1b.schedules.simulate import peak_inflight

SEQ, P, M = 4096, 4, 4
MIN_LEN, MAX_K = 64, 8

# A 7B-like model: FLOP-balanced split that is only mildly skewed at 4k tokens.
CONFIG = SimpleNamespace(hidden_size=4096, num_attention_heads=32, kv_channels=None,
                         num_query_groups=None, ffn_hidden_size=16384,
                         gated_linear_unit=False, num_layers=32)
VOCAB = 32000


def table(a, c, d, weight=None, stages=P, skew=None, bc=2.0):
    """Same F fit everywhere (optionally scaled per stage); B = 2 F but ``bc`` x F's
    attention; W optional."""
    made = []
    for s in range(stages):
        f = (skew or [1.0] * stages)[s]
        forward = Fit(a * f, c * f, d * f)
        backward = Fit(2 * a * f, bc * c * f, 2 * d * f)
        w = Fit(weight[0] * f, weight[1] * f, weight[2] * f) if weight else None
        made.append(StageCosts(forward, backward, w))
    return Calibration(tuple(made), source="synthetic")


TABLES = {
    # attention 4x the linear part at the end of the sequence: far from the FLOP ratio
    "attention": dict(a=1.0, c=4.0 / SEQ, d=10.0, bc=3.0),
    # a segment costs as much as a quarter of the whole sequence's linear work, regardless
    "overhead": dict(a=1.0, c=0.1 / SEQ, d=SEQ / 4),
    # linear layers only, W half of the backward: zero bubble fills the cool-down
    "zero_bubble": dict(a=1.0, c=0.0, d=0.0, weight=(1.0, 0.0, 0.0)),
    # first stage heavier (embedding), last lighter
    "uneven_stages": dict(a=1.0, c=1.0 / SEQ, d=50.0, skew=[1.3, 1.0, 1.0, 0.8]),
}


# ------------------------------------------------------------------ brute force


def times(t, length, end):
    """(F, B, W) on a stage of factor 1 from the table's formula (causal pairs)."""
    pairs = causal_pairs(length, end)
    f = t["a"] * length + t["c"] * pairs + t["d"]
    b = 2 * t["a"] * length + t.get("bc", 2.0) * t["c"] * pairs + 2 * t["d"]
    w_fit = t.get("weight")
    w = (w_fit[0] * length + w_fit[1] * pairs + w_fit[2]) if w_fit else b / 2  # fraction 0.5
    return f, b, w


@functools.lru_cache(maxsize=None)
def brute_force(name, budget=None, send_slack=0):
    t = TABLES[name]
    skew = t.get("skew") or [1.0] * P
    total_cost = lambda length, end: sum(skew) * sum(times(t, length, end)[:2])  # noqa: E731
    found = []
    for k in range(1, min(MAX_K, SEQ // MIN_LEN) + 1):
        for partition in METHODS:
            if partition == "uniform":
                lengths = split_sequence(SEQ, k)
            elif partition == "balanced":
                lengths = split_sequence(SEQ, k, "balanced", config=CONFIG, vocab_size=VOCAB)
            else:
                try:
                    lengths = split_sequence(SEQ, k, "measured", cost=total_cost)
                except ValueError:
                    continue
            if k > 1 and min(lengths) < MIN_LEN:
                continue
            ends = list(itertools.accumulate(lengths))
            seg = [times(t, n, e) for n, e in zip(lengths, ends)]
            mean_f = sum(f for f, _, _ in seg) / k
            costs = tuple((round(f / mean_f, 4), round((b - w) / mean_f, 4), round(w / mean_f, 4))
                          for f, b, w in seg)  # mean over stages: the skew cancels
            for name in SCHEDULES:
                zb = name != "1f1b"
                schedule = build_schedule(P, M, k, schedule=name, costs=costs if zb else None)

                def cost(action, rank, seg=seg, zb=zb):
                    f, b, w = (skew[rank] * x for x in seg[action.segment])
                    return {"F": f, "B": b - w if zb else b, "W": w}[action.kind]

                place = (lambda a, r, costs=costs: costs[a.segment]["FBW".index(a.kind)]) \
                    if zb else None
                timeline = replay(plan_steps(schedule, 1, cost=place), cost,
                                  send_slack=send_slack)
                memory = 0.0
                for actions in schedule:
                    live = set()
                    for action in actions:
                        unit = (action.microbatch, action.segment)
                        if action.kind == "F":
                            live.add(unit)
                        elif action.kind == ("W" if zb else "B"):
                            live.remove(unit)
                        memory = max(memory, sum(lengths[s] for _, s in live) / SEQ)
                found.append((timeline.makespan, memory, k, METHODS.index(partition),
                              SCHEDULES.index(name), partition, name, tuple(lengths)))
    feasible = [f for f in found if budget is None or f[1] <= budget + 1e-9]
    best = min(feasible, key=lambda f: tuple(round(x, 6) if isinstance(x, float) else x
                                             for x in f[:5]))
    return best, found


def plan(name, **kw):
    """choose_plan on a table; steps that wait for their sends (send_slack=0) unless asked."""
    if not kw:
        return _free_plan(name)
    kw = {"calibration": table(**TABLES[name]), "config": CONFIG, "vocab_size": VOCAB,
          "min_segment_length": MIN_LEN, "max_splits": MAX_K, "send_slack": 0, **kw}
    return choose_plan(SEQ, P, M, **kw)


@functools.lru_cache(maxsize=None)
def _free_plan(name):
    return plan(name, max_splits=MAX_K)


# ------------------------------------------------------------------ choices


@pytest.mark.parametrize("name,send_slack", [(name, 0) for name in sorted(TABLES)]
                         + [("zero_bubble", 1), ("attention", 1)])
def test_choice_equals_brute_force(name, send_slack):
    best, found = brute_force(name, send_slack=send_slack)
    choice = plan(name, send_slack=send_slack) if send_slack else plan(name)
    got = choice.plan
    assert (got.num_splits, got.partition, got.schedule, got.lengths) == \
        (best[2], best[5], best[6], best[7])
    assert got.time == pytest.approx(best[0], rel=1e-9)
    assert got.memory == pytest.approx(best[1], rel=1e-9)
    # every candidate's prediction matches the brute force's for that plan
    by_plan = {(f[2], f[7], f[6]): f for f in found}
    for c in choice.candidates:
        f = by_plan[(c.num_splits, c.lengths, c.schedule)]
        assert (c.time, c.memory) == (pytest.approx(f[0], rel=1e-9), pytest.approx(f[1], rel=1e-9))


def test_each_table_has_its_expected_kind_of_winner():
    """The tables are not all won by the same plan: the choice depends on the costs."""
    attention = plan("attention").plan
    assert attention.num_splits > 1 and attention.partition == "measured"
    overhead = plan("overhead").plan
    assert overhead.num_splits <= 2
    zero_bubble = plan("zero_bubble").plan
    assert zero_bubble.schedule in ("zb-h1", "zb-h2")


def test_budget_picks_fastest_within_it():
    free = plan("attention").plan
    budget = free.memory * 0.9
    best, _ = brute_force("attention", budget)
    choice = plan("attention", memory_budget=budget)
    got = choice.plan
    assert got.memory <= budget and got.within_budget
    assert (got.num_splits, got.partition, got.schedule) == (best[2], best[5], best[6])
    assert got != free and "within the memory budget" in choice.reason
    assert any(c.within_budget is False for c in choice.candidates)


def test_budget_in_bytes():
    t = "attention"
    free = plan(t, bytes_per_token=1000.0, micro_batch_size=2, max_splits=4).plan
    assert free.memory_bytes == pytest.approx(free.memory * SEQ * 2 * 1000.0)
    choice = plan(t, bytes_per_token=1000.0, micro_batch_size=2, max_splits=4,
                  memory_budget_bytes=free.memory_bytes * 0.9)
    assert choice.plan.memory_bytes <= free.memory_bytes * 0.9
    with pytest.raises(ValueError, match="needs bytes_per_token"):
        plan(t, memory_budget_bytes=1e9)


def test_budget_too_small_names_smallest_plan():
    t = "attention"
    _, found = brute_force(t)
    smallest = min(f[1] for f in found)
    with pytest.raises(BudgetError) as err:
        plan(t, memory_budget=smallest * 0.99)
    assert isinstance(err.value, ValueError)
    assert err.value.smallest.memory == pytest.approx(smallest)
    assert f"{smallest:.2f} micro-batches" in str(err.value)
    assert err.value.smallest.describe() in str(err.value)
    plan(t, memory_budget=smallest)  # exactly enough: fits


def test_activation_held_until_weight_gradient():
    lengths = [3, 1]  # weights 0.75 and 0.25 of a micro-batch
    plain = [[F(0, 0), F(0, 1), B(0, 1), F(1, 0), B(0, 0), F(1, 1), B(1, 1), B(1, 0)]]
    assert activation_peak(plain, lengths) == pytest.approx(1.5)  # F(1,0) after B(0,1)
    zero_bubble = [[F(0, 0), F(0, 1), B(0, 1), F(1, 0), W(0, 1), B(0, 0), W(0, 0), F(1, 1),
                    B(1, 1), W(1, 1), B(1, 0), W(1, 0)]]
    assert activation_peak(zero_bubble, lengths) == pytest.approx(1.75)  # B(0,1) frees nothing
    assert activation_peak(plain, lengths, num_model_chunks=2) == pytest.approx(0.75)


# ------------------------------------------------------------------ determinism


def _plan(time, memory, k, partition, schedule):
    return Plan(k, partition, (1,) * k, schedule, time, 0.0, memory)


def test_ties_broken_by_memory_then_k_then_partition_then_schedule():
    a = _plan(1.0, 2.0, 4, "measured", "zb-h2")
    assert _rank_key(_plan(1.0, 1.0, 8, "measured", "zb-h2")) < _rank_key(a)
    assert _rank_key(_plan(1.0, 2.0, 2, "measured", "zb-h2")) < _rank_key(a)
    assert _rank_key(_plan(1.0, 2.0, 4, "uniform", "zb-h2")) < _rank_key(a)
    assert _rank_key(_plan(1.0, 2.0, 4, "measured", "1f1b")) < _rank_key(a)
    assert _rank_key(_plan(0.9, 9.0, 16, "measured", "zb-h2")) < _rank_key(a)
    # equal up to summation noise is a tie
    assert _rank_key(_plan(1.0 + 1e-14, 2.0, 4, "measured", "1f1b")) < _rank_key(a)


def test_same_inputs_same_plan_whatever_the_option_order():
    t = "zero_bubble"  # zb-h1 and zb-h2 tie on time here
    one = plan(t)
    two = plan(t, partitions=[m for m in reversed(METHODS) if m != "documents"],
               schedules=list(reversed(SCHEDULES)),
               splits=list(reversed(range(1, MAX_K + 1))))
    assert one == two
    tied = [c for c in one.candidates if c.time == pytest.approx(one.plan.time, rel=1e-12)]
    assert len(tied) > 1, "this table should produce a tie"
    assert "wins the tie on" in one.reason


def test_interleaved_skips_zb_h2_and_uses_chunks():
    choice = plan("uneven_stages", num_model_chunks=2, max_splits=4)
    assert {c.schedule for c in choice.candidates} == {"1f1b", "zb-h1"}
    # a unit holds 1/(k v) micro-batches of a stage: k=1 peaks are units / v
    for c in choice.candidates:
        if c.num_splits == 1:
            units = max(peak_inflight(a) for a in build_schedule(P, M, 1, 2, schedule=c.schedule))
            assert c.memory == pytest.approx(units / 2)
    with pytest.raises(ValueError, match="zb-h2"):
        plan("uneven_stages", num_model_chunks=2, schedules=["zb-h2"])


def test_flops_only_and_minimum_segment_length():
    choice = choose_plan(SEQ, P, M, config=CONFIG, vocab_size=VOCAB, min_segment_length=1024,
                         exhaustive=True)
    assert max(c.num_splits for c in choice.candidates) == 4
    assert all(min(c.lengths) >= 1024 for c in choice.candidates)
    # from FLOPs "measured" would repeat "balanced": listed once
    assert {c.partition for c in choice.candidates} == {"uniform", "balanced"}
    assert choice.plan.unit == "FLOP"
    with pytest.raises(ValueError, match="needs costs"):
        choose_plan(SEQ, P, M)


# ------------------------------------------------------------------ measured partition


@pytest.mark.parametrize("k", [2, 4, 8])
def test_measured_partition_equalizes_calibrated_cost(k):
    cal = table(**TABLES["attention"])
    lengths = split_sequence(SEQ, k, "measured", cost=cal, multiple_of=8)
    assert sum(lengths) == SEQ and all(n % 8 == 0 for n in lengths)
    ends = itertools.accumulate(lengths)
    costs = [cal(n, e) for n, e in zip(lengths, ends)]
    assert max(costs) / min(costs) < 1.05
    flops = split_sequence(SEQ, k, "balanced", config=CONFIG, vocab_size=VOCAB, multiple_of=8)
    assert lengths != flops and lengths[0] > flops[0]  # attention is costlier than FLOPs say
    # a plain callable (numeric solver) gives the same split
    assert split_sequence(SEQ, k, "measured", cost=lambda n, e: cal(n, e), multiple_of=8) == lengths


def test_measured_partition_of_a_flop_model_is_the_balanced_one():
    model = CostModel.from_config(CONFIG, VOCAB)
    for k in (2, 3, 5):
        assert split_sequence(32768, k, "measured", cost=model, multiple_of=8) == \
            split_sequence(32768, k, "balanced", config=CONFIG, vocab_size=VOCAB, multiple_of=8)


@pytest.mark.parametrize("dense", [True, False])
def test_measured_partition_of_attention_only_costs(dense):
    """A noisy fit can leave no per-token cost; the split must still come out (CI once
    divided by zero here, with the rectangle quadratic, once a segment reached position 0)."""
    model = CostModel(0.0, 1.0, dense_attention=dense)
    for k in (2, 3, 4, 8):
        lengths = split_sequence(512, k, "measured", cost=model, multiple_of=8)
        assert sum(lengths) == 512 and all(n > 0 for n in lengths)
        assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]


def test_measured_partition_errors():
    message = r"partition 'measured' needs calibrated costs \(cost=\.\.\.\)"
    with pytest.raises(ValueError, match=message):
        split_sequence(SEQ, 4, "measured")
    with pytest.raises(ValueError, match="does not grow"):
        split_sequence(SEQ, 4, "measured", cost=lambda n, e: 5.0)
    assert "measured" in METHODS


# ------------------------------------------------------------------ calibration files


def test_deferral_overhead_measured_for_b_can_cost_zero_bubble_the_win():
    """B timed with W deferred (``input``) is what zero-bubble plans pay; where deferring
    costs enough, 1f1b (whole backward) wins instead."""
    base = table(**TABLES["zero_bubble"])

    def schedule(calibration):
        return plan("zero_bubble", calibration=calibration, splits=[4],
                    partitions=["uniform"]).plan.schedule

    assert schedule(base) != "1f1b"
    costly = Calibration(tuple(replace(s, input=Fit(1.6, 0.0, 0.0)) for s in base.stages),
                         source="synthetic")  # B 1.6 + W 1.0 vs the whole backward's 2.0
    assert schedule(costly) == "1f1b"
    cheap = Calibration(tuple(replace(s, input=Fit(1.0, 0.0, 0.0)) for s in base.stages),
                        source="synthetic")
    assert schedule(cheap) != "1f1b"


def test_message_latency_favours_fewer_segments():
    """Every step that exchanges tensors pays the message time: more segments, more steps."""
    base = table(**TABLES["attention"])
    free = plan("attention", calibration=base, schedules=["1f1b"]).plan
    slow = plan("attention", calibration=replace(base, message=Fit(0.0, 0.0, SEQ / 8)),
                schedules=["1f1b"]).plan
    assert slow.num_splits < free.num_splits, (slow.describe(), free.describe())
    assert slow.time > free.time
    per_token = replace(base, message=Fit(0.5, 0.0, 2.0))
    assert per_token.message_latency([6, 2]) == pytest.approx(0.5 * 4 + 2.0)


def test_calibration_round_trip(tmp_path):
    cal = table(**TABLES["zero_bubble"], skew=[1.2, 1.0, 1.0, 0.9])
    stages = (replace(cal.stages[0], input=Fit(1.1, 0.0, 0.01)),) + cal.stages[1:]
    cal = Calibration(stages, "rectangle", 0.4, "s", "round trip", bytes_per_token=3e4,
                      message=Fit(2e-9, 0.0, 5e-5))
    path = tmp_path / "calib.json"
    save_calibration(cal, path)
    assert load_calibration(path) == cal
    data = json.loads(path.read_text())
    assert data["format"] == "megatron_seq1f1b.calibration" and len(data["stages"]) == 4
    data["version"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version"):
        load_calibration(path)


def test_calibration_from_samples_and_bench_results(tmp_path):
    truth = {(r, 0): (1e-6 * (r + 1), 3e-10, 2e-4) for r in range(2)}
    samples = {}
    for key, (a, c, d) in truth.items():
        samples[key] = [[n, e, a * n + c * causal_pairs(n, e) + d,
                         2 * (a * n + c * causal_pairs(n, e) + d)]
                        for n, e in [(4096, 4096), (2048, 2048), (2048, 4096), (1024, 1024),
                                     (1024, 4096), (512, 3072)]]
    cal = Calibration.from_samples(samples)
    assert cal.quadratic == "causal_pairs" and len(cal.stages) == 2
    assert cal.stages[1].forward.a == pytest.approx(2e-6, rel=1e-6)
    assert cal.stages[0].backward.d == pytest.approx(4e-4, rel=1e-6)
    # a benchmark's results.json: calibration.fits[layout]["stage.chunk"]
    fits = {f"{r}.0": {"F": {"a": a, "c": c, "d": d, "mean_rel_err": 0.0},
                       "B": {"a": 2 * a, "c": 2 * c, "d": 2 * d}}
            for (r, _), (a, c, d) in truth.items()}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"calibration": {"quadratic": "causal_pairs",
                                                "fits": {"plain": fits}}}))
    loaded = load_calibration(path)
    assert [s.forward.a for s in loaded.stages] == [1e-6, 2e-6]


# ------------------------------------------------------------------ table and command line


def test_table_lists_every_candidate_and_why():
    choice = plan("attention", memory_budget=2.0, max_splits=4, exhaustive=True)
    text = format_table(choice.candidates, choice.plan)
    lines = text.splitlines()
    assert len(lines) == len(choice.candidates) + 3  # header, rule, rows, reason
    assert sum(line.startswith("*") for line in lines) == 1
    assert "over" in text and "ok" in text
    assert lines[-1] == choice.reason and choice.plan.describe() in lines[-1]


def test_cli_prints_table(tmp_path, capsys):
    path = tmp_path / "calib.json"
    save_calibration(table(**TABLES["attention"]), path)
    out_json = tmp_path / "plan.json"
    assert main(["--seq-length", str(SEQ), "--pp", "4", "--microbatches", "4", "--calibration",
                 str(path), "--max-splits", "4", "--memory-budget-microbatches", "2", "--json",
                 str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "partition" in out and "wins:" in out and "chosen: --seq1f1b-splits" in out
    written = json.loads(out_json.read_text())
    assert written["plan"]["num_splits"] <= 4 and len(written["candidates"]) >= 2
    assert len(written["candidates"]) + written["untimed"] > 3  # every candidate weighed
    with pytest.raises(SystemExit, match="no plan fits"):
        main(["--seq-length", str(SEQ), "--pp", "4", "--microbatches", "4", "--calibration",
              str(path), "--memory-budget-microbatches", "0.1", "--splits", "1", "2"])


def test_cli_module_runs_from_flops():
    done = subprocess.run(
        [sys.executable, "-m", "megatron_seq1f1b.planner", "--seq-length", "8192", "--pp", "2",
         "--microbatches", "2", "--hidden-size", "1024", "--num-layers", "8",
         "--num-attention-heads", "8", "--vocab-size", "32000", "--max-splits", "3"],
        capture_output=True, text=True, check=True, timeout=60)
    assert "FLOP" in done.stdout and "chosen:" in done.stdout


ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--seq-length", "8192", "--pp", "4", "--microbatches", "4", "--hidden-size", "1024",
         "--num-layers", "8", "--num-attention-heads", "8", "--vocab-size", "32000"]


def readme_planner_command(needle: str) -> list[str]:
    """The README's planner command line that contains ``needle``, as argv for main()."""
    text = (ROOT / "README.md").read_text()
    for block in text.split("```bash")[1:]:
        command = block.split("```")[0].replace("\\\n", " ")
        for line in command.splitlines():
            if line.startswith("python -m megatron_seq1f1b.planner") and needle in line:
                return shlex.split(line)[3:]
    raise AssertionError(f"README.md has no planner command with {needle!r}")


def run_cli(argv, capsys, tmp_path=None) -> tuple[list[str], dict | None]:
    """main(argv): its printed lines, and its --json output where tmp_path is given."""
    extra = ["--json", str(tmp_path / "plan.json")] if tmp_path else []
    assert main(argv + extra) == 0
    lines = capsys.readouterr().out.splitlines()
    return lines, json.loads((tmp_path / "plan.json").read_text()) if tmp_path else None


@pytest.mark.skipif(os.environ.get("SEQ1F1B_FULL") != "1",
                    reason="SEQ1F1B_FULL=1 runs it (48 s; the planner's TP flags are tested on smaller plans here)")
def test_readme_tp2_pp4_example_plans_and_top_3_stays_short(capsys):
    """Issue 44 (4): Megatron-LM's TP 2 x PP 4 example is planned per TP rank, and the
    short list fits on a screen of 24 lines: header (3), chosen flags and why (2),
    Megatron-Core's 1F1B beside it (issue 57: 2), 3 rows (+ the chosen one) under their
    header (2), the counts of the others (2), why, the busiest stage, the lengths, the memory
    check."""
    argv = readme_planner_command("--tp 2")
    assert {"--sequence-parallel", "--pp", "--gpu-memory-gib"} <= set(argv)
    lines, _ = run_cli(argv + ["--top", "3"], capsys)
    assert len(lines) <= 24, "\n".join(lines)
    rows = [line for line in lines if re.match(r"[ *]\s+\d+ \w+\s+(1f1b|zb-h1|zb-h2)\s", line)]
    assert 3 <= len(rows) <= 4, "\n".join(lines)  # the 3 fastest, and the chosen one
    assert "tensor parallel 2 with sequence parallelism" in lines[0]
    assert any("TP all-reduces at 200 GB/s" in line for line in lines[:4])
    assert lines[3].startswith("chosen: --seq1f1b-splits ")
    assert sum(line.startswith("*") for line in lines) == 1
    assert any("more candidates not shown (--top 0 lists all)" in line for line in lines)
    assert any(line.startswith("predicted memory of the busiest stage") for line in lines)


def test_top_lists_the_fastest_and_the_chosen_one(capsys, tmp_path):
    argv = SMALL + ["--host-ms-per-layer", "0", "--schedules", "1f1b", "--partitions",
                    "balanced", "--splits", "2", "3", "4", "5", "6", "7", "8"]
    every, data = run_cli(argv + ["--top", "0"], capsys, tmp_path)
    rows = [line for line in every if line[:1] in "* " and "balanced" in line.split()[:3]]
    assert len(rows) == len(data["candidates"]) == 7
    short, _ = run_cli(argv + ["--top", "1"], capsys)
    shown = [line for line in short if line[:1] in "* " and "balanced" in line.split()[:3]]
    assert shown[0] == rows[0] and shown[-1].startswith("*")  # the fastest, then the chosen
    assert len(shown) == 2 and rows[0][0] == " "
    # only what the choice needs is timed; what is not shown or not timed is counted
    hidden = next((int(line.split()[1]) for line in short
                   if "more candidates not shown (--top 0 lists all)" in line), 0)
    untimed = next(int(line.split()[1]) for line in short
                   if line.endswith("their lower bounds cannot change this answer (--top 0 "
                                    "times them all)"))
    assert untimed > 0 and len(shown) + hidden + untimed == 7


def test_every_planner_flag_says_what_it_is():
    """Every flag has a help text; every one that reads a number names its unit or default."""
    from megatron_seq1f1b.planner import build_parser

    actions = [a for a in build_parser()._actions if a.option_strings]
    assert len(actions) > 40
    for action in actions:
        assert action.help and action.help.strip(), action.option_strings
        if action.type is not None and action.dest != "help":
            assert action.metavar or action.choices, action.option_strings


def _flop_run(argv, capsys, tmp_path, *extra):
    """One k=1 1F1B plan from FLOPs alone (no host time): its time and its costs."""
    path = tmp_path / "calib.json"
    _, data = run_cli(SMALL + ["--host-ms-per-layer", "0", "--splits", "1", "--schedules",
                               "1f1b", "--bf16", "--save-calibration", str(path),
                               *argv, *extra], capsys, tmp_path)
    return data["plan"]["time"], load_calibration(path).stages[0].forward.a


def test_tensor_parallelism_halves_compute_and_adds_its_all_reduces(capsys, tmp_path):
    """TP 2: a compute-bound plan takes half the time per rank where communication is free,
    and at --tp-bandwidth-gbps it pays 2 all-reduces of [tokens, hidden] per layer and
    direction: 2 x 2 (tp-1)/tp x hidden x 2 bytes per token and layer."""
    one, per_token = _flop_run([], capsys, tmp_path)
    free, free_token = _flop_run(["--tp", "2", "--tp-bandwidth-gbps", "1e9"], capsys, tmp_path)
    paid, paid_token = _flop_run(["--tp", "2", "--tp-bandwidth-gbps", "100"], capsys, tmp_path)
    assert free == pytest.approx(one / 2, rel=1e-6)
    assert free_token == pytest.approx(per_token / 2, rel=1e-6)
    layers_per_stage, hidden = 8 / 4, 1024
    all_reduces = 2 * 2 * (2 - 1) / 2 * hidden * 2 * layers_per_stage / 100e9
    assert paid_token - free_token == pytest.approx(all_reduces, rel=1e-3)
    assert paid > free * 1.05
    # measured costs already hold TP: --tp leaves them alone
    calibrated = SMALL[:6] + ["--calibration", str(tmp_path / "calib.json"), "--splits", "1",
                              "--schedules", "1f1b"]
    _, one_data = run_cli(calibrated, capsys, tmp_path)
    lines, tp_data = run_cli(calibrated + ["--tp", "2"], capsys, tmp_path)
    assert tp_data["plan"]["time"] == one_data["plan"]["time"]
    assert "--tp 2 sets memory per rank and segment lengths only here" in lines[1]


def test_tensor_parallelism_divides_memory_per_rank(capsys, tmp_path):
    """Per TP rank: the layers' and the vocabulary's weights halve (norms and row-parallel
    biases stay whole), activations of split heads and MLP columns too, and with sequence
    parallelism nearly all of them (RoPE's cosines and sines stay whole)."""
    argv = SMALL + ["--bf16", "--splits", "4", "--partitions", "balanced", "--schedules", "1f1b",
                    "--top", "0"]
    stage = {}
    for name, extra in [("tp1", []), ("tp2", ["--tp", "2"]),
                        ("sp", ["--tp", "2", "--sequence-parallel"])]:
        _, data = run_cli(argv + extra, capsys, tmp_path)
        stage[name] = data["plan"]["stages"][0]
    assert 0.5 < stage["tp2"]["weights"] / stage["tp1"]["weights"] < 0.502
    assert stage["sp"]["weights"] == stage["tp2"]["weights"]
    assert 0.5 < stage["sp"]["activations"] / stage["tp1"]["activations"] < 0.52
    # per layer (bf16, hidden 1024): 8 KiB of [s, b, h] inputs stay whole without SP, of
    # 35 KiB: TP 2 keeps 63 % of TP 1's, with SP 51 %
    assert 0.6 < stage["tp2"]["activations"] / stage["tp1"]["activations"] < 0.65
    assert stage["sp"]["activations"] < 0.85 * stage["tp2"]["activations"]
    assert stage["tp2"]["total"] < 0.6 * stage["tp1"]["total"]


def test_sequence_parallelism_keeps_segments_divisible_by_tp(capsys, tmp_path):
    _, data = run_cli(SMALL + ["--tp", "4", "--sequence-parallel", "--multiple-of", "3",
                               "--seq-length", "8196", "--max-splits", "6"], capsys, tmp_path)
    assert data["segment_multiple"] == 12
    assert all(n % 12 == 0 for c in data["candidates"] for n in c["lengths"])
    _, data = run_cli(SMALL + ["--tp", "4", "--max-splits", "6"], capsys, tmp_path)
    assert data["segment_multiple"] == 1 and not data["sequence_parallel"]


def test_a_tie_override_is_said_first_and_by_how_much(capsys, tmp_path):
    """Where the 2 % tie rule keeps a slower plan, the lines right after the header say by
    how much and why; with --tie-tolerance 0 the fastest wins and nothing is said."""
    argv = SMALL + ["--host-ms-per-layer", "0", "--partitions", "balanced", "--schedules",
                    "1f1b", "--splits", "2", "3", "4", "5", "6", "7", "8"]
    lines, data = run_cli(argv, capsys, tmp_path)
    times = {c["num_splits"]: c["time"] for c in data["candidates"]}
    fastest = min(times, key=times.get)
    assert data["plan"]["num_splits"] < fastest
    slower = f"{data['plan']['time'] / times[fastest] - 1:.1%} slower than the fastest"
    head = "\n".join(lines[:5])  # the layout, costs, timing, chosen flags and why
    assert f"chosen: --seq1f1b-splits {data['plan']['num_splits']} " in head
    assert slower in head and f"k={fastest} balanced 1f1b" in head
    assert "kept because that is within the 2% tie tolerance" in head
    assert slower in data["tie_note"]
    exact, data = run_cli(argv + ["--tie-tolerance", "0"], capsys, tmp_path)
    assert data["plan"]["num_splits"] == fastest and data["tie_note"] == ""
    assert not any("slower than the fastest" in line for line in exact)


# ------------------------------------------------------------------ tie tolerance

PREFERRED = ("balanced", "measured", "uniform")  # the planner's order for near-ties


def brute_tolerant(name, tolerance, budget=None):
    """Among brute-force plans within `tolerance` of the fastest (within the budget): 1F1B
    before zero bubble, then balanced, measured, uniform, then fewer splits, then the usual
    ranking."""
    _, found = brute_force(name)
    named = {}  # the same lengths under several partition names: the first in METHODS order
    for f in sorted(found, key=lambda f: METHODS.index(f[5])):
        named.setdefault((f[2], f[7], f[6]), f)
    feasible = [f for f in named.values() if budget is None or f[1] <= budget + 1e-9]
    fastest = min(f[0] for f in feasible)
    close = [f for f in feasible if f[0] <= fastest * (1 + tolerance) * (1 + 1e-12)]
    return min(close, key=lambda f: (SCHEDULES.index(f[6]), PREFERRED.index(f[5]) if f[2] > 1
                                     else 0, f[2], round(f[0], 6), round(f[1], 6),
                                     METHODS.index(f[5]), SCHEDULES.index(f[6])))


@pytest.mark.parametrize("name", sorted(TABLES))
@pytest.mark.parametrize("tolerance", [0.01, 0.05])
def test_tie_tolerance_choice_equals_brute_force(name, tolerance):
    f = brute_tolerant(name, tolerance)
    got = plan(name, tie_tolerance=tolerance).plan
    assert (got.num_splits, got.partition, got.schedule, got.lengths) == (f[2], f[5], f[6], f[7])


def test_tie_tolerance_takes_1f1b_over_a_zero_bubble_win_inside_it():
    exact = plan("zero_bubble")
    fastest = exact.plan
    assert fastest.schedule != "1f1b"
    every = plan("zero_bubble", exhaustive=True)  # 1F1B's plans are slower: not all timed
    assert every.plan == exact.plan and every.untimed == 0
    best_1f1b = min(c.time for c in every.candidates if c.schedule == "1f1b")
    gap = best_1f1b / fastest.time - 1
    assert 0 < gap < 0.5
    assert plan("zero_bubble", tie_tolerance=0.0) == exact
    below = plan("zero_bubble", tie_tolerance=gap * 0.99).plan
    assert below.schedule != "1f1b"
    inside = plan("zero_bubble", tie_tolerance=gap * 1.01)
    assert inside.plan.schedule == "1f1b" and inside.plan.time <= fastest.time * (1 + gap * 1.01)
    assert "tie tolerance" in inside.reason and fastest.describe() in inside.reason
    assert inside.table().splitlines()[-1] == inside.reason


def test_tie_tolerance_keeps_the_budget():
    free = plan("attention").plan
    budget = free.memory * 0.9
    f = brute_tolerant("attention", 0.05, budget)
    got = plan("attention", memory_budget=budget, tie_tolerance=0.05)
    assert got.plan.memory <= budget
    assert (got.plan.num_splits, got.plan.partition, got.plan.schedule) == (f[2], f[5], f[6])
    with pytest.raises(ValueError, match="tie_tolerance"):
        plan("attention", tie_tolerance=-0.1)


# ------------------------------------------------------------------ host floor, send slack


def test_a_host_floor_makes_short_segments_cost_the_dispatch():
    """Fit.floor: a unit lasts at least its host dispatch; FLOP-like costs then pick few
    segments where the host cannot keep up, many where the device is the bottleneck."""
    fit = Fit(1.0, 0.0, 0.0, floor=300.0)
    assert fit.time(100, 100, "causal_pairs") == 300.0 and fit.time(500, 500,
                                                                     "causal_pairs") == 500.0
    model = CostModel(per_token=1.0, per_pair=0.0)
    free = Calibration.from_cost_model(model, P, flop_rate=1.0)
    # the floor: a forward of a quarter of the sequence on one of P stages
    floored = Calibration.from_cost_model(model, P, flop_rate=1.0, host_seconds=2 * SEQ / 4 / P)
    assert floored.stages[0].forward.floor == SEQ / 4 / P and floored.unit == "s"
    kw = dict(partitions=["uniform"], schedules=["1f1b"], max_splits=16, min_segment_length=64)
    many = choose_plan(SEQ, P, M, calibration=free, **kw).plan
    few = choose_plan(SEQ, P, M, calibration=floored, **kw).plan
    assert many.num_splits == 16 and few.num_splits <= 4, (many.describe(), few.describe())
    # where every unit's work reaches the floor, the floor changes nothing
    for k in (1, 2, 4):
        assert choose_plan(SEQ, P, M, calibration=floored, splits=[k], **kw).plan.time == \
            pytest.approx(choose_plan(SEQ, P, M, calibration=free, splits=[k], **kw).plan.time)


def test_floors_round_trip_and_come_from_host_samples(tmp_path):
    cal = replace(table(**TABLES["attention"]), unit="s")
    stages = (replace(cal.stages[0], forward=replace(cal.stages[0].forward, floor=0.25)),) \
        + cal.stages[1:]
    cal = replace(cal, stages=stages)
    path = tmp_path / "calib.json"
    save_calibration(cal, path)
    assert load_calibration(path) == cal
    assert "floor" in json.loads(path.read_text())["stages"][0]["F"]
    assert "floor" not in json.loads(path.read_text())["stages"][1]["F"]  # old files unchanged
    rows = [[n, n, 1e-6 * n + 1e-4, 2e-6 * n + 2e-4] for n in (512, 1024, 2048, 4096)]
    measured = Calibration.from_samples({(0, 0): rows, (1, 0): rows},
                                        floors={(0, 0): (3e-3, 4e-3)})
    assert (measured.stages[0].forward.floor, measured.stages[0].backward.floor) == (3e-3, 4e-3)
    assert measured.stages[1].forward.floor == 0.0


def test_host_floor_is_the_median_dispatch():
    from megatron_seq1f1b.planner.measure import host_floor

    assert host_floor([[1.0, 4.0], [3.0, 2.0], [2.0, 3.0]]) == (2.0, 3.0)


def test_unit_timer_on_a_cpu_reports_wall_time_for_both():
    import time

    from megatron_seq1f1b.planner.timing import UnitTimer

    timer = UnitTimer("cpu")
    with timer.time() as timing:
        time.sleep(0.01)
    assert timing.host == timing.device >= 0.01 and timing.held


def test_unit_timer_holds_after_a_warm_up_what_its_typical_dispatch_needs():
    """A warm-up's one-off stall (a compilation: 5 s) must not set the hold of every later
    unit (the hold is twice the warm-up's median dispatch, within its bounds)."""
    from megatron_seq1f1b.planner.timing import UnitTimer

    timer = UnitTimer("cpu", hold_s=0.02, max_hold_s=0.25)
    timer._hosts[:] = [5.0, 0.015, 0.03, 0.012, 0.028]  # dispatch seconds seen in a warm-up
    timer.reset()
    assert timer.hold_s == 0.056 and not timer._hosts
    timer.reset()  # nothing seen: the base hold
    assert timer.hold_s == 0.02
    timer._hosts[:] = [9.0, 8.0, 7.0]
    timer.reset()
    assert timer.hold_s == 0.25


def test_runtime_timing_is_the_default_and_lets_zero_bubble_fill_bubbles():
    """The executor's NCCL links transport finishes sends a step later (a step posts once the
    previous step's sends completed: timing "nccl"), the planner's default. With it, zero
    bubble beats 1F1B on attention-heavy FLOP costs of a 7B-like model at 32k tokens; waiting
    for sends (send slack 0, the old NCCL batch) it lost."""
    config = SimpleNamespace(hidden_size=4096, num_layers=32, num_attention_heads=32,
                             kv_channels=None, num_query_groups=None, ffn_hidden_size=11008,
                             gated_linear_unit=True)
    kw = dict(config=config, vocab_size=32000, splits=[8], partitions=["balanced"])
    default = choose_plan(32768, 4, 8, exhaustive=True, **kw)
    assert default == choose_plan(32768, 4, 8, timing="nccl", exhaustive=True, **kw)
    waiting = choose_plan(32768, 4, 8, send_slack=0, exhaustive=True, **kw)
    time_of = lambda choice, name: next(c.time for c in choice.candidates  # noqa: E731
                                        if c.schedule == name)
    assert default.plan.schedule == "zb-h1" and waiting.plan.schedule == "1f1b"
    assert time_of(default, "zb-h1") < time_of(default, "1f1b") < time_of(waiting, "zb-h1")


def test_cli_offline_costs_in_seconds_with_the_documented_host_time(capsys):
    argv = ["--seq-length", "1024", "--pp", "2", "--microbatches", "2", "--hidden-size", "256",
            "--num-layers", "4", "--num-attention-heads", "4", "--vocab-size", "1000"]
    assert main(argv + ["--host-ms-per-layer", "0"]) == 0
    flops_only = capsys.readouterr().out
    assert main(argv) == 0
    default = capsys.readouterr().out
    assert "400 TFLOP/s, 0 ms host time per unit" in flops_only
    assert "9.5 ms host time per unit" in default  # 4.75 ms x 2 layers per stage
    chosen = lambda out: int(out.split("--seq1f1b-splits ")[1].split()[0])  # noqa: E731
    assert chosen(flops_only) > 1 and chosen(default) == 1  # a tiny model: the host decides


def test_packed_documents_make_the_planner_cut_by_them():
    """With a packed micro-batch's documents every candidate's attention counts only pairs
    within documents, and the documents partition (cut by them) wins over balanced, whose
    causal triangle they do not have; without documents it is not a candidate."""
    from megatron_seq1f1b.schedules.partition import CostModel
    from megatron_seq1f1b.segments.documents import long_tailed

    model = CostModel(per_token=2 * 12 * 1024 * 1024 * 4 * 12, per_pair=4 * 1024 * 12)
    plain = choose_plan(32768, 4, 8, cost_model=model, splits=[1, 4, 8], schedules=["1f1b"],
                        exhaustive=True)
    assert {c.partition for c in plain.candidates} == {"uniform", "balanced"}
    packed = choose_plan(32768, 4, 8, cost_model=model, splits=[1, 4, 8], schedules=["1f1b"],
                         documents=long_tailed(32768, 2000, seed=1), exhaustive=True)
    assert packed.plan.partition == "documents" and packed.plan.num_splits == 8
    by = {(c.partition, c.num_splits): c.time for c in packed.candidates}
    assert by["balanced", 8] > 1.1 * by["documents", 8]
    assert by["documents", 8] < plain.plan.time  # fewer pairs than one causal triangle
