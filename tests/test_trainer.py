"""End-to-end runs of scripts/pretrain_gpt.py on CPU ranks (torchrun, gloo)."""

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"
FULL = os.environ.get("SEQ1F1B_FULL") == "1"
# Runs whose features CI covers elsewhere (pp4 and MLA in test_pipeline / test_segments,
# checkpoints in the resume test, TP + SP and MoE in test_pipeline / test_moe, indexed data
# in the documents tests, HybridModel in test_hybrid / test_recurrent and examples/, MTP in
# test_mtp, CP in test_context_parallel and the trainer's CP documents test, the trainer's
# document route in that test and the variable-length one): SEQ1F1B_FULL=1 runs them too.
full_only = pytest.mark.skipif(not FULL, reason="SEQ1F1B_FULL=1 runs it (CI covers its parts "
                               "elsewhere)")
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--mock-data", "--vocab-size", "128", "--lr", "1e-3", "--lr-decay-style", "constant",
        "--log-interval", "1"]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(tmp_path, name, nproc, *flags, timeout=300, base=BASE):
    """The trainer's losses and stdout; `nproc` None: one process without torchrun."""
    log = tmp_path / f"{name}.json"
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               SEQ1F1B_TIMEOUT_MINUTES="2")
    launcher = [] if nproc is None else ["-m", "torch.distributed.run",
                                         f"--nproc-per-node={nproc}", f"--master-port={_port()}"]
    cmd = [sys.executable, *launcher, str(SCRIPT), *base, *flags, "--log-json", str(log)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(log.read_text()), done.stdout


def _same(a, b, rtol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rtol * abs(y), (a, b)


@full_only
def test_seq1f1b_and_1f1b_loss_curves_are_equal_pp4_mla(tmp_path):
    """Megatron-LM's MLA flags (YaRN; the trainer's torch core attention for MLA)."""
    common = ["--pipeline-model-parallel-size", "4", "--train-iters", "5",
              "--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8",
              "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--rope-type", "yarn",
              "--position-embedding-type", "rope", "--normalization", "RMSNorm"]
    ours, stdout = train(tmp_path, "seq", 4, *common, "--seq1f1b", "--seq1f1b-splits", "4")
    theirs, _ = train(tmp_path, "1f1b", 4, *common)
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])
    assert ours["summary"]["losses"][-1] < ours["summary"]["losses"][0]  # it learns
    assert "lm loss:" in stdout and "tokens/s" in stdout and "peak mem per stage" in stdout
    assert len(ours["summary"]["peak_gib_per_stage"]) == 4
    assert ours["summary"]["attention_backend"] == "flash"  # MLA: always the flash one


@full_only
def test_tensor_parallel_sequence_parallel_moe_and_eval(tmp_path):
    """TP2 + SP through the script's flags with Megatron-LM's MoE flags (every 2nd layer MoE,
    aux loss + z-loss), segments without pipelining (pp=1), evaluation. (TP2 + SP with
    pipelining and MoE layouts are compared gradient by gradient in tests/test_pipeline.py
    and tests/test_moe.py.)"""
    common = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-query-groups",
              "2", "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1",
              "--position-embedding-type", "rope", "--num-experts", "4", "--moe-layer-freq", "2",
              "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
              "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]
    ours, stdout = train(tmp_path, "seq", 2, *common, "--seq1f1b", "--seq1f1b-splits", "2")
    theirs, _ = train(tmp_path, "1f1b", 2, *common)
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])
    assert "validation loss at iteration 3" in stdout
    # Megatron's logged MoE losses, iteration by iteration
    for a, b in zip(ours["iterations"], theirs["iterations"]):
        names = ("load_balancing_loss", "z_loss")
        _same([a["moe_losses"][n] for n in names], [b["moe_losses"][n] for n in names])
    assert "load_balancing_loss:" in stdout


@full_only
@pytest.mark.skipif(importlib.util.find_spec("megatron.core.models.hybrid") is None,
                    reason="HybridModel is in megatron-core 0.18 and later")
def test_hybrid_pattern_pipeline_2_equals_megatrons_schedule(tmp_path):
    """--hybrid-layer-pattern (Megatron-Core's HybridModel, attention, MLP and MoE layers, the
    pattern's two stages on two ranks): Seq1F1B k=3 trains as Megatron's 1F1B does."""
    common = ["--hybrid-layer-pattern", "*-*E|*-*-", "--pipeline-model-parallel-size", "2",
              "--train-iters", "3", "--position-embedding-type", "rope", "--num-experts", "4",
              "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall",
              "--disable-bias-linear"]
    ours, stdout = train(tmp_path, "seq", 2, *common, "--seq1f1b", "--seq1f1b-splits", "3")
    theirs, _ = train(tmp_path, "1f1b", 2, *common)
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])
    assert ours["summary"]["losses"][-1] < ours["summary"]["losses"][0]  # it learns
    # BASE's --num-layers 4 gives way to the pattern's 8, and the start-up says so
    assert "> warning: --hybrid-layer-pattern '*-*E|*-*-' has 8 layers; ignoring --num-layers " \
        "4" in stdout, stdout[-1500:]


