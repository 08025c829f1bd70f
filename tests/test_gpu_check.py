"""scripts/gpu_check.sh and megatron_seq1f1b.bench.gpu_check, without a GPU.

What runs here: the script's argument handling (``--dry-run`` prints the
commands it would run), the one-line failure without CUDA, the JSON summary
and table, the comparison helpers, and the comparison itself on CPU (gloo)
through the module's private path, with injected errors it must catch. What
needs the GPU (NCCL, CUDA memory, Transformer Engine, the bf16 trainer) is
left to the check's own run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_seq1f1b.bench import gpu_check as gc
from megatron_seq1f1b.bench import gpu_verdicts as gv

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MCORE_WHEEL = "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
OWN_WHEEL = "megatron_seq1f1b-0.1.0-py3-none-any.whl"
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--vocab-size", "64", "--microbatches", "2", "--splits", "4"]


def sh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=30, env=env)


def wheel_folder(path: Path, *names: str) -> Path:
    path.mkdir()
    for name in names:
        (path / name).write_bytes(b"")
    return path


# ---------------------------------------------------------------- the script


@pytest.mark.parametrize("args, message", [
    ((), "give --wheels DIR"),
    (("--bogus",), "unknown option --bogus"),
    (("--wheels",), "--wheels needs a value"),
    (("--wheels", "--out", "x"), "--wheels needs a value"),
    (("--wheels", "/nonexistent/wheels"), "no such folder"),
    (("--prepare-wheels", "a", "--wheels", "b"), "separate steps"),
    (("--prepare-wheels", "a", "--python-version", "312"), "must look like 3.12"),
])
def test_script_rejects_bad_arguments(args, message):
    done = sh(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and done.stderr.startswith("gpu_check.sh: ")


def test_script_help_names_both_steps():
    done = sh("--help")
    assert done.returncode == 0
    assert "--prepare-wheels DIR" in done.stdout and "--wheels DIR" in done.stdout
    assert "network" in done.stdout


@pytest.mark.parametrize("names, message", [
    ((), "no megatron_core-*.whl"),
    ((MCORE_WHEEL,), "no megatron_seq1f1b-*.whl"),
    ((MCORE_WHEEL, MCORE_WHEEL.replace("0.19.2", "0.18.2"), OWN_WHEEL), "several megatron-core"),
])
def test_script_checks_the_wheel_folder(tmp_path, names, message):
    folder = wheel_folder(tmp_path / "wheels", *names)
    done = sh("--wheels", str(folder), "--dry-run")
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_script_installs_offline_then_runs_the_check(tmp_path):
    folder = wheel_folder(tmp_path / "wheels", MCORE_WHEEL, OWN_WHEEL)
    out, venv = tmp_path / "out", tmp_path / "venv"
    done = sh("--wheels", str(folder), "--out", str(out), "--venv", str(venv), "--dry-run",
              "--", "--no-trainer", "--dtypes", "bf16")
    assert done.returncode == 0, done.stderr
    commands = [line[2:] for line in done.stdout.splitlines() if line.startswith("+ ")]
    py = f"{venv}/bin/python"
    assert commands[0] == f"python3 -m venv --system-site-packages {venv}"
    installs = [c for c in commands if " -m pip install " in c]
    assert installs and all(c.startswith(py) for c in installs)
    assert all(f"--no-index --find-links {folder}" in c for c in installs)
    assert any(c.endswith("--no-deps megatron-core==0.19.2") for c in installs)
    assert any(c.endswith("--no-deps --force-reinstall megatron-seq1f1b") for c in installs)
    assert not any(" download " in c or "index-url" in c for c in commands)
    assert f"cd {out}" in commands
    assert commands[-1] == (f"{py} -m megatron_seq1f1b.bench.gpu_check --out {out} --pretrain-script "
                            f"{ROOT}/scripts/pretrain_gpt.py --no-trainer --dtypes bf16")
    assert not out.exists() and not venv.exists()  # a dry run runs nothing


def test_script_prepares_wheels_for_python_312_manylinux(tmp_path):
    done = sh("--prepare-wheels", str(tmp_path / "w"), "--dry-run",
              env=dict(os.environ, PYTHON="py"))
    assert done.returncode == 0, done.stderr
    commands = [line[2:] for line in done.stdout.splitlines() if line.startswith("+ ")]
    downloads = [c for c in commands if c.startswith("py -m pip download ")]
    assert len(downloads) == 2 and downloads[0].endswith(" megatron-core==0.19.2")
    for flags in ("--no-deps", "--only-binary=:all:", "--python-version 3.12", "--abi cp312",
                  "--platform=manylinux_2_28_x86_64", f"--dest {tmp_path / 'w'}"):
        assert all(flags in c for c in downloads), flags
    assert any(c.startswith("py -m pip wheel ") and f"--wheel-dir {tmp_path / 'w'}" in c
               for c in commands)
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------- no CUDA


def test_without_cuda_the_check_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("gpu_check: FAIL: ")
    assert "CUDA" in err and "NVIDIA GPU" in err
    report = json.loads((tmp_path / gv.SUMMARY_FILE).read_text())
    assert report["passed"] is False and report["checks"][0]["status"] == "fail"


def test_bad_check_options_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        gc.build_parser().parse_args(["--out", "x", "--backends", "local,fused"])
    assert exit_.value.code == 2 and \
        "comma-separated list of local, flash, te" in capsys.readouterr().err


# ---------------------------------------------------------------- summary


def test_summary_json_and_table(tmp_path):
    checks = [
        gv.Check("seq1f1b = full: local fp32", "pass", "loss rel 1e-08", {"loss_rel_err": 1e-8}, 2.5),
        gv.Check("seq1f1b = full: te fp32", "skip", "transformer_engine is not installed"),
        gv.Check("trainer: seq1f1b bf16, 20 iters", "fail", "exit status 1: OOM", {}, 61.0),
    ]
    env = {"device": "NVIDIA H200", "torch": "2.9.0", "megatron_core": "0.19.2"}
    path = gv.write_summary(tmp_path / "out", env, {"splits": 4}, checks, 70.2)
    report = json.loads(path.read_text())
    assert path.name == "gpu_check.json"
    assert report["passed"] is False and report["counts"] == {"pass": 1, "fail": 1, "skip": 1}
    assert report["environment"]["device"] == "NVIDIA H200" and report["settings"]["splits"] == 4
    assert [c["status"] for c in report["checks"]] == ["pass", "skip", "fail"]
    assert report["checks"][0]["numbers"]["loss_rel_err"] == 1e-8
    table = gv.format_table(checks).splitlines()
    assert len(table) == 2 + len(checks) and set(table[1]) == {"-"}
    assert table[2].split()[:6] == ["seq1f1b", "=", "full:", "local", "fp32", "PASS"]
    assert "FAIL" in table[4] and table[4].endswith("exit status 1: OOM")
    report = json.loads(gv.write_summary(tmp_path / "out", env, {}, checks[:2], 1.0).read_text())
    assert report["passed"] is True


# ---------------------------------------------------------------- comparisons


def grads(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(8, 4, generator=gen), "b.bias": torch.randn(4, generator=gen)}


def test_relative_error_and_cosine():
    x = torch.tensor([1.0, -4.0, 0.0])
    assert gv.max_relative_error(x, x) == 0.0
    assert gv.max_relative_error(x + torch.tensor([0.0, 0.0, 4e-5]), x) == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="shapes differ"):
        gv.max_relative_error(x, x[:2])
    assert gv.cosine_similarity(x, 3 * x) == pytest.approx(1.0)
    assert gv.cosine_similarity(x, -x) == pytest.approx(-1.0)
    assert gv.cosine_similarity(torch.zeros(3), torch.zeros(3)) == 1.0
    assert gv.cosine_similarity(x, torch.zeros(3)) == 0.0
    ref = grads()
    assert gv.overall_cosine(ref, {n: 2 * g for n, g in ref.items()}) == pytest.approx(1.0)
    assert gv.overall_cosine(ref, grads(seed=1)) < 0.5


def test_fp32_judge_passes_rounding_and_catches_one_wrong_gradient():
    ref = grads()
    close = {n: g * (1 + 1e-7) for n, g in ref.items()}
    verdict = gv.judge_exact(2.0, 2.0 * (1 + 1e-7), ref, close)
    assert verdict.status == "pass" and verdict.numbers["params_compared"] == 2
    wrong = dict(close, **{"b.bias": ref["b.bias"] * (1 + 1e-4)})
    verdict = gv.judge_exact(2.0, 2.0, ref, wrong)
    assert verdict.status == "fail" and verdict.numbers["params_over"] == ["b.bias"]
    assert "1 of 2 gradients over rel 1e-05" in verdict.summary and "b.bias" in verdict.summary
    assert gv.judge_exact(2.0, 2.0001, ref, close).status == "fail"  # loss rel 5e-5
    assert gv.judge_exact(2.0, float("nan"), ref, close).status == "fail"
    missing = gv.judge_exact(2.0, 2.0, ref, dict(close, **{"a.weight": None}))
    assert missing.status == "fail" and "a.weight: no Seq1F1B gradient" in missing.summary


def test_bf16_judge_uses_the_overall_cosine():
    ref = grads()
    gen = torch.Generator().manual_seed(5)
    noisy = {n: g + 0.01 * g.abs().mean() * torch.randn(g.shape, generator=gen)
             for n, g in ref.items()}
    verdict = gv.judge_cosine(3.0, 3.01, ref, noisy)  # loss rel 3.3e-3, noise ~1%
    assert verdict.status == "pass" and verdict.numbers["cosine_overall"] > 0.999
    assert "overall" in verdict.numbers["criterion"]
    other = dict(noisy, **{"a.weight": grads(seed=3)["a.weight"]})
    verdict = gv.judge_cosine(3.0, 3.0, ref, other)
    assert verdict.status == "fail" and "overall gradient cosine" in verdict.summary
    assert verdict.numbers["cosine_min_param_name"] == "a.weight"
    assert gv.judge_cosine(3.0, 3.05, ref, noisy).status == "fail"  # loss rel 1.7e-2


def test_transformer_engine_fp32_is_judged_as_tf32():
    """TE's fp32 GEMMs run in TF32: 1e-4 noise passes there, not with Megatron's local layers."""
    ref = grads()
    gen = torch.Generator().manual_seed(9)
    tf32 = {n: g * (1 + 1e-4 * torch.randn(g.shape, generator=gen)) for n, g in ref.items()}
    assert gv.judge_for("local", "fp32")(2.0, 2.0001, ref, tf32).status == "fail"
    verdict = gv.judge_for("te", "fp32")(2.0, 2.0001, ref, tf32)
    assert verdict.status == "pass" and "0.9999" in verdict.numbers["criterion"]
    assert gv.judge_for("te", "fp32")(2.0, 2.01, ref, tf32).status == "fail"  # loss rel 5e-3
    assert gv.judge_for("local", "bf16")(2.0, 2.01, ref, tf32).status == "pass"


def test_memory_and_trainer_judges():
    assert gv.judge_memory(100 * 2**20, 80 * 2**20).status == "pass"
    assert gv.judge_memory(100 * 2**20, 151 * 2**20).status == "fail"
    assert gv.judge_memory(0, 5).status == "fail"

    def log(losses, tokens_per_s=1000.0):
        return {"summary": {"losses": losses, "tokens_per_s": tokens_per_s,
                            "mean_ms_per_iter": 4.0, "peak_gib_per_stage": [0.5]}}

    falling = [7.0 - 0.1 * i for i in range(20)]
    megatron = log(falling, 800.0)
    verdict = gv.judge_trainer(log(falling), 20, megatron)
    assert verdict.status == "pass" and verdict.numbers["tokens_per_s_ratio"] == 1.25
    assert gv.judge_trainer(log(falling[:5]), 20).status == "fail"
    assert gv.judge_trainer(log([7.0] * 20), 20).status == "fail"
    assert gv.judge_trainer(log(falling[:-1] + [float("nan")]), 20).status == "fail"
    shifted = [x + 0.5 for x in falling]
    assert gv.judge_trainer(log(shifted), 20, megatron).status == "fail"  # other first loss
    assert gv.judge_trainer(None, 20).status == "fail"


def test_a_failed_trainer_is_reported_by_its_own_error(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text(
        "python -m torch.distributed.run ...\n\nTraceback (most recent call last):\n"
        '  File "pretrain_gpt.py", line 70\ntorch.OutOfMemoryError: CUDA out of memory. Tried\n'
        "E1203 failed (exitcode: 1)\nTraceback (most recent call last):\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "  error_file: <N/A>\n")
    assert gc._last_error(log) == "torch.OutOfMemoryError: CUDA out of memory. Tried"


def test_trainer_command_is_accepted_by_the_trainer():
    from megatron_seq1f1b.trainer import arguments

    opts = gc.build_parser().parse_args(["--out", "x"])
    command = gc.trainer_command(opts, Path("scripts/pretrain_gpt.py"), Path("t.json"),
                                 seq1f1b=True, port=29500)
    assert command[1:6] == ["-m", "torch.distributed.run", "--nproc-per-node", "1",
                            "--master-port"]
    args = arguments.parse(command[command.index("scripts/pretrain_gpt.py") + 1:], world_size=1)
    assert args.seq1f1b and args.seq1f1b_splits == 4 and args.bf16 and args.mock_data
    assert (args.train_iters, args.num_layers, args.hidden_size, args.seq_length) == (
        20, 4, 256, 1024)
    assert args.log_json == "t.json"
    plain = gc.trainer_command(opts, Path("p.py"), Path("t.json"), seq1f1b=False, port=1)
    assert not any(flag.startswith("--seq1f1b") for flag in plain) and "--bf16" in plain
    args = arguments.parse(plain[plain.index("p.py") + 1:], world_size=1)  # accepted too
    assert not args.seq1f1b and args.num_layers == 4


# ---------------------------------------------------------------- the comparison, on CPU


def test_the_comparison_catches_injected_errors_on_cpu(tmp_path):
    """The GPU code path with device=cpu (gloo): equal runs pass; a gradient 1e-4 off and
    an off-by-one loss mask in the segments fail."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "megatron_seq1f1b.bench.gpu_check", "--out", str(tmp_path), *TINY,
         "--backends", "local,flash", "--dtypes", "fp32,bf16", "--no-trainer",
         "--_device", "cpu", "--_faults", "none,grad,shift-mask"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads((tmp_path / gv.SUMMARY_FILE).read_text())["checks"]}
    status = {name: c["status"] for name, c in checks.items()}
    assert status["process group (gloo, world size 1)"] == "pass"
    assert status["seq1f1b = full: local fp32"] == "pass", checks["seq1f1b = full: local fp32"]
    assert checks["seq1f1b = full: local fp32"]["numbers"]["grad_max_rel_err"] < 1e-5
    assert status["seq1f1b = full: local bf16"] == "pass", checks["seq1f1b = full: local bf16"]
    assert checks["seq1f1b = full: local bf16"]["numbers"]["cosine_overall"] >= 0.999
    grad_fault = checks["seq1f1b = full: local fp32 [fault grad]"]
    assert grad_fault["status"] == "fail" and grad_fault["numbers"]["params_over_count"] == 1
    assert "linear_qkv.weight" in grad_fault["summary"]
    for dtype in ("fp32", "bf16"):
        assert status[f"seq1f1b = full: local {dtype} [fault shift-mask]"] == "fail"
        memory = checks[f"peak memory: local {dtype}"]
        assert memory["status"] == "skip" and "peak_seq1f1b_mib" in memory["numbers"]
    for dtype in ("fp32", "bf16"):  # the flash backend: equal too; kernels named on GPUs only
        assert status[f"seq1f1b = full: flash {dtype}"] == "pass", \
            checks[f"seq1f1b = full: flash {dtype}"]
        assert status[f"flash kernels: {dtype}"] == "skip"
    assert status["trainer: seq1f1b bf16, 20 iters"] == "skip"
    assert "seq1f1b = full: local fp32" in done.stdout and "skipped" in done.stdout


def test_flash_kernel_verdicts():
    flash = {"pytorch_flash::flash_fwd_kernel<...>": 12, "ampere_sgemm": 40}
    efficient = {"fmha_cutlassF_f32_aligned_64x64_rf_sm80": 12}
    assert gc.judge_flash_kernels(flash, "bf16", True).status == "pass"
    assert gc.judge_flash_kernels(efficient, "bf16", True).status == "fail"
    assert "efficient" in gc.judge_flash_kernels(efficient, "fp32", True).summary
    assert "math" in gc.judge_flash_kernels({"ampere_sgemm": 3}, "fp32", True).summary
    assert gc.judge_flash_kernels(flash, "bf16", False).status == "skip"
