"""What the planner's command line says beside its choice (issue #57, item 4): Megatron-Core's
own schedules with speed and memory ratios, whether memory was checked, and advice that never
names a value already in force."""

import json

import pytest

from megatron_seq1f1b import planner
from megatron_seq1f1b.planner import GIB, choose_plan

SMALL = ["--seq-length", "8192", "--pp", "4", "--microbatches", "8", "--hidden-size", "1024",
         "--num-layers", "8", "--num-attention-heads", "8"]
VOCAB = ["--vocab-size", "32000"]


def _run(argv, capsys, tmp_path=None):
    extra = ["--json", str(tmp_path / "plan.json")] if tmp_path else []
    assert planner.main(argv + extra) == 0
    out = capsys.readouterr().out.splitlines()
    return out, (json.loads((tmp_path / "plan.json").read_text()) if tmp_path else None)


def _line(lines, start):
    return next(line for line in lines if line.strip().startswith(start))


def test_megatron_1f1b_beside_the_chosen_plan_with_its_ratios(capsys, tmp_path):
    lines, data = _run(SMALL + VOCAB, capsys, tmp_path)
    base, plan = data["baselines"]["Megatron-Core 1F1B"], data["plan"]
    assert (base["num_splits"], base["schedule"]) == (1, "1f1b")
    line = _line(lines, "vs Megatron-Core 1F1B:")
    assert f"{base['time'] / plan['time']:.2f}x its speed" in line
    assert f"activations {plan['memory_microbatches'] / base['memory_microbatches']:.2f}x" in line
    assert "busiest stage" in line and "Megatron-Core interleaved" not in "\n".join(lines)
    # the report comes right after the chosen flags
    chosen = next(i for i, text in enumerate(lines) if text.startswith("chosen:"))
    assert lines[chosen + 1].startswith("against Megatron-Core's own schedules")


def test_interleaved_plans_show_both_megatron_schedules(capsys, tmp_path):
    lines, data = _run(SMALL + VOCAB + ["--vpp", "2"], capsys, tmp_path)
    assert set(data["baselines"]) == {"Megatron-Core 1F1B", "Megatron-Core interleaved 1F1B"}
    assert _line(lines, "vs Megatron-Core 1F1B:") and _line(lines,
                                                            "vs Megatron-Core interleaved 1F1B:")
    # Megatron's interleaved 1F1B is k=1 over the chunks, as a choose_plan of it gives
    interleaved = choose_plan(8192, 4, 8, num_model_chunks=2, splits=[1], schedules=["1f1b"],
                              partitions=["uniform"],
                              calibration=planner.Calibration.from_dict(
                                  _calibration(capsys, tmp_path, SMALL + ["--vpp", "2"])))
    assert data["baselines"]["Megatron-Core interleaved 1F1B"]["time"] == \
        pytest.approx(interleaved.plan.time, rel=1e-9)


def _calibration(capsys, tmp_path, argv):
    path = tmp_path / "cal.json"
    _run(argv + ["--save-calibration", str(path)], capsys)
    return json.loads(path.read_text())


def test_an_interleaved_megatron_run_that_megatron_core_refuses_is_not_set_beside(capsys,
                                                                                  tmp_path):
    """m = 6 on 4 stages: Megatron-Core's interleaved schedule refuses it (6 % 4 = 2 < PP);
    the report said "1.19x its speed" against it."""
    lines, data = _run(SMALL[:4] + ["--microbatches", "6"] + SMALL[6:] + VOCAB + ["--vpp", "2"],
                       capsys, tmp_path)
    line = _line(lines, "Megatron-Core interleaved 1F1B:")
    assert "not predicted: Megatron-Core refuses interleaving with 6 micro-batches" in line
    assert "x its speed" not in line and "x its speed" in _line(lines, "vs Megatron-Core 1F1B:")
    assert "Megatron-Core interleaved 1F1B" not in data["baselines"]
    assert "refuses" in data["baselines_not_predicted"]["Megatron-Core interleaved 1F1B"]