# Megatron-LM's Mamba-2 and gated-delta-net size flags, small (tests/gpt.py's sizes): Mamba
# 8 heads of 8 (2 x hidden 32 / 8) in 2 groups, state 8; GDN 2 key heads, 4 value heads of 8.
RECURRENT_SIZES = ["--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
                   "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
                   "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
                   "--linear-conv-kernel-dim", "4"]


@full_only  # ~50 s on 2 CPU cores; tests/test_recurrent.py covers the layers in CI
@pytest.mark.skipif(importlib.util.find_spec("megatron.core.models.hybrid") is None,
                    reason="HybridModel is in megatron-core 0.18 and later")
@pytest.mark.parametrize("documents", [[], ["--reset-attention-mask", "--reset-position-ids",
                                             "--attention-backend", "flash"]],
                         ids=["plain", "packed-documents"])
def test_hybrid_mamba_and_gated_delta_net_equal_megatrons_schedule(tmp_path, documents):
    """Mamba-2 (M) and gated delta net (G) layers in --hybrid-layer-pattern, sized by
    Megatron-LM's flags, the pattern's two stages on two ranks (on CPU: the reference
    kernels): Seq1F1B k=3, whose segments carry the layers' states, trains as Megatron's 1F1B
    does; with documents on flash (packed THD batches) the states restart at each document
    start in both."""
    common = ["--hybrid-layer-pattern", "M-G*|G-M*", "--pipeline-model-parallel-size", "2",
              "--train-iters", "3", "--position-embedding-type", "rope", "--swiglu",
              "--normalization", "RMSNorm", "--disable-bias-linear", *RECURRENT_SIZES,
              *documents]
    ours, _ = train(tmp_path, "seq", 2, *common, "--seq1f1b", "--seq1f1b-splits", "3")
    theirs, _ = train(tmp_path, "1f1b", 2, *common)
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])
    assert ours["summary"]["losses"][-1] < ours["summary"]["losses"][0]  # it learns


@full_only
@pytest.mark.skipif(importlib.util.find_spec("megatron.core.models.hybrid") is None,
                    reason="HybridModel is in megatron-core 0.18 and later")
def test_hybrid_multi_latent_attention_equals_megatrons_schedule(tmp_path):
    """MLA layers (+) in --hybrid-layer-pattern: Seq1F1B k=3 trains as Megatron's 1F1B does."""
    common = ["--hybrid-layer-pattern", "+-+E|+-+-", "--multi-latent-attention",
              "--normalization", "RMSNorm", "--q-lora-rank", "16", "--kv-lora-rank", "16",
              "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
              "--pipeline-model-parallel-size", "2", "--train-iters", "3",
              "--position-embedding-type", "rope", "--num-experts", "4", "--disable-bias-linear"]
    ours, _ = train(tmp_path, "seq", 2, *common, "--seq1f1b", "--seq1f1b-splits", "3")
    theirs, _ = train(tmp_path, "1f1b", 2, *common)
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])


@full_only
def test_mtp_two_layers_pipeline_2_equals_megatrons_schedule(tmp_path):
    """--mtp-num-layers 2 (Megatron's MTP block on the last stage, per-token loss): Seq1F1B
    k=3 trains as Megatron's 1F1B does; the logged MTP losses agree too."""
    common = ["--mtp-num-layers", "2", "--pipeline-model-parallel-size", "2",
              "--train-iters", "3", "--position-embedding-type", "rope",
              "--calculate-per-token-loss"]
    ours, stdout = train(tmp_path, "seq", 2, *common, "--seq1f1b", "--seq1f1b-splits", "3")
    theirs, _ = train(tmp_path, "1f1b", 2, *common)
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])
    for a, b in zip(ours["iterations"], theirs["iterations"]):
        _same(list(a["mtp_losses"].values()), list(b["mtp_losses"].values()))
    assert "mtp_2 loss:" in stdout


