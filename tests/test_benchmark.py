"""scripts/benchmark.py end to end on 2 CPU ranks with a tiny model."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "benchmark.py"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_benchmark(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """scripts/benchmark.py under torchrun on ``nproc`` CPU ranks; it must succeed."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               SEQ1F1B_TIMEOUT_MINUTES="2")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={_port()}", str(SCRIPT), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_benchmark_reports_every_schedule(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    done = run_benchmark(2, "--pp", "2", "--vpp", "2", "--microbatches", "2", "--splits", "2",
                         "--seq-length", "32", "--hidden-size", "16", "--num-layers", "4",
                         "--num-attention-heads", "2", "--vocab-size", "64", "--iters", "2",
                         "--warmup", "1", "--timeline-runs", "2", "--calib-reps", "1",
                         "--calib-mode", "isolated", "--predict-pp", "2", "4",
                         "--predict-microbatches", "4", "--out", str(out))
    assert "first-iteration loss" in done.stdout and "OK" in done.stdout, done.stdout[-3000:]

    result = json.loads((out / "results.json").read_text())
    rows = {row["key"]: row for row in result["schedules"]}
    assert set(rows) == {"1f1b", "seq1f1b-k1", "seq1f1b-uniform", "seq1f1b-balanced",
                         "1f1b-interleaved", "seq1f1b-interleaved"}
    for key, row in rows.items():
        assert row["tokens_per_s"] > 0, key
        assert len(row["times_s"]) == 2, key
        assert "speedup_vs_1f1b" in row and row["speedup_vs_1f1b"] > 0, key
        assert len(row["peak_ratio_vs_1f1b"]) == 2, key
        assert len(row["peak_bytes_per_stage"]) == 2, key
        assert row["prediction"]["makespan_s"] > 0, key
        assert row["timeline"]["makespan_s"] > 0, key
        assert len(row["timeline"]["makespans_s"]) == 2, key
    assert rows["1f1b"]["speedup_vs_1f1b"] == 1.0
    assert "speedup_vs_1f1b_interleaved" in rows["seq1f1b-interleaved"]
    losses = [row["first_iteration_loss"] for row in rows.values()]
    assert max(losses) - min(losses) <= 1e-4 * abs(losses[0])
    assert [(r["p"], r["m"]) for r in result["predictions"]] == [(2, 4), (4, 4)]

    assert (out / "benchmark.png").stat().st_size > 0
    assert "| Megatron 1F1B |" in (out / "results.md").read_text()
    assert (out / "timeline_seq1f1b-uniform_measured.png").exists()
    assert (out / "timeline_seq1f1b-uniform_simulated.png").exists()
    trace = json.loads((out / "timeline_seq1f1b-uniform_measured.json").read_text())
    assert trace["traceEvents"]


@pytest.mark.skipif(importlib.util.find_spec("megatron.core.models.hybrid") is None,
                    reason="HybridModel is in megatron-core 0.18 and later")
def test_benchmark_hybrid_pattern_with_a_stage_without_attention(tmp_path):
    """'--|*-*-': the pattern begins with '-' (read as a value, not an option), and stage 0 has
    no attention layer, so each rank cuts the balanced split with the backend's attention
    (local: dense, [38, 33, 30, 27]; by stage 0's own, none, [39, 33, 30, 26], which the
    stages would refuse to run together); the losses equal Megatron's 1F1B."""
    out = tmp_path / "bench"
    run_benchmark(2, "--pp", "2", "--microbatches", "2", "--splits", "4", "--seq-length", "128",
                  "--hidden-size", "16", "--hybrid-layer-pattern", "--|*-*-",
                  "--num-attention-heads", "4", "--vocab-size", "64", "--iters", "1",
                  "--warmup", "0", "--no-calibration", "--no-timelines", "--schedules", "1f1b",
                  "seq1f1b-balanced", "--out", str(out))
    rows = json.loads((out / "results.json").read_text())["schedules"]
    assert rows[1]["lengths"] == [38, 33, 30, 27]
    losses = [row["first_iteration_loss"] for row in rows]
    assert abs(losses[1] - losses[0]) <= 1e-6 * abs(losses[0])


@pytest.mark.skipif(os.environ.get("SEQ1F1B_FULL") != "1",
                    reason="SEQ1F1B_FULL=1 runs it (25 s; zero bubble's exactness is tested in "
                           "test_zero_bubble, the benchmark's rows in test_benchmark_reports_every_schedule)")
def test_benchmark_zero_bubble_rows(tmp_path):
    """Opt-in zero-bubble rows run beside Megatron 1F1B and Seq1F1B, compared with Seq1F1B
    (on a sliding-window MoE model: every schedule's loss must agree with Megatron's)."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "zb"
    run_benchmark(2, "--pp", "2", "--microbatches", "2", "--splits", "2", "--seq-length",
                  "32", "--hidden-size", "16", "--num-layers", "2", "--num-attention-heads",
                  "2", "--vocab-size", "64", "--iters", "2", "--warmup", "1",
                  "--timeline-runs", "1", "--calib-reps", "1", "--calib-mode", "isolated",
                  "--predict-pp", "4", "--predict-microbatches", "4", "--schedules", "1f1b",
                  "seq1f1b-balanced", "seq1f1b-zb-h1", "seq1f1b-zb-h2", "--window-size",
                  "10", "--num-experts", "4", "--out", str(out))
    result = json.loads((out / "results.json").read_text())
    assert "sliding window 10, MoE 4 experts" in (out / "results.md").read_text()
    rows = {row["key"]: row for row in result["schedules"]}
    for key in ("seq1f1b-zb-h1", "seq1f1b-zb-h2"):
        versus = rows[key]["vs_seq1f1b"]
        assert versus["key"] == "seq1f1b-balanced" and versus["speedup"] > 0
        assert versus["bubble_ratio"] is not None and "stage0_peak_ratio" in versus  # tiny: 0 B
        assert rows[key]["prediction"]["makespan_s"] > 0
    # Predicted from this tiny run's noisy calibration: present and sane (that ZB-H1's bubble is
    # smaller at equal costs is proven deterministically in tests/test_zero_bubble.py).
    predicted = result["predictions"][0]["schedules"]
    for key in ("seq1f1b-zb-h1", "seq1f1b-balanced"):
        assert 0 <= predicted[key]["bubble_fraction"] < 1, predicted[key]
    assert "Zero bubble against Seq1F1B" in (out / "results.md").read_text()
    trace = json.loads((out / "timeline_seq1f1b-zb-h1_measured.json").read_text())
    assert any(e.get("cat") == "weight-gradient" for e in trace["traceEvents"])


@pytest.mark.skipif(os.environ.get("SEQ1F1B_FULL") != "1",
                    reason="SEQ1F1B_FULL=1 runs it (20 s; the auto plan is tested in test_auto and "
                           "the trainer's test_auto_plan_measures_chooses_within_budget...)")
def test_benchmark_auto_plan_beside_a_sweep(tmp_path):
    """--splits auto: calibrate first, run the planner's choice beside k=1, 2; report the
    ratio against the best k and the plan's prediction error."""
    out = tmp_path / "auto"
    done = run_benchmark(2, "--pp", "2", "--microbatches", "2", "--splits", "auto",
                         "--sweep-splits", "1", "2", "--min-segment-length", "16", "--seq-length",
                         "64", "--hidden-size", "16", "--num-layers", "2", "--num-attention-heads",
                         "2", "--vocab-size", "64", "--iters", "2", "--warmup", "1",
                         "--no-timelines", "--calib-reps", "1", "--calib-mode", "concurrent",
                         "--predict-pp", "2", "--predict-microbatches", "2", "--confirm-rounds",
                         "2", "--confirm-rivals", "1", "--out", str(out))
    assert "first-iteration loss" in done.stdout and "OK)" in done.stdout, done.stdout[-3000:]
    assert "> auto plan from the concurrent calibration" in done.stdout  # the planner's table
    assert " wins: " in done.stdout

    result = json.loads((out / "results.json").read_text())
    rows = {row["key"]: row for row in result["schedules"]}
    assert list(rows) == ["1f1b", "seq1f1b-k1", "seq1f1b-k2", "seq1f1b-auto"]
    assert rows["seq1f1b-k1"]["lengths"] == [64] and sum(rows["seq1f1b-k2"]["lengths"]) == 64
    auto, plan = result["auto_plan"], result["auto_plan"]["plan"]
    assert 1 <= plan["k"] <= 4 and sum(plan["lengths"]) == 64 and len(plan["lengths"]) == plan["k"]
    assert plan["k"] == 1 or min(plan["lengths"]) >= 16
    assert rows["seq1f1b-auto"]["lengths"] == plan["lengths"]
    assert rows["seq1f1b-auto"]["label"].startswith(f"Seq1F1B auto (k={plan['k']}, ")
    assert plan["predicted_s"] > 0 and plan["timing"] == "gloo"  # the executor's on gloo
    assert auto["prediction_error"] == pytest.approx(
        plan["predicted_s"] / rows["seq1f1b-auto"]["median_s"] - 1)
    assert auto["best_key"] in ("seq1f1b-k1", "seq1f1b-k2") and auto["best_k"] in (1, 2)
    best = max(rows["seq1f1b-k1"]["tokens_per_s"], rows["seq1f1b-k2"]["tokens_per_s"])
    assert auto["best_tokens_per_s"] == best
    assert auto["ratio"] == pytest.approx(rows["seq1f1b-auto"]["tokens_per_s"] / best)
    assert auto["paired_ratio"] > 0
    confirmed = auto["confirmation"]  # new runs of auto and the fastest sweep row decide
    assert confirmed["rounds"] == 2 and confirmed["against"] in ("seq1f1b-k1", "seq1f1b-k2")
    assert list(confirmed["rivals"]) == [confirmed["against"]]
    assert len(confirmed["rivals"][confirmed["against"]]["ratios"]) == 2
    assert confirmed["rivals"][confirmed["against"]]["rounds"] == 2 and confirmed["looks"] == [2]
    twin = next((key for key in ("seq1f1b-k1", "seq1f1b-k2")  # runs auto's own plan
                 if rows[key]["lengths"] == plan["lengths"] and plan["schedule"] == "1f1b"), None)
    assert (confirmed["same_plan"] or {}).get("key") == twin and confirmed["against"] != twin
    assert auto["hit"] == (confirmed["ratio"] >= 0.97)
    assert "[confirm 2/2]" in done.stdout
    assert "seq1f1b-auto" in result["predictions"][0]["schedules"]
    text = (out / "results.md").read_text()
    assert "## Automatic plan vs a sweep of k" in text and "prediction error" in text
    assert "Confirmation (2 of at most 2 more rounds" in text and "| decided |" in text
    assert "Automatic plan vs a sweep of k" in done.stdout  # results.md is printed


# SEQ1F1B_FULL=1 adds the local backend (its documents are a dense mask; the flash row is the one
# long-context training runs)
@pytest.mark.parametrize("backend", ["flash", "local"] if os.environ.get("SEQ1F1B_FULL") == "1"
                         else ["flash"])
def test_benchmark_packed_documents(tmp_path, backend):
    """--document-length: every schedule trains the same long-tailed packed documents in its
    backend's form (losses agree); the documents row evens out segment costs."""
    out = tmp_path / backend
    done = run_benchmark(2, "--pp", "2", "--microbatches", "2", "--splits", "2", "--seq-length",
                         "64", "--hidden-size", "16", "--num-layers", "2", "--num-attention-heads",
                         "2", "--vocab-size", "64", "--iters", "2", "--warmup", "1",
                         "--timeline-runs", "1", "--no-calibration", "--attention-backend",
                         backend, "--document-length", "12", "--schedules", "1f1b",
                         "seq1f1b-balanced", "seq1f1b-documents", "--out", str(out),
                         *(["--profile-ops"] if backend == "flash" else ["--profile"]))
    assert "first-iteration loss" in done.stdout and "OK)" in done.stdout, done.stdout[-3000:]
    if backend == "local":  # cProfile: a text report and the raw statistics per schedule
        import pstats

        assert "Ordered by: internal time" in (out / "profile_1f1b_rank0.txt").read_text()
        raw = pstats.Stats(str(out / "profile_seq1f1b-documents_rank0.prof")).stats
        assert any(name == "execute" for _, _, name in raw)  # the Seq1F1B executor ran
    if backend == "flash":  # the operator profile: every row, the carry-over's own operators
        table = (out / "ops_rank0.md").read_text()
        assert table.startswith("| operator | 1f1b calls | 1f1b ms | seq1f1b-balanced calls")
        assert "`_CausalSpans" in table and "**all operators**" in table
        assert (out / "ops_seq1f1b-documents_rank0.txt").exists()

    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["attention_backend"] == backend
    assert result["meta"]["document_length"] == 12
    rows = {row["key"]: row for row in result["schedules"]}
    assert list(rows) == ["1f1b", "seq1f1b-balanced", "seq1f1b-documents"]
    forms = {"flash": ("packed", "packed"), "local": ("megatron-local", "seq1f1b-local")}[backend]
    assert (rows["1f1b"]["form"], rows["seq1f1b-documents"]["form"]) == forms
    for key, row in rows.items():
        docs = row["documents"]
        assert docs["cost_spread"] >= 1 and 0 <= docs["attention_pairs_skipped"] < 1, key
        assert len(docs["segments_per_microbatch"]) == 2, key
        assert row["tokens_per_s"] > 0 and row["timeline"]["bubble_fraction"] >= 0, key
    assert rows["seq1f1b-documents"]["documents"]["cost_spread"] <= \
        rows["seq1f1b-balanced"]["documents"]["cost_spread"]
    assert rows["1f1b"]["documents"]["cost_spread"] == 1.0
    assert (rows["1f1b"]["documents"]["attention_pairs_skipped"] > 0) == (backend == "flash")
    text = (out / "results.md").read_text()
    assert f"{backend} attention, packed documents (mean 12 tokens)" in text
    assert "## Packed documents" in text


@pytest.mark.skipif(os.environ.get("SEQ1F1B_FULL") != "1",
                    reason="SEQ1F1B_FULL=1 runs it (35 s; CP exactness and bytes are tested in test_context_parallel, the report in test_bench)")
def test_benchmark_context_parallel(tmp_path):
    """--pp 2 --cp 2 on 4 ranks: Seq1F1B rows only, seq1f1b-k1 the reference; the CP bytes
    the executor counted equal the planner's count, and every row has a predicted stage-0
    memory."""
    out = tmp_path / "cp"
    done = run_benchmark(4, "--pp", "2", "--cp", "2", "--microbatches", "2", "--splits", "2",
                         "--seq-length", "64", "--hidden-size", "16", "--num-layers", "4",
                         "--num-attention-heads", "2", "--vocab-size", "64", "--iters", "1",
                         "--warmup", "1", "--no-timelines", "--count-saved", "--out", str(out))
    assert "--cp 2: Seq1F1B rows only, reference seq1f1b-k1" in done.stdout

    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["context_parallel_size"] == 2 and result["meta"]["dp"] == 1
    assert result["meta"]["reference"] == "seq1f1b-k1"
    assert result["meta"]["tokens_per_iteration"] == 2 * 64  # the sequence once per CP group
    rows = {row["key"]: row for row in result["schedules"]}
    assert list(rows) == ["seq1f1b-k1", "seq1f1b-uniform", "seq1f1b-balanced"]
    assert rows["seq1f1b-k1"]["speedup_vs_1f1b"] == 1.0
    # keys and values of 2 layers x 64 tokens / 2 ranks x (cp - 1), forward and backward,
    # x 2 micro-batches, fp32: 2 x 2 heads x 8 channels x 4 bytes per token and layer
    expected = 2 * 64 / 2 * 1 * (2 * 2 * 8 * 4) * 2 * 2
    for key, row in rows.items():
        assert row["cp_bytes_predicted"] == expected, key
        assert row["cp_bytes_measured"] == pytest.approx(expected, rel=0.05), key
        assert row["stage0_predicted_bytes"] > 0, key
        assert len(row["saved_bytes_per_stage"]) == 2 and row["saved_bytes_per_stage"][0] > 0
        assert row["stage0_saved_prediction_ratio"] > 0, key
    text = (out / "results.md").read_text()
    assert "## Context parallelism" in text and "reference row seq1f1b-k1" in text


@pytest.mark.parametrize("schedules", [["1f1b"], ["seq1f1b-k1", "1f1b-interleaved"]])
def test_benchmark_context_parallel_refuses_megatron_rows(schedules, capsys):
    from megatron_seq1f1b.bench.cli import parse_args

    extra = ["--vpp", "2"] if "1f1b-interleaved" in schedules else []
    with pytest.raises(SystemExit) as exc:
        parse_args(["--cp", "2", *extra, "--schedules", *schedules])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot run with context parallelism" in err[-1]
    assert "seq1f1b-k1 is the reference row" in err[-1]


def test_benchmark_context_parallel_lineup():
    """--cp 2 drops Megatron's rows from the default lineup and turns the calibration off;
    --context-parallel-size is the same flag."""
    from megatron_seq1f1b.bench.cli import parse_args

    args = parse_args(["--context-parallel-size", "2", "--vpp", "2"])
    assert args.context_parallel_size == 2 and args.no_calibration
    assert not any(s.startswith("1f1b") for s in args.schedules)
    assert "seq1f1b-k1" in args.schedules and "seq1f1b-interleaved" in args.schedules
    assert parse_args([]).context_parallel_size == 1


def test_compare_benchmarks_stage0_ratio(tmp_path, capsys):
    """scripts/compare_benchmarks.py: RUN / BASE stage-0 peak per shared row, --max-ratio."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compare_benchmarks
    finally:
        sys.path.pop(0)

    def write(name: str, cp: int, peak: int) -> str:
        row = {"key": "seq1f1b-k4", "peak_bytes_per_stage": [peak, 1],
               "saved_bytes_per_stage": [peak // 2, 1], "stage0_saved_prediction_ratio": 0.99,
               "stage0_prediction_ratio": 1.02, "cp_bytes_ratio": 1.0 if cp > 1 else None}
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {"context_parallel_size": cp, "world_size": 2 * cp},
                                    "schedules": [row]}))
        return str(path)

    base, run = write("cp1.json", 1, 100 * 2**20), write("cp2.json", 2, 55 * 2**20)
    assert compare_benchmarks.main([base, run, "--max-ratio", "0.6"]) == 0
    printed = capsys.readouterr().out
    assert "| seq1f1b-k4 | 100.0 (1.020) | 55.0 (1.020) | 0.550 | 1.000 |" in printed
    assert compare_benchmarks.main([base, run, "--max-ratio", "0.5"]) == 1
    capsys.readouterr()
    assert compare_benchmarks.main([base, run, "--measure", "saved", "--max-ratio", "0.6"]) == 0
    assert "| seq1f1b-k4 | 50.0 (0.990) | 27.5 (0.990) | 0.550 | 1.000 |" in \
        capsys.readouterr().out


def test_operator_profile_side_by_side():
    """The table puts first the operators whose time differs most from the baseline's and
    counts what one row runs that the other does not."""
    from megatron_seq1f1b.bench.op_profile import OpTotals, side_by_side

    table = side_by_side({"1f1b": OpTotals({"aten::mm": (4, 10.0), "aten::fill_": (1, 1.0)}),
                          "seq": OpTotals({"aten::mm": (16, 11.0), "aten::fill_": (9, 6.0),
                                           "KVAppend": (8, 2.0)})}, rows=2)
    lines = table.splitlines()
    assert lines[0] == "| operator | 1f1b calls | 1f1b ms | seq calls | seq ms |"
    assert lines[2] == "| `aten::fill_` | 1 | 1.0 | 9 | 6.0 |"
    assert lines[3] == "| `KVAppend` | 0 | 0.0 | 8 | 2.0 |"
    assert lines[4] == "| **all operators** | 5 | 11.0 | 33 | 19.0 |"


@pytest.mark.parametrize("flag", [["--schedules", "1f1b"], ["--sweep-splits", "2"],
                                  ["--confirm-rounds", "2"], ["--memory-budget", "2"]])
def test_variable_lengths_refuses_the_flags_it_would_ignore(flag, capsys):
    from megatron_seq1f1b.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--attention-backend", "flash", "--variable-lengths", "lognormal", *flag])
    assert f"{flag[0] if flag[0] != '--memory-budget' else '--memory-budget-microbatches'} "\
        "would be ignored" in capsys.readouterr().err


def test_benchmark_variable_lengths(tmp_path):
    """--variable-lengths: Megatron's 1F1B as the micro-batches come and regrouped to equal
    tokens, Seq1F1B with a fixed k and a token budget (and its runs of documents apart), on
    the same sequences; every row the same loss, ratios against both baselines with their parts, predictions and peaks."""
    out = tmp_path / "varlen"
    done = run_benchmark(2, "--pp", "2", "--microbatches", "4", "--splits", "2",
                         "--hidden-size", "16", "--num-layers", "2", "--num-attention-heads", "2",
                         "--vocab-size", "64", "--attention-backend", "flash",
                         "--variable-lengths", "lognormal", "--length-min", "16",
                         "--length-max", "96", "--length-mu", "3.5", "--segment-tokens", "16",
                         "--iters", "2", "--warmup", "1", "--timeline-runs", "1",
                         "--calib-reps", "1", "--calib-mode", "concurrent", "--count-saved",
                         "--backward-by-documents", "--out", str(out))
    assert "OK" in done.stdout, done.stdout[-3000:]
    result = json.loads((out / "results.json").read_text())
    rows = {row["key"]: row for row in result["schedules"]}
    assert set(rows) == {"1f1b", "1f1b-regrouped", "seq1f1b-k2", "seq1f1b-16tok",
                         "seq1f1b-16tok-runs"}
    assert all(len(row["saved_bytes_per_stage"]) == 2 and min(row["saved_bytes_per_stage"]) > 0
               for row in rows.values())  # --count-saved: what autograd kept, per stage
    meta = result["meta"]
    assert sum(meta["microbatch_tokens"]) == sum(meta["regrouped_tokens"]) == \
        meta["tokens_per_iteration"] == sum(meta["sequence_lengths"])
    for key, row in rows.items():
        assert row["paired_vs_1f1b"] > 0 and row["paired_vs_1f1b-regrouped"] > 0, key
        assert row["predicted_s"] > 0 and row["predicted_vs_1f1b"] > 0, key
        assert row["parts_vs_1f1b"] is not None, key
    assert rows["1f1b"]["paired_vs_1f1b"] == 1.0
    assert "vs Megatron regrouped" in (out / "results.md").read_text()
