"""Stage rehearsal (planner/rehearse.py) and the planner's memory per stage (planner/footprint.py).

A rehearsed stage must do what that stage does in a real pipeline: the same actions in
the same order, and the same activations. Activations are counted as the bytes autograd
saves for backward (memory.SavedActivations), in the real gloo pipeline and alone: on
CPU the resident set cannot resolve a tiny model's tensors (glibc keeps freed pages), so
this is the CPU's honest measure of activation memory; the CUDA allocator's peak is
the rehearsal's measure on a GPU (scripts/gpu_rehearse.sh).
"""

import json
from types import SimpleNamespace

import pytest

import rehearse_cases as cases
from gpt import DataSpec, ModelSpec
from megatron_seq1f1b.planner import MemoryModel, choose_plan, stage_memory
from megatron_seq1f1b.planner.footprint import (
    ModelShape, Training, activation_bytes_per_token, stage_activation_bytes, stage_parameters,
    virtual_stage_parameters,
)
from megatron_seq1f1b.schedules.schedule import build_schedule

MODEL = ModelSpec(tied_embeddings=False)
DATA = DataSpec(num_microbatches=4)

REHEARSED = [  # (pp, k, schedule, vpp, partition)
    (2, 1, "1f1b", None, "uniform"),      # Megatron's 1F1B
    (2, 2, "zb-h1", None, "uniform"),     # zero bubble (W actions)
    (2, 2, "1f1b", 2, "uniform"),         # interleaved, two chunks per rank
    (4, 3, "1f1b", None, "balanced"),     # Seq1F1B k=3
]


@pytest.mark.parametrize("pp,k,schedule,vpp,partition", REHEARSED,
                         ids=["pp2-1f1b", "pp2-zb-h1-k2", "pp2-vpp2-k2", "pp4-k3"])
def test_rehearsed_stage_does_what_the_stage_does_in_a_pipeline(ranks, pp, k, schedule, vpp,
                                                                 partition):
    results = ranks.run(pp, cases.pipeline_then_rehearsal, case=f"rehearse-{pp}-{k}-{schedule}"
                        f"-{vpp}", pp=pp, k=k, schedule=schedule, model=MODEL, data=DATA,
                        vpp=vpp, partition=partition)
    v = vpp or 1
    shape = ModelShape.from_config(SimpleNamespace(
        num_layers=MODEL.num_layers, hidden_size=MODEL.hidden_size,
        num_attention_heads=MODEL.num_attention_heads, ffn_hidden_size=4 * MODEL.hidden_size),
        MODEL.vocab_size)
    planned = stage_parameters(shape, pp, v)
    expected = build_schedule(pp, DATA.num_microbatches, k, v, schedule=schedule,
                              costs=None) if schedule == "1f1b" else None
    for r in results:
        stage, real, alone = r["stage"], r["real"], r["rehearsal"]
        assert alone["actions"] == real["actions"], (stage, alone["actions"], real["actions"])
        # cut as the pipeline cuts (a balanced cut weighs the whole model's layers)
        assert alone["lengths"] == real["lengths"], (stage, alone["lengths"], real["lengths"])
        if expected is not None:
            assert real["actions"] == [str(a) for a in expected[stage]]
        assert any(a.startswith("W") for a in real["actions"]) == (schedule != "1f1b")
        # the stage's own layers, embedding first, output layer and loss last
        assert r["layers"] == [MODEL.num_layers // (pp * v)] * v
        assert r["pre_post"] == [(c * pp + stage == 0, c * pp + stage == pp * v - 1)
                                 for c in range(v)]
        assert alone["parameter_bytes"] == real["parameter_bytes"] == 4 * planned[stage]
        assert real["saved_peak"] > 0
        assert abs(alone["activation_bytes"] - real["saved_peak"]) <= 0.05 * real["saved_peak"], \
            (stage, alone["activation_bytes"], real["saved_peak"])


def test_cli_measures_and_predicts_the_stage(ranks):
    """The command line on a one-rank worker: the last stage of pp=4 with Adam, k=1, and
    its calibration (segments timed on the enabled stage); its parameters equal the
    planner's weights for that stage exactly."""
    argv = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "64", "--pipeline-model-parallel-size", "4",
            "--rehearse-stage", "3", "--num-microbatches", "4", "--seq1f1b-splits", "1",
            "--iters", "1", "--warmup", "1", "--save-calibration", "CALIBRATION",
            "--min-segment-length", "8", "--calibration-reps", "1"]
    (out,) = ranks.run(1, cases.cli, case="rehearse-cli", argv=argv)
    rehearsal, predicted = out["rehearsal"], out["predicted"]
    calibration = out["calibration"]  # the stage's segments timed: a one-stage calibration
    assert calibration["format"] == "megatron_seq1f1b.calibration"
    assert len(calibration["stages"]) == 1 and calibration["bytes_per_token"] > 0
    assert calibration["quadratic"] == "rectangle"  # Megatron's local attention
    assert "stage 3 of 4 rehearsed alone" in calibration["source"]
    assert rehearsal["stage"] == 3 and rehearsal["lengths"] == [32]  # Megatron's 1F1B
    assert rehearsal["actions"] == [str(a) for a in build_schedule(4, 4, 1)[3]]
    assert rehearsal["parameter_bytes"] == predicted["weights"]
    assert predicted["same_actions"]  # the planner replayed the actions the stage ran
    assert predicted["optimizer"] == 2 * predicted["weights"]  # fp32: Adam's two moments
    assert rehearsal["activation_bytes"] > 0 and rehearsal["compute_s"] > 0