@full_only  # CI's quick start (scripts/demo.sh --quick) draws the timelines and the summary
def test_timelines_and_the_side_by_side_summary(tmp_path):
    """--timeline-dir draws the last iteration; compare_runs prints the demo's summary.

    Seq1F1B runs its zero-bubble schedule here (zb-h1), which must train like 1F1B.
    """
    common = ["--pipeline-model-parallel-size", "2", "--train-iters", "3"]
    ours, stdout = train(tmp_path, "seq", 2, *common, "--seq1f1b", "--seq1f1b-splits", "2",
                         "--seq1f1b-schedule", "zb-h1", "--timeline-dir", str(tmp_path / "seq"))
    theirs, _ = train(tmp_path, "1f1b", 2, *common, "--timeline-dir", str(tmp_path / "1f1b"))
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])
    assert "zb-h1" in stdout
    for run, name in ((ours, "seq"), (theirs, "1f1b")):
        timeline = run["summary"]["timeline"]
        assert 0 <= timeline["bubble_fraction"] < 1 and len(timeline["busy_s"]) == 2
        # every iteration after the first is timed (the demo's split takes their medians)
        assert len(run["summary"]["timelines"]) == 2
        assert run["summary"]["timelines"][-1]["busy_s"] == timeline["busy_s"]
        trace = json.loads((tmp_path / name / "timeline.json").read_text())
        categories = {e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert categories >= {"forward", "backward"}
        assert ("weight-gradient" in categories) == (name == "seq"), categories
        if timeline["png"]:
            assert (tmp_path / name / "timeline.png").stat().st_size > 0
    assert ours["summary"]["attention_backend"] == "local"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_runs.py"),
                           str(tmp_path / "1f1b.json"), str(tmp_path / "seq.json"),
                           "--timelines", str(tmp_path / "timelines.png")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal within 1e-5" in done.stdout and "measured bubble" in done.stdout
    assert "vs Megatron-Core 1F1B:" in done.stdout and "unfused attention" in done.stdout
    assert "bubble part" in done.stdout
    if ours["summary"]["timeline"]["png"]:
        assert (tmp_path / "timelines.png").stat().st_size > 0


def test_virtual_pipeline_with_sliding_window(tmp_path):
    """Megatron-LM's window flags: windows shorter than a segment, every 2nd layer full."""
    common = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
              "1", "--train-iters", "3", "--global-batch-size", "4", "--window-size", "(20, 0)",
              "--window-attn-skip-freq", "2"]
    ours, _ = train(tmp_path, "seq", 2, *common, "--seq1f1b", "--seq1f1b-splits", "3",
                    "--seq1f1b-partition", "uniform")
    theirs, _ = train(tmp_path, "1f1b", 2, *common)
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])


def test_split_lengths_flag_cuts_as_given_and_trains_like_1f1b(tmp_path):
    """--seq1f1b-split-lengths (the planner's cut for a partition no flag names): the start-up
    line shows the lengths, the timeline's segments have them, the losses are Megatron's."""
    common = ["--pipeline-model-parallel-size", "2", "--train-iters", "2"]
    ours, stdout = train(tmp_path, "lengths", 2, *common, "--seq1f1b", "--seq1f1b-split-lengths",
                         "40,16,8", "--timeline-dir", str(tmp_path / "timeline"))
    theirs, _ = train(tmp_path, "1f1b", 2, *common)
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])
    assert "Seq1F1B k=3 (lengths 40,16,8, 1f1b)" in stdout
    assert ours["summary"]["timeline"]["segment_lengths"] == [[40, 16, 8]] * 4


def test_auto_plan_measures_chooses_within_budget_and_trains_like_1f1b(tmp_path):
    """--seq1f1b-splits auto: a start-up measurement, the candidates' table, a plan within
    --seq1f1b-memory-budget-microbatches (1.3 stage micro-batches rules out k=1, which holds
    2 at pp=2), memory in bytes from measured bytes per token, and the same losses as
    Megatron's 1F1B."""
    common = ["--pipeline-model-parallel-size", "2", "--train-iters", "3", "--seq-length", "256"]
    ours, stdout = train(tmp_path, "auto", 2, *common, "--seq1f1b", "--seq1f1b-splits", "auto",
                         "--seq1f1b-min-segment-length", "32",
                         "--seq1f1b-memory-budget-microbatches", "1.3")
    theirs, _ = train(tmp_path, "1f1b", 2, *common)
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])
    assert "Seq1F1B plan (--seq1f1b-splits auto" in stdout and " wins: " in stdout, stdout
    # every partition is a candidate, timed or named among those the bounds left untimed:
    # FLOP-balanced (the model's config) and measured
    table = stdout[stdout.index("Seq1F1B plan (--seq1f1b-splits auto"):stdout.index(" wins: ")]
    assert all(re.search(rf"\b{p}\b", table) for p in ("uniform", "balanced", "measured")), table
    assert " MiB " in stdout and "W timed apart" in stdout, stdout
    chosen = re.search(r"Seq1F1B k=(\d+)", ours["summary"]["schedule"])
    assert chosen and int(chosen.group(1)) >= 3, ours["summary"]["schedule"]


@full_only
def test_checkpoints_interchange_between_schedules(tmp_path):
    """A Seq1F1B checkpoint resumes under Megatron's 1F1B (the files do not depend on the
    schedule: ``enable`` keeps parameter names; the other direction is the same code)."""
    common = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2",
              "--train-iters", "4"]
    straight, _ = train(tmp_path, "straight", 2, *common)
    seq_first = tmp_path / "seq_ckpt"
    train(tmp_path, "a", 2, *common, "--exit-interval", "2", "--seq1f1b", "--save",
          str(seq_first))
    resumed_1f1b, _ = train(tmp_path, "b", 2, *common, "--load", str(seq_first))
    _same(resumed_1f1b["summary"]["losses"], straight["summary"]["losses"][2:])


