"""scripts/gpu_bench.sh and megatron_seq1f1b.bench.gpu, without a GPU.

What runs here: the benchmark's own logic (sizes, the busy-time union, Megatron-LM's log
and command, the targets' verdicts, the table), the script's offline install in a dry run,
the clear stop without CUDA, and one whole run on CPU (gloo) with a tiny model, the path the
GPU takes with CUDA events and the profiler left out.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_seq1f1b.bench import gpu

ROOT = Path(__file__).resolve().parents[1]


def test_sizes_parse_with_default_heads():
    assert gpu.Size.parse("2048:8192") == gpu.Size(2048, 8192, 16)
    assert gpu.Size.parse("256:1024:4") == gpu.Size(256, 1024, 4)
    for bad in ("2048", "a:b", "256:1024:3", "0:64"):
        with pytest.raises(Exception):
            gpu.Size.parse(bad)


def test_busy_time_counts_overlapping_kernels_once():
    assert gpu.busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert gpu.busy_seconds([]) == 0


def test_megatron_lm_log_and_command():
    log = "\n".join(f" iteration {i}/ 8 | elapsed time per iteration (ms): {ms} | lm loss: 1"
                    for i, ms in enumerate([900.0, 300.0, 160.0, 150.0, 170.0], 1))
    assert gpu.iteration_ms(log) == 160.0  # the first two left out, then the median
    assert gpu.iteration_ms("nothing") is None
    opts = gpu.build_parser().parse_args(["--out", "x", "--megatron-lm", "/lm"])
    plain = gpu.megatron_lm_command(Path("/lm/pretrain_gpt.py"), opts.lm_size, opts, False, 1)
    ours = gpu.megatron_lm_command(Path("/lm/pretrain_gpt.py"), opts.lm_size, opts, True, 1)
    assert "--transformer-impl" in plain and "--seq1f1b" not in plain
    assert ours[len(plain):] == ["--seq1f1b", "--seq1f1b-splits", "4", "--seq1f1b-partition",
                                 "balanced"]


def _row(name, k, tokens, host, idle=0.5):
    return gpu.Row(size="s", name=name, k=k, lengths=[], units=1, tokens_per_s=tokens,
                   ms_per_iter=1.0, peak_gib=1.0, host_ms_per_unit=host, gpu_ms_per_unit=1.0,
                   gpu_idle_share=idle, syncs_per_iter=0)


def test_targets_are_judged_from_one_invocation():
    rows = [_row("Megatron-Core", None, 100, 10), _row("Seq1F1B k=1", 1, 99, 10.2),
            _row("Seq1F1B k=4", 4, 120, 11.0), _row("Seq1F1B k=8", 8, 110, 12.0),
            _row("auto", 4, 118, 11.0)]
    for row in rows:
        row.ratio = row.tokens_per_s / 100
    verdicts = gpu.targets(rows)
    assert verdicts["s: k=1 within 2% of Megatron"].endswith("ok")
    assert verdicts["s: host per segment <= 1.15x host per micro-batch"].endswith("(1.20x) MISSED")
    assert verdicts["s: auto within 3% of the best k and >= 0.98x Megatron"].endswith("ok")
    busy = [_row("Megatron-Core", None, 100, 10, 0.0), _row("Seq1F1B k=4", 4, 90, 30, 0.01)]
    assert "not judged" in gpu.targets(busy)["s: host per segment <= 1.15x host per micro-batch"]
    table = gpu.markdown(rows, {"device": "H200"}, dict(dtype="bf16", num_layers=4,
                         microbatches=4, attention_backend="local", partition="balanced"), "cmd")
    assert table.count("\n| s |") == 5 and "Command: `cmd`" in table


def test_a_failing_row_is_kept_with_its_reason_and_the_others_run(monkeypatch):
    """Out of memory inside a unit (the executor re-raises it as an ActionError's cause)
    costs that row only; every row is saved as it ends; rows after the deadline are kept
    as not run, and the targets say what is missing."""
    import torch

    from megatron_seq1f1b.runtime import executor
    from megatron_seq1f1b.runtime.executor import ActionError

    def measure(name, fb, model, batches, size, opts, units, k, lengths, detail=True):
        if k == 4:
            try:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
            except torch.cuda.OutOfMemoryError as exc:
                raise ActionError("rank 0, F0.1: CUDA out of memory") from exc
        if k == 8:
            raise ValueError("something else\nsecond line")
        row = _row(name, k, 100.0 / (k or 1) ** 0.1, 1.0)
        row.size = str(size)
        return row

    monkeypatch.setattr(gpu, "build", lambda opts, size, shape=None: (["model"], None))
    monkeypatch.setattr(gpu, "host_batches", lambda opts, size: [{}, {}])
    monkeypatch.setattr(gpu, "measure_row", measure)
    monkeypatch.setattr(executor, "resolve_lengths", lambda k, *args: [64 // k] * k)
    opts = gpu.build_parser().parse_args(["--out", "x", "--no-auto", "--splits", "1", "4", "8"])
    saved = []
    rows = gpu.bench_size(opts, gpu.Size(32, 64, 4), lambda line: None,
                          saved=lambda rows: saved.append([r.name for r in rows]))
    assert [r.name for r in rows] == ["Megatron-Core", "Seq1F1B k=1", "Seq1F1B k=4",
                                      "Seq1F1B k=8"]
    assert rows[2].note == "out of memory" and rows[2].tokens_per_s == 0
    assert rows[3].note == "failed: ValueError: something else"
    assert saved[-1] == [r.name for r in rows] and len(saved) == 4
    verdicts = gpu.targets(rows)
    assert verdicts["hidden 32, seq 64: Seq1F1B k=4"] == "MISSED: out of memory"
    assert verdicts["hidden 32, seq 64: k=1 within 2% of Megatron"].endswith("ok")
    late = gpu.bench_size(opts, gpu.Size(32, 64, 4), lambda line: None, deadline=0.0)
    assert {r.note for r in late} == {"not run: time budget spent"}
    assert "not judged" in gpu.targets(late)["hidden 32, seq 64: targets"]


def test_without_cuda_it_stops_with_a_message(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert "gpu_bench: cannot start:" in capsys.readouterr().err


def test_script_installs_offline_then_runs_the_benchmark(tmp_path):
    from test_gpu_check import MCORE_WHEEL, OWN_WHEEL, wheel_folder

    folder = wheel_folder(tmp_path / "wheels", MCORE_WHEEL, OWN_WHEEL)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), "--wheels",
                           str(folder), "--dry-run", "--", "--sizes", "256:1024"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    commands = [line[2:] for line in done.stdout.splitlines() if line.startswith("+ ")]
    assert any("--no-index" in c for c in commands)
    assert commands[-1] == (f"python3 -m megatron_seq1f1b.bench.gpu --out {ROOT}/out/gpu_bench "
                            "--sizes 256:1024")


def test_a_whole_run_on_cpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "megatron_seq1f1b.bench.gpu", "--out", str(tmp_path),
         "--_device", "cpu", "--sizes", "32:128:4", "--num-layers", "2", "--microbatches", "2",
         "--vocab-size", "64", "--dtype", "fp32", "--iters", "1", "--warmup", "1",
         "--splits", "1", "8", "--profile-k", "2"],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / gpu.RESULTS).read_text())
    rows = report["rows"]
    assert report["complete"] and not list(tmp_path.glob("*.partial"))
    assert [row["name"] for row in rows] == ["Megatron-Core", "Seq1F1B k=1", "Seq1F1B k=8", "auto"]
    assert rows[0]["ratio"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[2]["units"] == 16 and sum(rows[2]["lengths"]) == 128
    assert "chose k=" in rows[3]["note"]
    assert len(report["targets"]) == 4
    assert "| hidden 32, seq 128 | Seq1F1B k=8 |" in (tmp_path / gpu.TABLE).read_text()
    # What the host launches per segment, counted exactly: within 1.15x of Megatron's per
    # micro-batch even at k=8 (the K/V carry-over's work does not grow with k).
    assert rows[2]["ops_per_unit"] <= 1.15 * rows[0]["ops_per_unit"], rows
    assert rows[1]["ops_per_unit"] <= 1.01 * rows[0]["ops_per_unit"], rows
    assert "Self CPU" in (tmp_path / gpu.PROFILE).read_text()


# ---------------------------------------------------------------- long sequences


def test_long_sequence_run_on_cpu_with_shrunk_models(tmp_path):
    """gpu_long's path on tiny stand-ins of the 1.3B and 7B stages (hidden / 32): rows, unit
    times, a calibration the planner loads, the longest-sequence probe, the table."""
    from megatron_seq1f1b.bench import gpu_long
    from megatron_seq1f1b.planner import load_calibration

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "megatron_seq1f1b.bench.gpu_long", "--out", str(tmp_path),
         "--_device", "cpu", "--_shrink", "32", "--runs", "1.3b:128", "--vocab-size", "64",
         "--dtype", "fp32", "--iters", "1", "--warmup", "1", "--splits", "1", "4",
         "--longest", "256"],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / gpu_long.RESULTS).read_text())
    (run,) = report["runs"]
    assert [r["name"] for r in run["rows"]] == [
        "Megatron-Core", "Seq1F1B k=1", "Seq1F1B k=4 balanced", "Seq1F1B k=4 uniform"]
    assert {u["length"] for u in run["unit_times"]} == {128, 64}  # 1 and 2 splits of 64
    assert all(u["weight_ms"] is not None for u in run["unit_times"])
    calibration = load_calibration(tmp_path / run["calibration"])
    assert calibration.stages[0].weight is not None and calibration.unit == "s"
    assert report["complete"] and report["longest"][0]["fits"] is True
    assert "1.3b stage, 32768 tokens: k=4 at most 5% longer than k=1" not in report["targets"]
    assert "Longest sequence that trains" in (tmp_path / gpu_long.TABLE).read_text()


def test_longest_probe_stops_at_the_first_length_out_of_memory(monkeypatch):
    """Out of memory inside a unit reaches the probe as an ActionError's cause: that length
    does not fit, the probe moves to the next schedule, and every step is saved."""
    import torch

    from megatron_seq1f1b.bench import gpu_long
    from megatron_seq1f1b.runtime.executor import ActionError

    def iteration(fb, model, batches, size):
        if size.seq > 100:
            try:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
            except torch.cuda.OutOfMemoryError as exc:
                raise ActionError("rank 0, F0.3 failed") from exc

    monkeypatch.setattr(gpu, "build", lambda opts, size, shape=None: (["model"], None))
    monkeypatch.setattr(gpu, "host_batches", lambda opts, size: [{}])
    monkeypatch.setattr(gpu, "_iteration", iteration)
    opts = gpu_long.build_parser().parse_args(["--out", "x", "--longest", "64", "128", "256"])
    saved = []
    rows = gpu_long.longest(opts, lambda line: None, float("inf"), saved.append)
    assert [(r["schedule"], r["seq_length"], r["fits"]) for r in rows] == [
        ("Megatron-Core", 64, True), ("Megatron-Core", 128, False),
        ("Seq1F1B k=8", 64, True), ("Seq1F1B k=8", 128, False)]
    assert rows[1]["note"] == "out of memory" and len(saved) == 4


def test_long_sequence_targets():
    from megatron_seq1f1b.bench import gpu_long

    rows = [{"name": "Seq1F1B k=1", "ms_per_iter": 100.0, "tokens_per_s": 10.0, "note": ""},
            {"name": "Seq1F1B k=4 balanced", "ms_per_iter": 104.0, "tokens_per_s": 9.6,
             "note": ""}]
    longest = [{"schedule": "Megatron-Core", "seq_length": 65536, "fits": True},
               {"schedule": "Megatron-Core", "seq_length": 131072, "fits": False},
               {"schedule": "Seq1F1B k=8", "seq_length": 65536, "fits": True},
               {"schedule": "Seq1F1B k=8", "seq_length": 131072, "fits": True}]
    verdicts = gpu_long.targets([{"config": "1.3b", "seq_length": 32768, "rows": rows}], longest)
    assert verdicts["1.3b stage, 32768 tokens: k=4 at most 5% longer than k=1"] == "+4.0% ok"
    failed = [rows[0], dict(rows[1], tokens_per_s=0.0, ms_per_iter=0.0, note="out of memory")]
    assert gpu_long.targets([{"config": "1.3b", "seq_length": 32768, "rows": failed}], [])[
        "1.3b stage, 32768 tokens: k=4 at most 5% longer than k=1"] == (
        "MISSED: k=1 ran, k=4 out of memory")
    assert verdicts["1.3b stage, longest that trains, Megatron-Core"] == "65536 tokens"
    assert verdicts["1.3b stage, longest that trains, Seq1F1B k=8"] == "131072 tokens"
    with pytest.raises(SystemExit):
        gpu_long.build_parser().parse_args(["--out", "x", "--runs", "13b:1024"])
