"""What a new user of the planner, rehearsal and simulator command lines trips on.

Output files that cannot be written are refused before any work; a calibration file that is
no JSON object, or was made for another pipeline, is refused in one line; memory messages
speak in the budget's unit and name the command line's flags; the simulator refuses the
flags uniform costs do not read, prints the picture paths it wrote and says where
Megatron-Core's own interleaved schedule would refuse the micro-batch count; a sequence of
no tokens is refused by the library.
"""

from __future__ import annotations

import pytest

from megatron_seq1f1b import planner, split_sequence
from megatron_seq1f1b.planner import rehearse
from megatron_seq1f1b.schedules import simulate

PLAN = ["--seq-length", "8192", "--pp", "4", "--microbatches", "4", "--splits", "1", "2",
        "--schedules", "1f1b", "--partitions", "uniform"]
MODEL = ["--hidden-size", "1024", "--num-layers", "8", "--num-attention-heads", "8"]
REHEARSE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "256", "--vocab-size", "128", "--pipeline-model-parallel-size", "4",
            "--rehearse-stage", "0", "--num-microbatches", "4"]


def _refused(call, capsys) -> str:
    """The one stderr line of a call that exits with status 2 and prints nothing else."""
    with pytest.raises(SystemExit) as exited:
        call()
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == "", (exited.value.code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_output_files_are_refused_before_any_work(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "plan.json"
    line = _refused(lambda: planner.main(PLAN + MODEL + ["--json", str(tmp_path)]), capsys)
    assert line.endswith(f"argument --json: {tmp_path} is a directory; give a file path")
    line = _refused(lambda: planner.main(PLAN + MODEL + ["--save-calibration", str(missing)]),
                    capsys)
    assert line.endswith(f"argument --save-calibration: folder {missing.parent} does not exist")
    # the rehearsal and the simulator make missing folders; a folder as the file is refused
    for flag in ("--json", "--save-calibration"):
        line = _refused(lambda: rehearse.build_parser().parse_args(
            REHEARSE + [flag, str(tmp_path)]), capsys)
        assert f"argument {flag}: {tmp_path} is a directory" in line
    assert rehearse.build_parser().parse_args(REHEARSE + ["--json", str(missing)]).json


def test_calibration_that_is_no_json_object_is_one_line(tmp_path, capsys):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    line = _refused(lambda: planner.main(PLAN + ["--calibration", str(path)]), capsys)
    assert "not a calibration: the file holds a JSON list, not an object" in line


def test_calibration_for_another_pipeline_is_refused_and_its_source_said(tmp_path, capsys):
    path = tmp_path / "cal.json"
    assert planner.main(PLAN + MODEL + ["--save-calibration", str(path)]) == 0  # 4 stages
    capsys.readouterr()
    for pp in ("2", "8"):
        line = _refused(lambda: planner.main(
            PLAN + ["--pp", pp, "--calibration", str(path)]), capsys)
        assert f"has costs for 4 virtual stages (pipeline stages x model chunks), but --pp {pp} " \
               f"plans {pp}" in line, line
    assert planner.main(PLAN + ["--calibration", str(path)]) == 0
    costs = capsys.readouterr().out.splitlines()[1]
    assert costs.startswith(f"costs: from {path}, made by the FLOP model (FLOP cost model at ")
    line = _refused(lambda: planner.main(PLAN + ["--calibration", str(path), "--layout",
                                                 "interleaved"]), capsys)
    assert "layout 'interleaved' picks the fits of a benchmark's results.json" in line
    line = _refused(lambda: planner.main(PLAN + MODEL + ["--layout", "interleaved"]), capsys)
    assert "--layout interleaved picks the fits of a --calibration results.json" in line


def test_memory_messages_speak_in_gib_and_name_the_flags(capsys):
    argv = PLAN + MODEL + ["--vocab-size", "32000", "--bf16"]
    with pytest.raises(SystemExit) as exited:  # the flags are fine, no plan fits: status 1
        planner.main(argv + ["--gpu-memory-gib", "1"])
    line = exited.value.code
    assert "no plan fits the memory budget of 1.00 GiB per GPU" in line
    assert "the smallest reachable is 2.59 GiB on its busiest stage, by k=2" in line
    # --splits chose the segment counts: no advice to raise limits that did not bind
    assert line.endswith("(lengths [4096, 4096])") and "--max-splits" not in line
    assert "micro-batches" not in line and "max_splits" not in line
    assert planner.main(argv + ["--gpu-memory-gib", "3", "--top", "0"]) == 0
    reason = next(line for line in capsys.readouterr().out.splitlines() if " wins: " in line)
    assert reason.startswith("k=2 uniform 1f1b wins: fastest within the memory budget (2.59 GiB "
                             "on its busiest stage); 1 faster plan(s) exceed it, e.g. k=1 1f1b (")
    assert "needs 3.41 GiB on its busiest stage)" in reason and "micro-batches" not in reason
    line = _refused(lambda: planner.main(PLAN + MODEL + ["--partitions", "documents"]), capsys)
    assert line.endswith("choose from uniform, balanced and measured") and "=" not in line


def test_simulator_prints_the_pictures_it_wrote(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert simulate.main(["--splits", "1", "2", "--png", str(tmp_path / "noext")]) == 0
    out = capsys.readouterr().out
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["noext.png", "noext_k1.png", "noext_k2.png"]
    assert all(str(tmp_path / name) in out for name in written), out


def test_simulator_refuses_what_uniform_costs_ignore_and_notes_megatron_interleaving(
        tmp_path, capsys):
    line = _refused(lambda: simulate.main(["--seq-length", "7", "--splits", "16"]), capsys)
    assert "--seq-length: read only with --cost attention" in line
    line = _refused(lambda: simulate.main(["--png", str(tmp_path)]), capsys)
    assert f"argument --png: {tmp_path} is a directory" in line
    assert simulate.main(["--pp", "4", "--chunks", "2", "--microbatches", "3", "--splits",
                          "1"]) == 0
    assert ("note: Megatron-Core's own interleaved schedule refuses m=3 on p=4 (its groups of "
            "PP=4 contiguous micro-batches per virtual stage must range in [PP=4, M=3])"
            in capsys.readouterr().out)
    assert simulate.megatron_interleaving_problem(4, 6) and \
        not simulate.megatron_interleaving_problem(4, 8)
    help_text = " ".join(simulate.build_parser().format_help().split())
    assert "(default 4)" in help_text and "default 32768" in help_text


def test_split_sequence_refuses_no_tokens():
    with pytest.raises(ValueError, match="seq_length must be at least 1 token, got 0"):
        split_sequence(0, 2, "uniform")