def _validation_loss(stdout: str) -> float:
    found = re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+)", stdout)
    assert found, stdout[-2000:]
    return float(found[-1])


# --context-parallel-size 2 runs only under --seq1f1b; its reference is the same model on the
# same pipeline layout without CP (CP changes neither the weights nor their initialization:
# Megatron's seeds depend on the tensor- and expert-parallel ranks, not on the CP rank; the
# layout fixes them, and checkpoints do not cross layouts). One backend learns positions with
# mixture-of-experts layers (router losses), the other rotates them (RoPE) with grouped queries.
CONTEXT_PARALLEL = {
    "local": ["--num-experts", "4", "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "0.01",
              "--moe-z-loss-coeff", "0.001", "--moe-token-dispatcher-type", "alltoall",
              "--disable-bias-linear"],
    "flash": ["--attention-backend", "flash", "--position-embedding-type", "rope",
              "--num-query-groups", "2"],
    "mla": ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--position-embedding-type", "rope",
            "--normalization", "RMSNorm"],
}
if importlib.util.find_spec("megatron.core.models.hybrid") is not None:  # 0.18+: HybridModel
    CONTEXT_PARALLEL["hybrid-local"] = ["--hybrid-layer-pattern", "*-*-|*-*-",
                                        "--position-embedding-type", "rope"]
# SEQ1F1B_FULL=1 runs both backends (CI: neither; CP against one rank is proven in
# tests/test_context_parallel.py, and the trainer's CP path by the CP documents test below).
CONTEXT_PARALLEL_RUN = (list(CONTEXT_PARALLEL) if FULL
                        else ["flash"])


@full_only
@pytest.mark.parametrize("backend", CONTEXT_PARALLEL_RUN)
def test_context_parallel_2_equals_the_same_model_without_it(tmp_path, backend):
    """Issue 32's trainer line, fp32, losses within 1e-5 (training and validation):

    * ``--context-parallel-size 2 --pipeline-model-parallel-size 2 --seq1f1b --seq1f1b-splits
      2`` (4 ranks) == Megatron-Core's 1F1B at pipeline 2 (2 ranks): same pipeline layout,
      hence the same initial weights;
    * ``--context-parallel-size 2 --seq1f1b --seq1f1b-splits 2`` (2 ranks) == one rank without
      pipelining (Megatron-Core's schedule): same weights and data.
    """
    common = ["--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1",
              *CONTEXT_PARALLEL[backend]]
    seq1f1b = ["--context-parallel-size", "2", "--seq1f1b", "--seq1f1b-splits", "2"]
    # CI: the pipelined line; without a pipeline, CP on the trainer against one rank is
    # test_context_parallel_keeps_documents_apart's (SEQ1F1B_FULL=1 runs both here).
    for pp, ranks in ((2, 4), (1, 2)) if FULL else ((2, 4),):
        layout = [*common, "--pipeline-model-parallel-size", str(pp)]
        ours, stdout = train(tmp_path, f"cp2-pp{pp}", ranks, *layout, *seq1f1b)
        theirs, reference = train(tmp_path, f"pp{pp}", pp, *layout)
        assert f"pp {pp}, vpp None, cp 2, dp 1" in stdout, stdout[-1500:]
        _same(ours["summary"]["losses"], theirs["summary"]["losses"])
        _same([_validation_loss(stdout)], [_validation_loss(reference)])
        assert ours["summary"]["attention_backend"] == \
            ("flash" if backend == "mla" else backend.split("-")[-1])  # MLA: always flash


_EOD = (["--reset-attention-mask", "--reset-position-ids"], "end-of-document tokens")
CONTEXT_PARALLEL_DOCUMENTS = {  # CI: end-of-document tokens on flash (local: core tests)
    "reset-attention-mask-flash": (*_EOD, "flash"),
    **({"reset-attention-mask-local": (*_EOD, "local"),
        "inter-document-masking-local": (["--dataloader-inter-document-masking"],
                                         "the dataset's cu_seqlens", "local")} if FULL else {}),
}
# How one rank without CP takes the documents: a dense mask (local), packed THD batches (flash).
REFERENCE_FORM = {"local": "a dense document mask", "flash": "packed THD batches"}