def test_a_rehearsed_stage_cuts_by_the_whole_model_as_the_pipeline_does(ranks):
    """A balanced cut and zero-bubble costs weigh the whole model's layers against its output
    layer: a stage built alone (its config numbering only its own 2 of 8 layers) cut
    [131, 129, 127, 125] where its pipeline cuts [137, 131, 124, 120]."""
    from megatron_seq1f1b.planner import rehearse_cli
    from megatron_seq1f1b.runtime.executor_setup import flop_costs
    from megatron_seq1f1b.schedules.partition import CostModel, split_sequence

    argv = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "512", "--vocab-size", "32000", "--pipeline-model-parallel-size",
            "4", "--rehearse-stage", "0", "--num-microbatches", "4", "--seq1f1b-splits", "4",
            "--seq1f1b-partition", "balanced", "--seq1f1b-schedule", "zb-h1", "--iters", "1"]
    (out,) = ranks.run(1, cases.cli, case="rehearse-whole-cut", argv=argv)
    whole = rehearse_cli._config(rehearse_cli.build_parser().parse_args(argv))
    flops = CostModel.from_config(whole, 32000, dense_attention=True)  # the local attention
    expected = split_sequence(512, 4, "balanced", cost=flops)
    assert out["rehearsal"]["lengths"] == expected == [137, 131, 124, 120]
    placed = build_schedule(4, 4, 4, schedule="zb-h1", costs=flop_costs(expected, flops))
    assert out["rehearsal"]["actions"] == [str(a) for a in placed[0]]  # W placed alike


def test_whole_micro_batches_keep_the_qkv_projection_segments_do_not(ranks):
    """Megatron's attention gets the values as a view of the QKV projection's output, so a
    whole micro-batch keeps all of it; segments copy keys and values into the K/V buffer.
    The planner must see both: its activations are within 5% of the bytes counted on the
    rehearsed stage, at k=1 as at k=2 (without the whole-QKV term k=1's prediction fell
    ~12% further short; the ~2% left is the unfused attention's probabilities and masks,
    which the estimate leaves out)."""
    argv = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "64", "--pipeline-model-parallel-size", "4",
            "--rehearse-stage", "1", "--num-microbatches", "4", "--iters", "1", "--warmup", "1",
            "--count-saved", "yes", "--min-segment-length", "8", "--seq1f1b-splits"]
    share = {}
    for k in (1, 2):
        (out,) = ranks.run(1, cases.cli, case=f"rehearse-qkv-k{k}", argv=argv + [str(k)])
        share[k] = out["predicted"]["activations"] / out["rehearsal"]["activation_bytes"]
    assert all(0.95 < share[k] <= 1.0 for k in share) and abs(share[1] - share[2]) < 0.02, share


def test_stage_building_refuses_what_it_cannot_rehearse():
    from megatron_seq1f1b.base.checks import ConfigError
    from megatron_seq1f1b.planner.rehearse import build_stage_chunks

    config = SimpleNamespace(num_layers=4, window_attn_skip_freq=2)
    with pytest.raises(ConfigError) as error:
        build_stage_chunks(config, 3, 3, vocab_size=8, max_sequence_length=8)
    text = str(error.value)
    assert "window_attn_skip_freq" in text and "stage must be in [0, 3)" in text
    assert "4 layers do not split evenly over 3" in text


# ------------------------------------------------------------------ footprint (pure)

GPT13B = ModelShape(num_layers=24, hidden_size=2048, num_attention_heads=16,
                    ffn_hidden_size=8192, vocab_size=50257)


