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