@pytest.mark.parametrize("name", list(CONTEXT_PARALLEL_DOCUMENTS))
def test_context_parallel_keeps_documents_apart(tmp_path, name):
    """Documents at --context-parallel-size 2 (Seq1F1B gets them from the end-of-document
    tokens or the dataset's boundaries, every CP rank its part of each segment, on either
    attention: no THD batch under CP) == one rank with the backend's own form (Megatron's
    dense document mask on local, THD batches on flash), on short byte documents."""
    flags, form, backend = CONTEXT_PARALLEL_DOCUMENTS[name]
    base = [f for f in BASE if f != "--mock-data"]
    common = ["--train-iters", "3", *flags, "--position-embedding-type", "rope",
              "--attention-backend", backend, *_short_documents(tmp_path)]
    ours, stdout = train(tmp_path, "cp2", 2, *common, "--context-parallel-size", "2",
                         "--seq1f1b", "--seq1f1b-splits", "2", base=base)
    theirs, reference = train(tmp_path, "one", None, *common, base=base)  # python, no torchrun
    assert f"documents from {form} as Seq1F1B's documents" in stdout, stdout[-1500:]
    assert f"documents from {form} as {REFERENCE_FORM[backend]}" in reference, reference[-1500:]
    _same(ours["summary"]["losses"], theirs["summary"]["losses"])


def _short_documents(tmp_path) -> list[str]:
    """--data-path flags of an indexed dataset of short byte documents (1 to 40 tokens with
    their end-of-document token): every 64-token sample holds several."""
    import random

    from megatron_seq1f1b.trainer.data import write_indexed

    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(0, 39)))
             for _ in range(400)]
    prefix = write_indexed(texts, tmp_path / "docs")
    return ["--data-path", str(prefix), "--tokenizer-type", "ByteTokenizer", "--vocab-size",
            "257", "--data-cache-path", str(tmp_path / "cache")]


THD = "as packed THD batches"
# Per mode: the flags of every run, then the runs, (extra flags, how the start-up line says
# documents travel). The first run is the reference: Megatron's 1F1B on the same layout, so
# the same initial weights (the layout fixes them; checkpoints do not cross layouts).
DOCUMENTS = {
    # issue 31's acceptance line; mock data, NullTokenizer: its documents hold the
    # end-of-document id every 128 tokens. Micro-batches of 2 are flattened (THD).
    "reset-attention-mask": (
        ["--mock-data", "--seq-length", "128", "--reset-attention-mask", "--reset-position-ids",
         "--eod-mask-loss", "--attention-backend", "flash", "--position-embedding-type", "rope",
         "--micro-batch-size", "2", "--global-batch-size", "8"],
        [([], f"end-of-document tokens {THD} (2 samples flattened into 256 tokens)"),
         (["--seq1f1b", "--seq1f1b-splits", "3", "--seq1f1b-partition", "documents"], THD),
         # planned at start-up on the first micro-batch's documents
         (["--seq1f1b", "--seq1f1b-splits", "auto", "--seq1f1b-min-segment-length", "32"],
          THD)]),
    # the dataset's documents, both backends: local attention's dense-mask route for
    # Megatron's schedule, the documents for Seq1F1B's, packed batches on flash for both
    "inter-document-masking": (
        ["--dataloader-inter-document-masking", "--position-embedding-type", "rope",
         "--micro-batch-size", "2", "--global-batch-size", "8"],
        [([], "the dataset's cu_seqlens as a dense document mask"),
         (["--seq1f1b", "--seq1f1b-splits", "3", "--seq1f1b-partition", "documents"],
          "the dataset's cu_seqlens as Seq1F1B's documents"),
         (["--attention-backend", "flash"], THD),
         (["--attention-backend", "flash", "--seq1f1b", "--seq1f1b-splits", "3"], THD)]),
}


# SEQ1F1B_FULL=1: the end-of-document route (flash, THD) and the dataset's cu_seqlens (both
# backends; its Seq1F1B side is the same documents code, tested in test_documents; CI runs the
# route in the CP documents test and the variable-length test).
@full_only
@pytest.mark.parametrize("mode", list(DOCUMENTS) if FULL else ["reset-attention-mask"])
def test_documents_pipeline_2_seq1f1b_equals_megatrons_schedule(tmp_path, mode):
    """Packed documents at pipeline 2, fp32: Seq1F1B k=3 (and k=1: documents without
    segments) gives Megatron 1F1B's losses within 1e-5, on both attention backends: flash
    takes packed THD batches (no [s, s] mask) in every schedule; local gives Megatron's
    schedule a dense document mask and Seq1F1B the documents."""
    flags, runs = DOCUMENTS[mode]
    if "--mock-data" not in flags:
        flags = [*flags, *_short_documents(tmp_path)]
    base = [f for f in BASE if f != "--mock-data"]
    common = ["--pipeline-model-parallel-size", "2", "--train-iters", "3", *flags]
    losses = []
    for number, (extra, form) in enumerate(runs):
        log, stdout = train(tmp_path, f"run{number}", 2, *common, *extra, base=base)
        assert "documents from " in stdout and form in stdout, (extra, stdout[-1500:])
        losses.append(log["summary"]["losses"])
    for other in losses[1:]:
        _same(other, losses[0])