def test_a_baseline_over_the_gpu_memory_is_said_not_to_fit(capsys):
    lines, _ = _run(SMALL + VOCAB + ["--gpu-memory-gib", "60"], capsys)
    assert "would not fit" not in _line(lines, "vs Megatron-Core 1F1B:")
    lines, _ = _run(SMALL[:4] + ["--microbatches", "4"] + SMALL[6:] + VOCAB
                    + ["--seq-length", "32768", "--gpu-memory-gib", "15"], capsys)
    line = _line(lines, "vs Megatron-Core 1F1B:")
    base = float(line.split(" vs ")[-1].split(" GiB")[0])
    assert base > 15 and "it would not fit the 15 GiB per GPU (--gpu-memory-gib)" in line


def test_small_models_show_mib_not_zeros(capsys):
    argv = ["--seq-length", "256", "--pp", "2", "--microbatches", "2", "--hidden-size", "64",
            "--num-layers", "4", "--num-attention-heads", "4", "--vocab-size", "512",
            "--splits", "4", "--top", "0", "--min-segment-length", "1"]
    lines, _ = _run(argv, capsys)
    text = "\n".join(lines)
    assert "0.00 GiB" not in text and "0.01 GiB" not in text and " MiB" in text
    assert _line(lines, "stage 0:").endswith(" MB)")


def test_an_output_file_that_cannot_be_written_is_one_line_not_a_traceback(capsys, tmp_path,
                                                                          monkeypatch):
    """Refused as the flags are read where the folder is not writable; where writing fails
    anyway (a full disk, /proc as root), one line after the plan, status 1."""
    import os
    from pathlib import Path

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(SystemExit) as exited:
        planner.main(SMALL + ["--json", str(tmp_path / "plan.json")])
    assert exited.value.code == 2 and "no permission" in capsys.readouterr().err
    monkeypatch.undo()

    def full(self, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    for flag in ("--json", "--save-calibration"):
        with pytest.raises(SystemExit) as exited:
            planner.main(SMALL + [flag, str(tmp_path / "out.json")])
        err = capsys.readouterr().err
        assert exited.value.code == 1 and "Traceback" not in err, err
        assert err.strip().endswith("out.json: No space left on device"), err


def test_a_measured_plan_is_given_as_flags_that_megatron_lm_runs(capsys, tmp_path):
    """A partition only a calibration computes ("measured") cannot be named by
    --seq1f1b-partition: the chosen line gives its lengths, which Megatron-LM's flags take
    (it printed --seq1f1b-partition measured, which they refuse)."""
    import argparse

    from megatron_seq1f1b import megatron_lm

    path = tmp_path / "cal.json"
    _run(SMALL + ["--save-calibration", str(path)], capsys)
    lines, data = _run(SMALL[:6] + ["--calibration", str(path), "--partitions", "measured",
                                    "--splits", "4"], capsys, tmp_path)
    flags = _line(lines, "chosen:").split()[1:]
    assert data["plan"]["partition"] == "measured" and "--seq1f1b-partition" not in flags
    parser = megatron_lm.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--seq1f1b", *flags])
    assert list(args.seq1f1b_split_lengths) == data["plan"]["lengths"]
    args.seq_length = 8192
    assert megatron_lm.args_problems(args) == []


def test_the_timing_and_a_binding_segment_cap_are_said(capsys):
    """The docs' pp 8 example: its fastest plan has --max-splits' 16 segments while 128-token
    segments would allow 256; the answer moves with the cap, so the output says so."""
    argv = ["--seq-length", "32768", "--pp", "8", "--microbatches", "16", "--hidden-size",
            "4096", "--num-layers", "32", "--num-attention-heads", "32",
            "--memory-budget-microbatches", "3"]
    lines, _ = _run(argv, capsys)
    assert _line(lines, "timed as the nccl transport") and "--timing" in lines[2]
    note = _line(lines, "(the fastest plan timed, k=16")
    assert "--max-splits 16 allows" in note and "would allow 256" in note
    lines, _ = _run(argv + ["--max-splits", "32", "--timing", "gloo"], capsys)
    assert _line(lines, "timed as the gloo transport")
    assert not any("raise --max-splits" in line for line in lines)  # k=32 is not its fastest


def test_a_one_segment_plan_names_no_partition():
    from megatron_seq1f1b.planner.choice import Plan
    from megatron_seq1f1b.planner.report import chosen_flags

    one = Plan(1, "measured", (8192,), "zb-h1", 1.0, 0.0, 1.0)
    assert chosen_flags(one) == "--seq1f1b-splits 1 --seq1f1b-schedule zb-h1"


def test_a_calibration_of_virtual_stages_cannot_time_the_plain_layout(capsys, tmp_path):
    path = tmp_path / "cal.json"
    _run(SMALL + ["--vpp", "2", "--save-calibration", str(path)], capsys)
    lines, _ = _run(["--seq-length", "8192", "--pp", "4", "--vpp", "2", "--microbatches", "8",
                     "--calibration", str(path)], capsys)
    assert "not predicted" in _line(lines, "Megatron-Core 1F1B:")
    assert "x its speed" in _line(lines, "vs Megatron-Core interleaved 1F1B:")


def test_memory_not_checked_is_said_and_set_against_common_gpus(capsys):
    lines, _ = _run(SMALL + VOCAB, capsys)
    line = _line(lines, "memory not checked (no --gpu-memory-gib)")
    assert "40 GiB fits, 80 GiB fits, 141 GiB fits" in line and "busiest stage needs" in line
    lines, _ = _run(SMALL, capsys)  # no vocabulary: no memory model at all
    assert "--vocab-size, and --gpu-memory-gib" in _line(lines, "memory not checked")
    lines, _ = _run(SMALL + VOCAB + ["--gpu-memory-gib", "60"], capsys)
    assert "of the 60 GiB per GPU (--gpu-memory-gib)" in _line(lines, "memory checked:")


def test_memory_against_gpus_says_too_small():
    from megatron_seq1f1b.planner.choice import Plan
    from megatron_seq1f1b.planner.report import memory_lines

    stage = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0,
             "total": 60 * GIB}
    plan = Plan(1, "uniform", (8,), "1f1b", 1.0, 0.0, 1.0, stages=(stage,))
    assert "40 GiB too small, 80 GiB fits, 141 GiB fits" in memory_lines(plan, None)[0]


