"""Predictions of the published configurations (bench/predictions.py) and the one-GPU
rehearsal check (bench/rehearsal_check.py, scripts/gpu_rehearse.sh), without a GPU.

Calibrations here are the FLOP model's, written to a temporary folder: they test the
logic and the format, never the numbers (those come from a GPU's calibrations).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron_seq1f1b.bench import predictions as pr
from megatron_seq1f1b.bench import rehearsal_check as rc
from megatron_seq1f1b.planner import GIB, Calibration, Fit, StageCosts, save_calibration, \
    stage_memory
from megatron_seq1f1b.planner.footprint import Training
from megatron_seq1f1b.schedules.partition import CostModel

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_rehearse.sh"
FIELDS = {"config", "seq_length", "schedule", "k", "partition", "tokens_per_s_vs_k1", "peak_gib"}


def flop_calibration(name: str, stages: int = 1) -> Calibration:
    published = pr.CONFIGS[name]
    model = CostModel.from_config(pr._config(published.shape), published.shape.vocab_size)
    return Calibration.from_cost_model(model, stages, flop_rate=400e12, host_seconds=0.02)


def test_predictions_json_has_the_issues_format(tmp_path):
    files = {}
    for name in pr.CONFIGS:
        files[name] = tmp_path / f"{name}.json"
        save_calibration(flop_calibration(name), files[name])
    stage_files = []
    for stage in range(3):  # three one-stage files combine into first, middle, last
        stage_files.append(tmp_path / f"s{stage}.json")
        save_calibration(flop_calibration("1.3b-pp4"), stage_files[-1])
    out, table = tmp_path / "predictions.json", tmp_path / "predictions.md"
    argv = ["--calibration", f"1.3b-pp4={','.join(map(str, stage_files))}",
            "--calibration", f"2.7b-pp8={files['2.7b-pp8']}", "--out", str(out),
            "--markdown", str(table)]
    assert pr.main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"rows"}
    rows = data["rows"]
    assert all(set(r) == FIELDS for r in rows)
    assert [(r["config"], r["seq_length"], r["schedule"], r["k"]) for r in rows] == (
        [("1.3b-pp4", 32768, "seq1f1b", k) for k in (1, 2, 4, 8)]
        + [("2.7b-pp8", s, schedule, k) for s in (16384, 24576, 32768)
           for schedule, k in (("1f1b", 1), ("1f1b-interleaved", 1), ("seq1f1b", 4),
                               ("seq1f1b-interleaved", 4))])
    assert {r["schedule"] for r in rows} <= set(pr.SCHEDULES)
    assert all(r["partition"] == "balanced" for r in rows)
    for r in rows:  # Megatron's 1F1B is the reference of its configuration and length
        if r["k"] == 1 and r["schedule"] in ("seq1f1b", "1f1b"):
            assert r["tokens_per_s_vs_k1"] == 1.0
    # memory: the planner's stage totals (k=1, 1.3B: stage 0 holds 4 micro-batches)
    one = stage_memory(pr.CONFIGS["1.3b-pp4"].shape,
                       Training("bf16", distributed_optimizer=True, data_parallel_size=2),
                       4, 4, [32768])
    assert rows[0]["peak_gib"] == round(max(s["total"] for s in one) / GIB, 2)
    # Seq1F1B holds less than 1F1B; interleaving holds more at k=1
    by = {(r["config"], r["seq_length"], r["schedule"], r["k"]): r for r in rows}
    assert by[("2.7b-pp8", 32768, "seq1f1b", 4)]["peak_gib"] < \
        by[("2.7b-pp8", 32768, "1f1b", 1)]["peak_gib"] < \
        by[("2.7b-pp8", 32768, "1f1b-interleaved", 1)]["peak_gib"]
    text = table.read_text()
    assert "python -m megatron_seq1f1b.bench.predictions --calibration 1.3b-pp4=" in text
    assert "Assumed:" in text and "H200" in text and text.count("| 2.7b-pp8 |") == 12


def test_interleaved_stages_scale_the_middle_and_keep_the_ends_difference():
    def stage(x):
        return StageCosts(Fit(x, 2 * x, 1.0, 0.5), Fit(2 * x, 4 * x, 2.0, 0.5))

    cal = Calibration((stage(5.0), stage(4.0), stage(7.0)))  # first, middle, last
    virtual = pr.virtual_stage_costs(cal, 8, 0.5)
    assert len(virtual) == 8
    assert virtual[1].forward == Fit(2.0, 4.0, 0.5, 0.25)  # middle: half of everything
    assert virtual[0].forward.a == 2.0 + 1.0 and virtual[-1].forward.a == 2.0 + 3.0
    assert virtual[0].forward.d == 0.5  # the ends' difference kept: 1.0 - 1.0
    assert pr.virtual_stage_costs(cal, 3) == list(cal.stages)


def test_stage_calibrations_must_agree_on_the_quadratic(tmp_path):
    paths = []
    for i, quadratic in enumerate(("causal_pairs", "causal_pairs", "rectangle")):
        paths.append(tmp_path / f"{i}.json")
        save_calibration(Calibration((StageCosts(Fit(1.0), Fit(2.0)),), quadratic), paths[-1])
    with pytest.raises(ValueError, match="different quadratic"):
        pr.load_shape_calibration(",".join(map(str, paths)))
    with pytest.raises(ValueError, match="three one-stage files"):
        pr.load_shape_calibration(",".join(map(str, paths[:2])))


# ------------------------------------------------------------------ the GPU check


def _result(total_gib: float, measured_gib: float | None, activations_gib: float = 40.0):
    return {"rehearsal": {"peak_total_bytes": measured_gib and measured_gib * GIB,
                          "peak_bytes": activations_gib * 1.1 * GIB,
                          "peak_reserved_bytes": None, "lengths": [32768], "compute_s": 1.0,
                          "iteration_s": [1.0]},
            "predicted": {"total": total_gib * GIB, "activations": activations_gib * GIB}}


def test_judge_compares_the_cuda_peak_with_the_planner():
    assert rc.judge("x", _result(50.0, 54.0)).status == "pass"
    failed = rc.judge("x", _result(50.0, 56.0))
    assert failed.status == "fail" and "+12.0%" in failed.summary
    assert rc.judge("x", _result(50.0, None)).status == "skip"  # CPU: no allocator peak
    assert rc.activation_scale([_result(50.0, 54.0), _result(50.0, None)]) == pytest.approx(1.1)


def test_the_check_runs_rehearsals_planner_calibrations_and_predictions(tmp_path):
    """The orchestration with a stand-in for the rehearsal CLI (the CLI itself runs in
    tests/test_rehearse.py); the planner and the predictions run for real."""
    calls = []

    class FakeRunner(rc.Runner):
        def __call__(self, module, args):
            calls.append((module, list(args)))
            if module != "megatron_seq1f1b.planner.rehearse":
                return super().__call__(module, args)
            out = Path(args[args.index("--json") + 1])
            out.parent.mkdir(parents=True, exist_ok=True)  # as the CLI does
            out.write_text(json.dumps(_result(50.0, 52.0)))
            if "--save-calibration" in args:
                layers = int(args[args.index("--num-layers") + 1])
                name = "1.3b-pp4" if layers == 24 else "2.7b-pp8"
                save_calibration(flop_calibration(name),
                                 Path(args[args.index("--save-calibration") + 1]))
            return 0

    checks = rc.run_check(tmp_path, calibrate=True, runner=FakeRunner(in_process=True,
                                                                      log=lambda _: None))
    status = {c.name: c.status for c in checks}
    assert status["stage 0 of (a), k=1"] == status["stage 0 of (a), k=4"] == "pass"
    assert status["planner command line"] == "pass" and status["predictions"] == "pass"
    assert sum(name.startswith("calibration") for name in status) == 6
    rehearsals = [args for module, args in calls if module == "megatron_seq1f1b.planner.rehearse"]
    first = rehearsals[0]
    for flag, value in (("--pipeline-model-parallel-size", "4"), ("--rehearse-stage", "0"),
                        ("--seq1f1b-splits", "1"), ("--num-layers", "24"),
                        ("--seq-length", "32768"), ("--attention-backend", "flash")):
        assert first[first.index(flag) + 1] == value, flag
    assert "--use-distributed-optimizer" in first and "--bf16" in first
    stages = [(a[a.index("--num-layers") + 1], a[a.index("--rehearse-stage") + 1])
              for a in rehearsals[2:]]
    assert stages == [("24", "0"), ("24", "1"), ("24", "3"), ("32", "0"), ("32", "1"),
                      ("32", "7")]
    predictions = next(args for module, args in calls if module.endswith("predictions"))
    assert predictions[predictions.index("--activation-scale") + 1] == "1.1000"
    summary = json.loads((tmp_path / "gpu_rehearse.json").read_text())
    assert summary["tolerance"] == 0.10 and len(summary["checks"]) == len(checks)
    assert len(json.loads((tmp_path / "predictions.json").read_text())["rows"]) == 16


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=30)


@pytest.mark.parametrize("args, message", [
    ((), "give --wheels DIR"), (("--bogus",), "unknown option --bogus"),
    (("--wheels",), "--wheels needs a value"), (("--wheels", "/nonexistent"), "no such folder"),
])
def test_script_rejects_bad_arguments(args, message):
    done = sh(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_script_installs_offline_then_runs_the_check(tmp_path):
    from test_gpu_check import MCORE_WHEEL, OWN_WHEEL, wheel_folder

    wheels = wheel_folder(tmp_path / "wheels", MCORE_WHEEL, OWN_WHEEL)
    done = sh("--wheels", str(wheels), "--out", str(tmp_path / "out"), "--dry-run", "--",
              "--budget-s", "200")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("+")]
    installs = [line for line in lines if " -m pip install " in line]
    assert installs and all("--no-index" in line for line in installs)  # gpu_check.sh's install
    assert any(line.endswith("--no-deps megatron-core==0.19.2") for line in installs)
    assert any(line.endswith("--force-reinstall megatron-seq1f1b") for line in installs)
    assert lines[-1].endswith(f"-m megatron_seq1f1b.bench.rehearsal_check --out "
                              f"{tmp_path / 'out'} --calibrate --budget-s 200")
    done = sh("--no-install", "--no-calibrate", "--dry-run", "--out", str(tmp_path / "o"))
    assert done.returncode == 0 and "--calibrate" not in done.stdout and "pip" not in done.stdout


def test_a_stuck_child_is_killed_at_the_time_limit():
    """A rehearsal that never ends (e.g. stuck in NCCL's start or exit) is killed at the
    check's time limit and reported as status 124, so the GPU run still ends in time."""
    import time

    logged = []
    runner = rc.Runner(deadline=time.monotonic() + 1.0, log=logged.append)
    start = time.monotonic()
    assert runner("timeit", ["-n", "1", "import time; time.sleep(60)"]) == 124
    assert time.monotonic() - start < 20 and "killed" in logged[-1]