def test_document_boundaries_before_0_19_equal_megatrons(tmp_path):
    """compat.with_document_boundaries (Megatron-Core < 0.19) gives what 0.19's
    inter_document_masking gives, sample by sample (indexed and mock data, both splits, the
    padding sample). It matched 0.16.1's datasets against 0.19.2's by hand, too."""
    import torch

    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    from megatron_seq1f1b.base import compat
    from megatron_seq1f1b.trainer.data import ByteTokenizer, NullTokenizer, quiet_logs

    if not compat.dataset_has_inter_document_masking():
        pytest.skip("Megatron-Core < 0.19 has no inter_document_masking to compare with")
    quiet_logs()
    prefix = _short_documents(tmp_path)[1]
    for mock in (False, True):
        def build(cls, native):
            config = GPTDatasetConfig(
                random_seed=1, sequence_length=64,
                tokenizer=NullTokenizer(128) if mock else ByteTokenizer(),
                reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                create_attention_mask=False, blend=None if mock else ([prefix], None),
                split=None if mock else "98,2,0", path_to_cache=str(tmp_path / "cache"),
                **(dict(inter_document_masking=True) if native else {}))
            config.mock = mock
            return BlendedMegatronDatasetBuilder(cls, [100, 20, None], lambda: True,
                                                 config).build()

        cls = MockGPTDataset if mock else GPTDataset
        theirs, ours = build(cls, True), build(compat.with_document_boundaries(cls), False)
        boundaries = 0
        for split in (0, 1):
            for index in [*range(min(len(theirs[split]), 300)), None]:
                a, b = theirs[split][index], ours[split][index]
                assert a.keys() == b.keys()
                assert all(torch.equal(a[key], b[key]) for key in a), (mock, split, index)
                boundaries += int((a["cu_seqlens"] < 64).sum()) - 1
        assert boundaries > (10 if mock else 300), boundaries  # the samples hold documents


# --variable-seq-lengths: micro-batches of their own length (Megatron-Core's
# variable_seq_lengths), per mode: the flags of every run, then each run's extra flags. The
# first run is the reference, Megatron's 1F1B on the same layout (the same initial weights).
# CI: packed byte documents on flash (THD), each sample cut after its last whole document,
# as post-training packs them; SEQ1F1B_FULL=1 adds log-normal lengths on mock data (local
# attention, micro-batches of 2, evaluation; --seq1f1b-splits auto planning a budget on the
# first global batch, whose measurement leaves training as it was); and the same documents
# with a micro-batch's runs of documents going backward apart, on per-token loss.
VARIABLE = {
    "documents-thd": (
        ["--variable-seq-lengths", "documents", "--attention-backend", "flash",
         "--reset-attention-mask", "--reset-position-ids", "--position-embedding-type", "rope"],
        [[], ["--seq1f1b", "--seq1f1b-splits", "3"],
         ["--seq1f1b", "--seq1f1b-segment-tokens", "16", "--seq1f1b-partition", "documents"]]),
    "documents-thd-runs-apart": (  # --seq1f1b-backward-by-documents needs per-token loss
        ["--variable-seq-lengths", "documents", "--attention-backend", "flash",
         "--reset-attention-mask", "--reset-position-ids", "--position-embedding-type", "rope",
         "--calculate-per-token-loss"],
        [[], ["--seq1f1b", "--seq1f1b-segment-tokens", "16", "--seq1f1b-partition", "documents",
              "--seq1f1b-backward-by-documents"]]),
    "lognormal": (
        ["--mock-data", "--variable-seq-lengths", "lognormal", "--variable-seq-lengths-min", "8",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "3",
         "--eval-iters", "1"],
        [[], ["--seq1f1b", "--seq1f1b-splits", "auto", "--seq1f1b-memory-budget", "1"],
         ["--seq1f1b", "--seq1f1b-segment-tokens", "16"]]),
}


@pytest.mark.parametrize("mode", list(VARIABLE) if FULL else ["documents-thd",
                                                               "documents-thd-runs-apart"])