def test_parameters_per_stage_by_hand():
    h, v = 2048, 50257
    layer = 12 * h * h + 13 * h  # qkv 3h^2+3h, proj h^2+h, fc1 4h^2+4h, fc2 4h^2+h, 2 norms 4h
    assert GPT13B.layer_parameters() == layer
    assert stage_parameters(GPT13B, 4) == [6 * layer + v * h, 6 * layer, 6 * layer,
                                           6 * layer + 2 * h + v * h]
    # tied: one rank holds one copy; more stages: the last keeps its own
    tied = ModelShape(**{**GPT13B.__dict__, "tied_embeddings": True})
    assert stage_parameters(tied, 1) == [24 * layer + v * h + 2 * h]
    assert stage_parameters(tied, 2)[1] == 12 * layer + 2 * h + v * h
    # interleaved: rank 0 holds virtual stages 0 and 4 of 8
    per_virtual = virtual_stage_parameters(GPT13B, 4, 2)
    assert per_virtual[0] == 3 * layer + v * h and per_virtual[-1] == 3 * layer + 2 * h + v * h
    assert stage_parameters(GPT13B, 4, 2)[0] == per_virtual[0] + per_virtual[4]
    # SwiGLU, GQA, RMSNorm, no biases
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                       ffn_hidden_size=96, vocab_size=10, gated_linear_unit=True,
                       normalization="RMSNorm", add_bias_linear=False)
    assert shape.layer_parameters() == 2 * 64 + 64 * (64 + 2 * 16) + 64 * 64 + 64 * 192 + 96 * 64


@pytest.mark.parametrize("training, per_param", [
    (Training("bf16"), (2, 4, 12)),  # fp32 main grads; fp32 master weights + 2 moments
    (Training("bf16", distributed_optimizer=True, data_parallel_size=2), (2, 4, 6)),
    (Training("bf16", grad_reduce_in_fp32=False), (2, 2, 12)),
    (Training("fp32"), (4, 4, 8)),  # no master copy
    (Training("fp32", distributed_optimizer=True, data_parallel_size=4), (4, 4, 2)),
    (Training("bf16", optimizer=None), (2, 4, 0)),
])
def test_bytes_per_parameter(training, per_param):
    got = training.bytes_per_parameter()
    assert (got["weights"], got["gradients"], got["optimizer"]) == per_param


def test_activation_bytes_follow_units_and_the_kv_buffer():
    # one rank, two micro-batches, two segments of 3 and 1 tokens:
    # F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 B1.0
    schedule = build_schedule(1, 2, 2)
    assert [str(a) for a in schedule[0][:5]] == ["F0.0", "F0.1", "B0.1", "F1.0", "B0.0"]
    rest, kv = 10.0, 2.0  # bytes per token, of which keys and values
    (peak,) = stage_activation_bytes(schedule, [3, 1], [[(rest + kv, kv)]])
    # a segment 0 holds its 3 tokens and the whole sequence's K/V (4 tokens) until B?.0:
    # after F1.0 both micro-batches' segment 0 are alive
    assert peak == 2 * (3 * rest + 4 * kv)
    (one,) = stage_activation_bytes(build_schedule(1, 2, 1), [4], [[(rest + kv, kv)]])
    assert one == 4 * (rest + kv)
    per_token, kv_part = activation_bytes_per_token(GPT13B, 6, first=True, last=False)
    assert per_token == (6 * 2 * (4 * 2048 + 3 * 2048 + 8192 + 8192) + 6 * 4 * 2048 + 8
                         + 6 * (4 * 16 + 4 * 128 * 2))  # flash's log-sum-exp, RoPE's cos/sin
    assert kv_part == 6 * 4 * 2048
    whole, _ = activation_bytes_per_token(GPT13B, 6, first=True, last=False, whole_qkv=True)
    assert whole - per_token == 6 * 2 * (2048 + 2048)  # the projection's query and key parts


def test_stage_memory_adds_weights_gradients_optimizer_and_activations():
    lengths = [8192] * 4
    training = Training("bf16", distributed_optimizer=True, data_parallel_size=2)
    stages = stage_memory(GPT13B, training, 4, 4, lengths)
    params = stage_parameters(GPT13B, 4)
    for stage, entry, n in zip(range(4), stages, params):
        assert entry["weights"] == 2 * n and entry["gradients"] == 4 * n
        assert entry["optimizer"] == 6 * n
        assert entry["total"] == pytest.approx(sum(v for k, v in entry.items() if k != "total"))
    # 1F1B with k=1: stage 0 holds p micro-batches; with k=4 fewer
    one = stage_memory(GPT13B, training, 4, 4, [32768])
    per_token, _ = activation_bytes_per_token(GPT13B, 6, first=True, last=False, whole_qkv=True)
    assert one[0]["activations"] == 4 * 32768 * per_token
    assert stages[0]["activations"] < one[0]["activations"]
    # a measured bytes_per_token rescales every chunk so the busiest stage matches it
    # (measured on a whole micro-batch, as calibrations are: segments keep less)
    model = MemoryModel(GPT13B, training, bytes_per_token=1000.0)
    whole = model.chunk_bytes_per_token(4, whole_qkv=True)
    assert max(b for (b, _), in whole) == pytest.approx(1000.0)
    segments = model.chunk_bytes_per_token(4)
    assert 900.0 < max(b for (b, _), in segments) < 0.95 * 1000.0