LLAMA_8B = ["--seq-length", "32768", "--pp", "4", "--microbatches", "32", "--hidden-size",
            "4096", "--num-layers", "32", "--num-attention-heads", "32", "--num-query-groups",
            "8", "--ffn-hidden-size", "14336", "--swiglu", "--vocab-size", "128256", "--bf16",
            "--normalization", "RMSNorm", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights"]


def test_no_advice_to_set_a_flag_to_the_value_in_force():
    """Issue #57: nothing fit 80 GiB at pp 4, m 32 and the planner advised --max-splits 16,
    its default. More splits cannot shrink what does not fit here: it says so instead."""
    with pytest.raises(SystemExit) as exited:
        planner.main(LLAMA_8B + ["--gpu-memory-gib", "80"])
    text = exited.value.code
    assert text.startswith("python -m megatron_seq1f1b.planner: error: no plan fits")
    assert "--max-splits 16" not in text and "--min-segment-length 128" not in text
    assert "more splits cannot make it fit" in text


def test_advice_names_a_value_that_fits(capsys):
    """Where more splits would fit, the advice names a value that lets one fit (not the value
    in force: the first of twice, four times, ... as many that fits), and planning with it
    succeeds."""
    config = planner.cli._model_config(planner.build_parser().parse_args(SMALL))
    need = {k: choose_plan(8192, 4, 8, config=config, vocab_size=32000, splits=[k],
                           schedules=["1f1b"], partitions=["uniform"]).plan.memory
            for k in (4, 8)}
    assert need[8] < need[4]
    argv = SMALL + ["--max-splits", "4", "--memory-budget-microbatches",
                    f"{(need[4] + need[8]) / 2:.4f}", "--partitions", "uniform", "--schedules",
                    "1f1b"]
    with pytest.raises(SystemExit) as exited:
        planner.main(argv)
    assert exited.value.code.endswith("allow more splits (--max-splits 8)")
    argv[argv.index("--max-splits") + 1] = "8"
    assert planner.main(argv) == 0
    chosen = int(capsys.readouterr().out.split("chosen: --seq1f1b-splits ")[1].split()[0])
    assert 4 < chosen <= 8