def test_variable_lengths_seq1f1b_equals_megatrons_schedule(tmp_path, mode):
    """--variable-seq-lengths at pipeline 2, fp32: Seq1F1B with a fixed k and with a token
    budget per segment gives the losses of Megatron's 1F1B (variable_seq_lengths=True) on the
    same micro-batches; tokens/s counts their real tokens (fewer than --global-batch-size x
    --seq-length, the same in every run; log-normal: exactly the drawn lengths)."""
    flags, runs = VARIABLE[mode]
    base = [f for f in BASE if f != "--mock-data"]
    if "--mock-data" not in flags:
        flags = [*flags, *_short_documents(tmp_path)]
    common = ["--pipeline-model-parallel-size", "2", "--train-iters", "3", *flags]
    logs = []
    for number, extra in enumerate(runs):
        log, stdout = train(tmp_path, f"run{number}", 2, *common, *extra, base=base)
        assert "micro-batches of " in stdout and " x up to 64 tokens; variable lengths: " \
            in stdout, stdout[-1500:]
        if "auto" in extra:  # planned on the first global batch's lengths, then trained
            assert "<- chosen" in stdout and "vs Megatron" in stdout, stdout[-3000:]
        logs.append(log)
    assert "Seq1F1B segments of <= 16 tokens" in logs[-1]["summary"]["schedule"]
    tokens = [[record["tokens"] for record in log["iterations"]] for log in logs]
    for other in logs[1:]:
        _same(other["summary"]["losses"], logs[0]["summary"]["losses"])
    assert all(t == tokens[0] for t in tokens), tokens
    global_batch = int(common[common.index("--global-batch-size") + 1]) if \
        "--global-batch-size" in common else 4
    assert all(0 < t < global_batch * 64 for t in tokens[0]) and len(set(tokens[0])) > 1, tokens
    if mode == "lognormal":
        from megatron_seq1f1b.trainer.lengths import lognormal_length

        drawn = [2 * lognormal_length(i, seed=1234, salt=0, low=8, high=64, sigma=0.8)
                 for i in range(12)]
        assert tokens[0] == [sum(drawn[4 * i:4 * i + 4]) for i in range(3)], (tokens, drawn)


def test_variable_lengths_cut_samples_after_whole_documents_and_draw_by_index():
    """lengths.py alone: a sample is cut after its last whole document (end-of-document
    tokens, or the dataset's cu_seqlens with its mask, rows and longest part cut alike), stays
    whole as one document or ending with one, rounds down to the layout's multiple; log-normal
    lengths depend on (seed, split, index) only and stay within [low, high]."""
    import torch

    from megatron_seq1f1b.trainer.lengths import cut, document_length, lognormal_length

    eod = 9
    tokens = torch.tensor([[1, 2, eod, 3, 4, 5, eod, 6, 7, 8]])
    assert document_length({"tokens": tokens}, eod) == 7
    assert document_length({"tokens": tokens}, eod, multiple=2) == 6
    assert document_length({"tokens": torch.tensor([[1, 2, 3, 4]])}, eod) == 4  # one document
    assert document_length({"tokens": torch.tensor([[1, eod, 3, eod]])}, eod) == 4  # ends whole
    cu = torch.tensor([[0, 3, 7, 10, 10, 10]], dtype=torch.int32)
    assert document_length({"tokens": tokens, "cu_seqlens": cu}, eod) == 7
    batch = dict(tokens=tokens, labels=tokens + 1, loss_mask=torch.ones(1, 10),
                 position_ids=torch.arange(10).unsqueeze(0), cu_seqlens=cu,
                 max_seqlen=torch.tensor([4], dtype=torch.int32),
                 attention_mask=torch.ones(1, 1, 10, 10, dtype=torch.bool))
    short = cut(batch, 7)
    assert short["tokens"].tolist() == [[1, 2, eod, 3, 4, 5, eod]]
    assert short["labels"].shape == short["loss_mask"].shape == (1, 7)
    assert short["attention_mask"].shape == (1, 1, 7, 7)
    assert short["cu_seqlens"].tolist() == [[0, 3, 7]] and short["max_seqlen"].tolist() == [4]
    drawn = [lognormal_length(i, seed=5, salt=0, low=16, high=256, sigma=0.8, multiple=8)
             for i in range(200)]
    assert drawn == [lognormal_length(i, seed=5, salt=0, low=16, high=256, sigma=0.8,
                                      multiple=8) for i in range(200)]
    assert all(16 <= n <= 256 and n % 8 == 0 for n in drawn) and len(set(drawn)) > 10
    assert drawn != [lognormal_length(i, seed=5, salt=1, low=16, high=256, sigma=0.8,
                                      multiple=8) for i in range(200)]


# (name, ranks, flags). CI resumes one run that has it all on two ranks: interleaved Seq1F1B
# with the distributed optimizer (a Megatron-Core distributed checkpoint); SEQ1F1B_FULL=1 also
# resumes plain Seq1F1B, interleaved without, and the distributed optimizer over dp2.
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--seq1f1b", "--seq1f1b-splits", "3",
               "--num-layers-per-virtual-pipeline-stage", "1"]
RESUME_CASES = [("interleaved-distopt", 2, [*INTERLEAVED, "--use-distributed-optimizer"])]
if FULL:
    RESUME_CASES += [
        ("seq1f1b", 2, ["--pipeline-model-parallel-size", "2", "--seq1f1b", "--seq1f1b-splits",
                        "4"]),
        ("interleaved", 2, INTERLEAVED),
        ("seq1f1b-distopt-dp2", 4, ["--pipeline-model-parallel-size", "2", "--seq1f1b",
                                    "--seq1f1b-splits", "2", "--use-distributed-optimizer"]),
    ]


