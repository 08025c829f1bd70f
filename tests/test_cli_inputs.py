"""Every command line answers a bad number in one line: the flag, the value, what is allowed.

Issue 34: ``--pp 0`` ended in ``ZeroDivisionError``, ``--splits 0`` blamed the segment
length, and the simulator printed a traceback naming an internal argument. Here every
entry point's parser is walked: each flag that reads a number must read it through
:mod:`megatron_seq1f1b.base.flags` (or ``--seq1f1b-splits``' own reader), and zero, negative
and non-numeric values must give exit status 2, one line on stderr naming the flag and
the value, and no traceback. Checks across flags get the same treatment through each
entry point's ``main``. Everything runs in this process except a few end-to-end runs.

Issue 44: a trainer error under torchrun is one line (rank 0's) and status 2 on every rank;
a missing data set, a data set with token ids beyond the vocabulary and a missing
make_dataset.py input are one line and status 2 too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_seq1f1b import megatron_lm, planner

from megatron_seq1f1b.planner import rehearse

from megatron_seq1f1b.bench import cli as bench_cli
from megatron_seq1f1b.bench import gpu, gpu_check, gpu_long, predictions, rehearsal_check
from megatron_seq1f1b.schedules import simulate
from megatron_seq1f1b.trainer import arguments
from megatron_seq1f1b.trainer.data import write_indexed

ROOT = Path(__file__).resolve().parents[1]
OUT = ["--out", "unused-out"]  # parsing stops before anything is written

# entry point -> (its parser, the flags it requires)
ENTRY_POINTS = {
    "planner": (planner.build_parser, ["--seq-length", "4096", "--pp", "2",
                                       "--microbatches", "4"]),
    "simulate": (simulate.build_parser, []),
    "rehearse": (rehearse.build_parser, [
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "256", "--vocab-size", "128", "--pipeline-model-parallel-size", "4",
        "--rehearse-stage", "0", "--num-microbatches", "4"]),
    "benchmark": (bench_cli.build_parser, []),
    "bench.gpu": (gpu.build_parser, OUT),
    "bench.gpu_long": (gpu_long.build_parser, OUT),
    "bench.gpu_check": (gpu_check.build_parser, OUT),
    "bench.predictions": (predictions.build_parser, OUT),
    "bench.rehearsal_check": (rehearsal_check.build_parser, OUT),
    "trainer": (arguments.build_parser, []),
}


def _numeric_flags():
    """(entry point, option, its type) for every flag that reads a number."""
    found = []
    for name, (build, _) in ENTRY_POINTS.items():
        for action in build()._actions:
            if not action.option_strings or action.type is None:
                continue
            assert action.type not in (int, float), (
                f"{name} {action.option_strings[0]}: read it with megatron_seq1f1b.base.flags")
            if hasattr(action.type, "allowed") or action.type is megatron_lm.splits_value:
                found.append((name, action.option_strings[0], action.type))
    return found


NUMERIC = _numeric_flags()


def _refused(call, capsys) -> str:
    """The single stderr line of a call that must exit with status 2."""
    with pytest.raises(SystemExit) as exited:
        call()
    err = capsys.readouterr().err
    assert exited.value.code == 2, (exited.value.code, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_every_entry_point_reads_numbers_through_the_checkers():
    per_entry = {name: [flag for entry, flag, _ in NUMERIC if entry == name]
                 for name in ENTRY_POINTS}
    assert all(per_entry.values()), per_entry
    assert {"--pp", "--splits", "--microbatches", "--tie-tolerance"} <= set(per_entry["planner"])
    assert {"--pipeline-model-parallel-size", "--seq1f1b-splits", "--lr",
            "--seq1f1b-memory-budget"} <= set(per_entry["trainer"])
    assert len(NUMERIC) > 100


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_zero_negative_and_non_numeric_values(value, capsys):
    """All flags, all entry points: refused in one line, or (zero where zero is allowed)
    accepted."""
    for name, flag, kind in NUMERIC:
        build, required = ENTRY_POINTS[name]
        argv = required + [flag, value]
        allowed = getattr(kind, "allowed", "an integer >= 1")
        if value == "0" and (">= 0" in allowed or "from 0" in allowed or "[0," in allowed):
            build().parse_args(argv)  # zero is allowed here
            continue
        line = _refused(lambda: build().parse_args(argv), capsys)
        assert f"error: argument {flag}" in line or f"/{flag}:" in line, (name, line)
        assert f"got '{value}'" in line and "must be" in line, (name, line)


def test_the_issues_examples(capsys):
    line = _refused(lambda: planner.main(
        ["--seq-length", "4096", "--pp", "0", "--microbatches", "4", "--hidden-size", "512",
         "--num-layers", "4", "--num-attention-heads", "8"]), capsys)
    assert line == ("python -m megatron_seq1f1b.planner: error: argument --pp: must be an "
                    "integer >= 1, got '0'")
    line = _refused(lambda: planner.main(
        ["--seq-length", "4096", "--pp", "2", "--microbatches", "4", "--splits", "0"]), capsys)
    assert "argument --splits: must be an integer >= 1, got '0'" in line
    line = _refused(lambda: simulate.main(["--splits", "0"]), capsys)
    assert "argument --splits: must be an integer >= 1, got '0'" in line


PLANNER = ["--seq-length", "4096", "--pp", "2", "--microbatches", "4", "--hidden-size", "512",
           "--num-layers", "4", "--num-attention-heads", "8"]
REHEARSE = ENTRY_POINTS["rehearse"][1]


@pytest.mark.parametrize("call, flag", [
    (lambda: planner.main(PLANNER + ["--splits", "5000"]), "--splits 5000"),
    (lambda: planner.main(PLANNER + ["--splits", "64"]), "--min-segment-length 128"),
    (lambda: planner.main(PLANNER + ["--vpp", "2", "--pp", "1"]), "--vpp 2"),
    (lambda: planner.main(PLANNER + ["--num-layers", "3"]), "--num-layers 3"),
    (lambda: planner.main(PLANNER + ["--memory-budget-gib", "4"]), "--memory-budget-gib"),
    (lambda: planner.main(PLANNER + ["--multiple-of", "3"]), "--multiple-of 3"),
    (lambda: planner.main(PLANNER + ["--calibration", "/no/such/file.json"]), "--calibration"),
    (lambda: planner.main(["--seq-length", "4096", "--pp", "2", "--microbatches", "4"]),
     "--calibration"),
    (lambda: planner.main(PLANNER + ["--tp", "3"]),
     "--num-attention-heads 8 must be a multiple of --tensor-model-parallel-size 3"),
    (lambda: planner.main(PLANNER + ["--num-attention-heads", "3"]),
     "--hidden-size 512 must divide by --num-attention-heads 3"),
    (lambda: planner.main(PLANNER + ["--tp", "2", "--sequence-parallel", "--multiple-of", "3"]),
     "multiple of 6 (the least common multiple of --multiple-of 3 and the layout's 2: sequence "
     "parallelism"),
    (lambda: simulate.main(["--chunks", "2", "--pp", "1"]), "--chunks 2"),
    (lambda: simulate.main(["--cost", "attention", "--seq-length", "8", "--splits", "16"]),
     "--splits 16"),
    (lambda: rehearse.main(REHEARSE + ["--rehearse-stage", "4"]), "--rehearse-stage 4"),
    (lambda: rehearse.main(REHEARSE + ["--seq1f1b-splits", "300"]), "--seq1f1b-splits"),
    (lambda: rehearse.main(REHEARSE + ["--num-layers", "6"]), "--num-layers 6"),
    (lambda: bench_cli.parse_args(["--splits", "5000"]), "--splits 5000"),
    (lambda: bench_cli.parse_args(["--sweep-splits", "5000"]), "--sweep-splits 5000"),
    (lambda: gpu.main(OUT + ["--splits", "5000"]), "--splits 5000"),
    (lambda: gpu_long.main(OUT + ["--splits", "100000"]), "--splits 100000"),
    (lambda: gpu_check.main(OUT + ["--splits", "5000"]), "--splits 5000"),
    (lambda: predictions.main(OUT), "--calibration"),
    (lambda: arguments.parse(["--mock-data", "--tokenizer-type", "ByteTokenizer",
                              "--pipeline-model-parallel-size", "3"], 3),
     "--pipeline-model-parallel-size 3"),
], ids=["planner-splits-sequence", "planner-splits-min-length", "planner-vpp", "planner-layers",
        "planner-gib-needs-bytes", "planner-multiple", "planner-calibration-file",
        "planner-no-costs", "planner-tp-heads", "planner-hidden-heads",
        "planner-sequence-parallel", "simulate-chunks",
        "simulate-splits-sequence", "rehearse-stage", "rehearse-splits", "rehearse-layers",
        "benchmark-splits", "benchmark-sweep", "gpu", "gpu-long", "gpu-check", "predictions",
        "trainer"])
def test_checks_across_flags_are_one_line_too(call, flag, capsys):
    assert flag in _refused(call, capsys)


def test_old_planner_budget_spelling_still_works_with_a_note(capsys):
    for build in (planner.build_parser, bench_cli.build_parser):
        required = ENTRY_POINTS["planner"][1] if build is planner.build_parser else []
        new = build().parse_args(required + ["--memory-budget-microbatches", "2.5"])
        assert capsys.readouterr().err == ""
        old = build().parse_args(required + ["--memory-budget", "2.5"])
        note = capsys.readouterr().err
        assert old.memory_budget_microbatches == new.memory_budget_microbatches == 2.5
        assert "--memory-budget is now --memory-budget-microbatches" in note
        assert len(note.strip().splitlines()) == 1
    assert "old spelling" in planner.build_parser().format_help()


def test_planner_table_says_micro_batches_and_ties_flop_costs_within_two_percent(
        tmp_path, capsys):
    """Issue 34 (2, 3): the column's unit, and FLOP costs tie as measured ones do: the
    fewest segments predicted within 2 % of the fastest win."""
    argv = ["--seq-length", "8192", "--pp", "4", "--microbatches", "4", "--hidden-size",
            "1024", "--num-layers", "8", "--num-attention-heads", "8", "--vocab-size", "32000",
            "--host-ms-per-layer", "0", "--partitions", "balanced", "--schedules", "1f1b",
            "--splits", "2", "3", "4", "5", "6", "7", "8"]
    exact, tied = tmp_path / "exact.json", tmp_path / "tied.json"
    # every candidate timed (--top 0): the search times only what its answer needs
    assert planner.main(argv + ["--tie-tolerance", "0", "--top", "0", "--json", str(exact)]) == 0
    capsys.readouterr()
    assert planner.main(argv + ["--json", str(tied)]) == 0  # the default: 2 %
    out = capsys.readouterr().out
    assert "act. (micro-batches)" in out and "memory (mb)" not in out
    exact, tied = (json.loads(path.read_text()) for path in (exact, tied))
    times = {c["num_splits"]: c["time"] for c in exact["candidates"]}
    fastest = min(times, key=times.get)
    within = [k for k, t in times.items() if t <= times[fastest] * 1.02]
    assert exact["plan"]["num_splits"] == fastest
    assert tied["plan"]["num_splits"] == min(within) < fastest, times
    assert "within the tie tolerance of 2%" in tied["reason"]


@pytest.mark.parametrize("module, argv, flag", [
    ("megatron_seq1f1b.simulate", ["--splits", "0"], "--splits"),
    ("megatron_seq1f1b.planner", ["--seq-length", "4096", "--pp", "0", "--microbatches", "4"],
     "--pp"),
])
def test_end_to_end_no_traceback(module, argv, flag):
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"python -m {module}: error: argument {flag}: must be an integer >= 1, got '0'"]


# Issue 44: what a new user of the trainer trips on, end to end.
SCRIPTS = ROOT / "scripts"
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")


def _run(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=ONE_THREAD)


def _ours(stderr: str, prog: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{prog}: ")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bad_trainer_flag_under_torchrun_is_one_line_and_status_2_on_every_rank():
    """Rank 0 alone prints; every rank exits 2 (none is ended by torchrun's SIGTERM, -15);
    torchrun itself exits 1 after its report of the children's codes."""
    done = _run("-m", "torch.distributed.run", "--nproc-per-node=2",
                f"--master-port={_free_port()}", str(SCRIPTS / "pretrain_gpt.py"), "--bad-flag")
    assert _ours(done.stderr, "pretrain_gpt.py") == [
        "pretrain_gpt.py: error: unrecognized arguments: --bad-flag"], done.stderr
    assert re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", done.stderr, re.M) == ["2", "2"], done.stderr
    assert done.returncode == 1, done.stderr


def test_missing_data_path_is_one_line_and_status_2(tmp_path):
    done = _run(str(SCRIPTS / "pretrain_gpt.py"), "--data-path", str(tmp_path / "nope"),
                "--tokenizer-type", "ByteTokenizer", timeout=60)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == [
        f"pretrain_gpt.py: error: --data-path {tmp_path}/nope: {tmp_path}/nope.idx and "
        f"{tmp_path}/nope.bin not found (a Megatron indexed data set is a prefix.idx and "
        f"prefix.bin; scripts/make_dataset.py --output {tmp_path}/nope makes one)"]


def test_make_dataset_missing_input_is_one_line_and_a_good_one_prints_no_warnings(tmp_path):
    done = _run(str(SCRIPTS / "make_dataset.py"), "--input", str(tmp_path / "nope.txt"),
                "--output", str(tmp_path / "out"), timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"make_dataset.py: error: --input {tmp_path}/nope.txt: No such file or directory"]
    assert not (tmp_path / "out.bin").exists()
    (tmp_path / "a.txt").write_text("a document")
    done = _run(str(SCRIPTS / "make_dataset.py"), "--input", str(tmp_path / "a.txt"),
                "--output", str(tmp_path / "out"), timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr  # Megatron's import: quiet
    assert "1 documents, 11 byte tokens" in done.stdout


def test_tokens_beyond_the_vocabulary_are_one_line_naming_both(tmp_path, capsys):
    prefix = write_indexed(["byte text", "more"], tmp_path / "bytes")  # end of document: 256
    data = ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--split", "1"]
    line = _refused(lambda: arguments.parse([*data, "--vocab-size", "128"]), capsys)
    assert line == (f"pretrain_gpt.py: error: --data-path {prefix}: token id 256 is beyond "
                    "--vocab-size 128 (--tokenizer-type NullTokenizer: ids 0..127); give "
                    "--vocab-size 257 or more, or the tokenizer the data set was made with")
    assert arguments.parse([*data, "--vocab-size", "257"]).vocab_size == 257
    line = _refused(lambda: arguments.parse(["--data-path", f"{prefix}.bin",
                                             "--tokenizer-type", "ByteTokenizer"]), capsys)
    assert line.endswith(f"give the prefix without .bin: --data-path {prefix}")


@pytest.mark.parametrize("given, missing", [
    ({}, "add --seq1f1b --seq1f1b-splits auto"),
    ({"seq1f1b": True}, "add --seq1f1b-splits auto"),
    ({"seq1f1b_splits": "auto"}, "add --seq1f1b"),
])
def test_memory_budget_message_names_only_what_is_missing(given, missing):
    from types import SimpleNamespace

    from megatron_seq1f1b.megatron_lm.arguments import auto_flag_problems

    args = SimpleNamespace(**{"seq1f1b": False, "seq1f1b_splits": 1,
                              "seq1f1b_memory_budget": 20.0, **given})
    (problem,) = auto_flag_problems(args)
    assert problem.endswith(missing), problem
    assert not auto_flag_problems(SimpleNamespace(**{**vars(args), "seq1f1b": True,
                                                     "seq1f1b_splits": "auto"}))


def test_a_hybrid_pattern_may_begin_with_a_dash():
    """argparse reads '--*-*' after its flag as an option; every entry point that takes
    --hybrid-layer-pattern joins it to the flag (base.flags.DASH_VALUES), and still reads a
    following option as one."""
    from megatron_seq1f1b.base.flags import ArgumentParser

    parser = ArgumentParser(prog="t")
    parser.add_argument("--hybrid-layer-pattern")
    parser.add_argument("--num-layers", type=int)
    for pattern in ("--|*-*-", "-*-*", "-", "M-M*|-G*-/*-"):
        assert parser.parse_args(["--hybrid-layer-pattern", pattern]).hybrid_layer_pattern \
            == pattern
    with pytest.raises(SystemExit):  # an option is not taken for a pattern
        parser.parse_args(["--hybrid-layer-pattern", "--num-layers", "4"])
    assert arguments.build_parser().parse_args(
        ["--hybrid-layer-pattern", "-*|-*"]).hybrid_layer_pattern == "-*|-*"


@pytest.mark.skipif(importlib.util.find_spec("megatron.core.models.hybrid") is None,
                    reason="HybridModel is in megatron-core 0.18 and later")
def test_the_pattern_sets_the_trainers_layers_and_says_what_it_overrides():
    """--num-layers defaults to 4; a hybrid pattern sets it, and a different --num-layers is
    ignored with a start-up warning (Megatron-LM's rule), never silently."""
    def parse(*flags):
        return arguments.parse(["--mock-data", "--vocab-size", "128", *flags])

    plain = parse()
    assert (plain.num_layers, plain.startup_warnings) == (4, [])
    given = parse("--hybrid-layer-pattern", "*-*-*-")
    assert (given.num_layers, given.startup_warnings) == (6, [])
    same = parse("--hybrid-layer-pattern", "*-*-*-", "--num-layers", "6")
    assert (same.num_layers, same.startup_warnings) == (6, [])
    other = parse("--hybrid-layer-pattern", "*-*-*-", "--num-layers", "4")
    assert other.num_layers == 6
    assert other.startup_warnings == [
        "--hybrid-layer-pattern '*-*-*-' has 6 layers; ignoring --num-layers 4 (as Megatron-LM "
        "does)"]


def test_a_split_part_without_documents_is_refused_instead_of_a_hang(tmp_path, capsys):
    """Megatron's dataset builder loops forever on a --split part with weight > 0 and no
    document (the default 98,2,0 over a few documents); the trainer says so at start-up."""
    prefix = write_indexed(["one", "two", "three"], tmp_path / "three")
    data = ["--data-path", str(prefix), "--tokenizer-type", "ByteTokenizer"]
    line = _refused(lambda: arguments.parse(data), capsys)
    assert line == (f"pretrain_gpt.py: error: --data-path {prefix}: --split 98,2,0 gives the "
                    "validation part none of its 3 sequences (documents) (Megatron's dataset "
                    "builder would loop forever on it); give that part weight 0 (e.g. --split "
                    "100,0,0) or more documents")
    assert arguments.parse([*data, "--split", "100,0,0"]).split == "100,0,0"
    assert arguments.parse([*data, "--split", "2,1"]).split == "2,1"  # 2 and 1 documents
    # Megatron's own reading (spaces, leading dots); an empty test part is never asked for
    assert arguments.parse([*data, "--split", "5, 5, .1"]).split == "5, 5, .1"
    assert _refused(lambda: arguments.parse([*data, "--split", "0,1,0"]), capsys).endswith(
        "--split 0,1,0: the training part must be > 0")
    assert _refused(lambda: arguments.parse([*data, "--split", "1,2,3,4"]), capsys).endswith(
        "--split '1,2,3,4': give up to three non-negative weights, e.g. 98,2,0")


@pytest.mark.parametrize("flags, message", [
    (["--hidden-size", "66"], "--hidden-size 66 must divide by --num-attention-heads 4 (as in "
                              "Megatron-LM)"),
    (["--num-query-groups", "3"], "--num-query-groups 3 must divide --num-attention-heads 4"),
    (["--num-experts", "3", "--moe-router-topk", "5", "--disable-bias-linear"],
     "--moe-router-topk 5 exceeds --num-experts 3"),
    (["--num-experts", "2"], "--num-experts without --disable-bias-linear: Megatron-Core's "
     "local experts (SequentialMLP) add their bias in place to a view of their output, which "
     "autograd refuses in the first forward (RuntimeError in "
     "megatron/core/transformer/mlp.py, under any schedule); add --disable-bias-linear (MoE "
     "models train without linear biases)"),
    (["--seq1f1b", "--window-size", "(10, 5)"],
     "--window-size (10, 5): under --seq1f1b a window looks back w >= 0 tokens and not ahead "
     "(a later segment's keys do not exist when an earlier one runs); use --window-size '(w, 0)'"),
    (["--seq1f1b-splits", "8"], "--seq1f1b-splits without --seq1f1b: Megatron-Core's own "
                                "schedule would run and ignore it; add --seq1f1b"),
    (["--seq1f1b-partition=uniform", "--seq1f1b-schedule", "zb-h1"],
     "--seq1f1b-schedule / --seq1f1b-partition without --seq1f1b: Megatron-Core's own schedule "
     "would run and ignore it; add --seq1f1b"),
])
def test_trainer_refuses_what_megatron_or_seq1f1b_would_fail_on_later(flags, message, capsys):
    """Shapes Megatron-LM refuses (or its layers fail on with a traceback), a look-ahead window
    under Seq1F1B, and plan flags that would be ignored: one line each, before any set-up."""
    base = ["--mock-data", "--vocab-size", "64", "--hidden-size", "64", "--seq-length", "32"]
    assert _refused(lambda: arguments.parse([*base, *flags]), capsys) == \
        f"pretrain_gpt.py: error: {message}"
    assert arguments.parse([*base, "--seq1f1b", "--seq1f1b-splits", "8"]).seq1f1b_splits == 8


@pytest.mark.parametrize("flags, splits", [
    ([], 4),  # the default count
    (["--seq1f1b-segment-tokens", "8"], 12),  # no cap: ceil(96 / 8), not the default 4
    (["--seq1f1b-segment-tokens", "8", "--seq1f1b-splits", "3"], 3),  # a given cap
    (["--seq1f1b-segment-tokens", "500"], 2),  # a budget beyond the sequence: 1 segment, cap 2
])
def test_a_token_budget_without_splits_has_no_cap(flags, splits):
    """--seq1f1b-segment-tokens T: with no --seq1f1b-splits the cap is the longest
    micro-batch's count (no cap), not the default 4 splits."""
    base = ["--mock-data", "--vocab-size", "64", "--seq-length", "96", "--seq1f1b"]
    args = arguments.parse([*base, *flags])
    assert (args.seq1f1b_splits, args.seq1f1b_segment_tokens) == (
        splits, int(flags[1]) if flags else None)
    # the start-up line names the most segments a micro-batch gets, and a budget that cuts
    # nothing says so
    from megatron_seq1f1b.trainer.loop import _schedule_name

    name = _schedule_name(args)
    uncut = [w for w in args.startup_warnings if "no micro-batch is cut" in w]
    if flags:
        assert f"k <= {min(splits, -(-96 // int(flags[1])))}," in name, name
    assert bool(uncut) == (flags[1:2] == ["500"]), args.startup_warnings


def test_demo_help_answers_without_setting_up():
    done = subprocess.run(["bash", str(SCRIPTS / "demo.sh"), "--help"], capture_output=True,
                          text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "scripts/demo.sh --quick" in done.stdout and "only to Seq1F1B's" in done.stdout
    assert "set -euo" not in done.stdout and not done.stdout.startswith("#")