def test_planner_prints_gb_per_stage_and_budgets_the_total(tmp_path, capsys):
    from megatron_seq1f1b.planner import main

    out = tmp_path / "plan.json"
    args = ["--seq-length", "32768", "--pp", "4", "--microbatches", "4", "--hidden-size", "2048",
            "--num-layers", "24", "--num-attention-heads", "16", "--ffn-hidden-size", "8192",
            "--vocab-size", "50257", "--untie-embeddings-and-output-weights", "--bf16",
            "--use-distributed-optimizer", "--data-parallel-size", "2", "--splits", "1", "4",
            "--partitions", "balanced", "--schedules", "1f1b", "--gpu-memory-gib", "40",
            "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "predicted memory of the busiest stage" in printed and "stage 0 of 4:" in printed
    assert "max stage" in printed
    assert main(args + ["--top", "0"]) == 0  # every candidate timed, every stage listed
    printed = capsys.readouterr().out
    assert "predicted memory per stage" in printed and "stage 3:" in printed
    data = json.loads(out.read_text())
    by_k = {c["num_splits"]: c for c in data["candidates"]}
    assert by_k[1]["within_budget"] is False and by_k[4]["within_budget"] is True  # k=1: >40 GiB
    stage0 = by_k[1]["stages"][0]
    assert stage0["weights"] == 2 * stage_parameters(GPT13B, 4)[0]


def test_total_budget_needs_a_memory_model():
    with pytest.raises(ValueError, match="memory_model"):
        choose_plan(4096, 2, 2, config=SimpleNamespace(
            hidden_size=64, num_attention_heads=4, kv_channels=None, num_query_groups=None,
            ffn_hidden_size=256, gated_linear_unit=False, num_layers=2), vocab_size=100,
            memory_budget_total_bytes=1e9)


@pytest.mark.parametrize("backend,k,documents,cp", [
    ("local", 1, False, 1), ("local", 4, True, 1), ("flash", 1, False, 1), ("flash", 4, True, 1),
    ("local", 4, False, 2), ("flash", 4, False, 2),
])
def test_predicted_activations_follow_the_attention_path_and_the_documents(ranks, backend, k,
                                                                           documents, cp):
    """Per attention backend, with and without packed documents and context parallelism,
    the planner's activations are within 10% of the bytes counted on the rehearsed stage:
    Megatron's unfused attention keeps its [queries x keys] probabilities (for a whole
    micro-batch they were a third of it), flash keeps none; with documents the K/V buffers
    and the segments' lengths (the documents partition) follow the documents; a
    context-parallel rank holds half the tokens and queries but all keys and values."""
    argv = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "192", "--vocab-size", "64", "--pipeline-model-parallel-size", "4",
            "--rehearse-stage", "0", "--num-microbatches", "4", "--iters", "1", "--warmup", "0",
            "--count-saved", "yes", "--attention-backend", backend, "--seq1f1b-splits", str(k),
            "--context-parallel-size", str(cp)]
    if documents:
        argv += ["--document-length", "40", "--seq1f1b-partition", "documents"]
    (out,) = ranks.run(1, cases.cli, case=f"rehearse-{backend}-k{k}-{documents}-cp{cp}",
                       argv=argv)
    share = out["predicted"]["activations"] / out["rehearsal"]["activation_bytes"]
    assert 0.9 <= share <= 1.1, (share, out["rehearsal"]["lengths"])
    if documents:
        assert out["rehearsal"]["lengths"] != [48] * 4  # cut by the documents


def test_cli_ties_embeddings_unless_told_as_megatron_lm_and_the_planner(ranks):
    """The same model flags mean the same model for the rehearsal, the planner and the
    trainer: embedding and output weights shared unless
    ``--untie-embeddings-and-output-weights`` (one pipeline stage, where sharing saves a
    copy); the planner's weights follow either way."""
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "64", "--pipeline-model-parallel-size", "1",
            "--rehearse-stage", "0", "--num-microbatches", "2", "--seq1f1b-splits", "1",
            "--iters", "1", "--warmup", "0"]
    (tied,) = ranks.run(1, cases.cli, case="rehearse-tied", argv=argv)
    (untied,) = ranks.run(1, cases.cli, case="rehearse-untied",
                          argv=argv + ["--untie-embeddings-and-output-weights"])
    for out in (tied, untied):
        assert out["rehearsal"]["parameter_bytes"] == out["predicted"]["weights"]
    extra = untied["rehearsal"]["parameter_bytes"] - tied["rehearsal"]["parameter_bytes"]
    assert extra == 4 * 64 * 32  # the output layer's own [vocab, hidden] fp32 weight