@pytest.mark.parametrize("name,nproc,flags", RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_resume_is_bit_exact(tmp_path, name, nproc, flags):
    """10 iterations straight == 5, save, new processes, load, 5 (losses and weights, bitwise).

    Dropout and a warm-up + cosine LR schedule make it depend on restored RNG and schedule.
    """
    common = [*flags, "--train-iters", "10", "--lr-decay-style", "cosine", "--lr-warmup-iters",
              "2", "--hidden-dropout", "0.1"]
    straight, _ = train(tmp_path, "straight", nproc, *common)
    saved = tmp_path / "ckpt"
    first, stdout = train(tmp_path, "first", nproc, *common, "--exit-interval", "5",
                          "--save", str(saved))
    assert "exiting after iteration 5" in stdout and (saved / "iter_0000005").is_dir()
    if "--use-distributed-optimizer" in flags:
        assert (saved / "iter_0000005" / "sharded").is_dir()
    resumed, _ = train(tmp_path, "resumed", nproc, *common, "--load", str(saved))
    assert first["summary"]["losses"] + resumed["summary"]["losses"] == \
        straight["summary"]["losses"]
    assert resumed["summary"]["weights_sha256"] == straight["summary"]["weights_sha256"]
    assert first["summary"]["weights_sha256"] != straight["summary"]["weights_sha256"]


# The script itself, end to end (tests/test_rejections.py walks every rule in-process; CI
# launches the script for three of them, SEQ1F1B_FULL=1 for the hybrid patterns' too).
BAD_FLAGS = [
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2 needs --seq1f1b"),
    (["--seq-length", "2", "--seq1f1b", "--seq1f1b-splits", "4"], "use at most 2 splits"),
]
if FULL:
    BAD_FLAGS += [
        (["--hybrid-layer-pattern", "*D-"], "this trainer builds attention (*), multi-latent"),
        (["--hybrid-layer-pattern", "*G-", *RECURRENT_SIZES], "add --swiglu"),
        (["--hybrid-layer-pattern", "+-+-"], "(+) take their sizes from --multi-latent-attention"),
    ]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_bad_flags_fail_fast_with_their_message(flags, message):
    cmd = [sys.executable, str(SCRIPT), *BASE, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


@full_only
def test_real_text_from_pydoc_trains(tmp_path):
    prefix = tmp_path / "pydoc"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_dataset.py"),
                           "--output", str(prefix)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pydoc.bin").stat().st_size > 100_000
    flags = [f for f in BASE if f not in ("--mock-data",)]
    flags[flags.index("--vocab-size") + 1] = "257"
    log = tmp_path / "real.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={_port()}", str(SCRIPT), *flags, "--data-path", str(prefix),
           "--tokenizer-type", "ByteTokenizer", "--data-cache-path", str(tmp_path / "cache"),
           "--pipeline-model-parallel-size", "2", "--train-iters", "8", "--seq1f1b",
           "--seq1f1b-splits", "2", "--lr", "3e-3", "--log-json", str(log)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    losses = json.loads(log.read_text())["summary"]["losses"]
    assert losses[-1] < losses[0] - 0.3, losses  # English bytes: the unigram statistics come fast


def test_cuda_fusions_are_megatrons_own_and_only_on_cuda(monkeypatch):
    """Both schedules get the fusions Megatron-Core has without TE or Apex on CUDA; a CPU none;
    the configuration they make is one Megatron accepts (GeLU fusion needs biases)."""
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer import TransformerConfig

    from megatron_seq1f1b.trainer.setup import cuda_fusions

    off = cuda_fusions(SimpleNamespace(swiglu=True, disable_bias_linear=False))
    assert not any(v for k, v in off.items() if k != "cross_entropy_fusion_impl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for swiglu, no_bias, activation in [(False, False, True), (True, True, True),
                                        (False, True, False)]:
        fusions = cuda_fusions(SimpleNamespace(swiglu=swiglu, disable_bias_linear=no_bias,
                                               bf16=True))
        assert fusions["bias_activation_fusion"] is activation
        assert fusions["bias_dropout_fusion"] and fusions["cross_entropy_loss_fusion"]
        # Megatron's fused cross entropy returns bf16 gradients: not for fp32 / fp16
        assert not cuda_fusions(SimpleNamespace(swiglu=swiglu, disable_bias_linear=no_bias,
                                                bf16=False))["cross_entropy_loss_fusion"]
        assert not fusions["apply_rope_fusion"] and not fusions["gradient_accumulation_fusion"]
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                          gated_linear_unit=swiglu, add_bias_linear=not no_bias,
                          activation_func=(torch.nn.functional.silu if swiglu
                                           else torch.nn.functional.gelu), **fusions)
