"""The planner's memory per layer kind (planner/footprint.py) and the stage rehearsal of hybrid
patterns and multi-token prediction (planner/stage_build.py, python -m megatron_seq1f1b.rehearse).

A HybridModel's layers are its pattern's symbols: attention (*: a norm, QKV, core attention's
saved tensors, the projection; its keys and values carried over), MLP (-), MoE (E), Mamba-2 (M)
and gated delta net (G; recurrent: a fixed-size state carried over, per-chunk scan tensors);
'|' decides which layers each (virtual) stage holds, '/' adds multi-token-prediction depths on
the last stage (their layers, the projection, one more output layer and cross entropy, and the
embedding's copy). The planner's weights must equal the rehearsed stage's parameters byte for
byte and its activations be within 10% of the bytes autograd saved there, as
tests/test_rehearse.py measures GPTModel stages.
"""

import importlib.util
import json
from types import SimpleNamespace

import pytest

import rehearse_cases as cases
from gpt import DataSpec, ModelSpec
from megatron_seq1f1b.planner import MemoryModel, stage_memory
from megatron_seq1f1b.planner.footprint import (
    ModelShape, Training, activation_bytes_per_token, chunk_activation_bytes,
    kind_activation_bytes, stage_attention_layers, stage_parameters, virtual_stage_parameters,
)
from megatron_seq1f1b.planner.stage_build import hybrid_stage_patterns
from megatron_seq1f1b.schedules.schedule import build_schedule

HYBRID = importlib.util.find_spec("megatron.core.models.hybrid") is not None
needs_hybrid = pytest.mark.skipif(not HYBRID,
                                  reason="HybridModel is in megatron-core 0.18 and later")

# ------------------------------------------------------------------ pure: counting by kind

H, V = 64, 100
SHAPE = dict(hidden_size=H, num_attention_heads=4, vocab_size=V, ffn_hidden_size=4 * H,
             add_bias_linear=False, num_moe_experts=4, moe_router_topk=2)
DENSE = {k: v for k, v in SHAPE.items() if not k.startswith(("num_moe", "moe"))}


def _hybrid(pattern: str, **fields) -> ModelShape:
    layers = len(pattern.split("/")[0].replace("|", ""))
    return ModelShape(num_layers=layers, hybrid_layer_pattern=pattern, **{**SHAPE, **fields})


def test_parameters_per_layer_kind_by_hand():
    shape = _hybrid("*-E")
    norm = 2 * H  # LayerNorm: weight and bias
    attention = norm + H * 3 * H + H * H
    mlp = norm + H * 4 * H + 4 * H * H
    moe = norm + 4 * H + 4 * (H * 4 * H + 4 * H * H)  # router, 4 experts
    assert shape.kind_parameters("attention") == attention
    assert shape.kind_parameters("mlp") == mlp
    assert shape.kind_parameters("moe") == moe
    # a GPTModel layer is one attention and one MLP: its old count, unchanged
    gpt = ModelShape(num_layers=2, **DENSE)
    assert gpt.layer_parameters() == attention + mlp
    # a pattern's stages hold their own layers: the embedding first, output layer last
    assert stage_parameters(_hybrid("*-|E-"), 2) == [attention + mlp + V * H,
                                                      moe + mlp + norm + V * H]
    # MTP (one depth of '*-'): three norms, the [2h -> h] projection, its layers, and the
    # last stage's copy of the embedding
    mtp = 3 * norm + 2 * H * H + attention + mlp
    with_mtp = _hybrid("*-|E-/*-")
    assert with_mtp.mtp_parameters() == mtp
    assert stage_parameters(with_mtp, 2) == [attention + mlp + V * H,
                                             moe + mlp + norm + V * H + mtp + V * H]
    # one stage: the embedding is shared, tied output weights too
    tied = _hybrid("*-E/*-", tied_embeddings=True)
    assert stage_parameters(tied, 1) == [attention + mlp + moe + V * H + norm + mtp]
    assert tied.total_parameters() == stage_parameters(tied, 1)[0]
    # GPTModel MTP: each depth one layer like the last
    gpt_mtp = ModelShape(num_layers=4, mtp_num_layers=2, **DENSE)
    assert gpt_mtp.mtp_parameters() == 2 * (3 * norm + 2 * H * H + attention + mlp)


def test_layers_per_stage_follow_the_pattern():
    shape = _hybrid("*-*E|-|-E|*-*-/*-/*-")
    assert [len(s) for s in shape.stage_layers(4)] == [4, 1, 2, 4]
    assert shape.stage_layers(4)[1] == [("mlp",)]
    assert stage_attention_layers(shape, 4) == [2, 0, 0, 2 + 2]  # MTP depths' attention
    # interleaved: virtual stage c * p + r on rank r
    assert virtual_stage_parameters(shape, 2, 2)[1] == shape.kind_parameters("mlp")
    with pytest.raises(ValueError, match="4 '|' stages for 2 virtual"):
        shape.stage_layers(2)
    # a pattern without '|' splits evenly, as Megatron does without pipes
    assert _hybrid("*-*-").stage_layers(2) == [[("attention",), ("mlp",)]] * 2
    # the rehearsal's stage patterns: its '|' part, MTP on the last
    assert hybrid_stage_patterns("*-*E|*-*-/*-", 2) == ["*-*E", "*-*-/*-"]
    assert hybrid_stage_patterns("*-*E|*-*-/*-", 2, mtp=False) == ["*-*E", "*-*-"]
    with pytest.raises(ValueError, match="not \\+"):
        _hybrid("*+-")
    with pytest.raises(ValueError, match="mtp_num_layers=1 with a pattern of 2"):
        _hybrid("*-/*/*", mtp_num_layers=1)
    assert _hybrid("*-/*/*", mtp_num_layers=0).mtp_layers() == []


def test_activations_per_layer_kind():
    """An MLP or MoE layer keeps no keys and values; the kinds add up to a GPTModel layer; the
    GPTModel estimate is what it was."""
    shape = _hybrid("*-E")
    attention = kind_activation_bytes(shape, "attention", dtype="fp32")
    mlp = kind_activation_bytes(shape, "mlp", dtype="fp32")
    moe = kind_activation_bytes(shape, "moe", dtype="fp32")
    assert attention[1] == 2 * H * 4 and mlp[1] == moe[1] == 0
    assert mlp[0] == 4 * (2 * H + 4 * H + 4 * H)
    # per routed copy: the permuted input, activation input, output and weighted output
    assert moe[0] == 4 * 2 * H + 2 * (4 * (H + 3 * 4 * H) + 40)
    gpt = ModelShape(num_layers=4, **DENSE)
    one = chunk_activation_bytes(gpt, [("attention", "mlp")] * 2, first=True, last=False)
    assert one == activation_bytes_per_token(gpt, 2, first=True, last=False)
    kinds = chunk_activation_bytes(shape, [("attention",), ("mlp",)], first=True, last=False)
    assert kinds == activation_bytes_per_token(gpt, 1, first=True, last=False)
    # the last chunk carries the MTP block: its depths' layers and one more output layer
    plain = chunk_activation_bytes(_hybrid("*-"), [("attention",), ("mlp",)], first=False,
                                   last=True)
    mtp = chunk_activation_bytes(_hybrid("*-/*-"), [("attention",), ("mlp",)], first=False,
                                 last=True)
    extra = sum(kind_activation_bytes(shape, k)[0] for k in ("attention", "mlp"))
    assert mtp[0] - plain[0] == extra + 8 + 2 * 6 * H + 4 * V + 8 + 8
    assert mtp[1] == 2 * plain[1]  # the depth's attention keeps keys and values too


def test_gpt_predictions_without_pattern_or_mtp_are_unchanged():
    """A GPTModel's memory model reads the same numbers with the new fields left out."""
    gpt13b = ModelShape(num_layers=24, hidden_size=2048, num_attention_heads=16,
                        ffn_hidden_size=8192, vocab_size=50257)
    h, v = 2048, 50257
    layer = 12 * h * h + 13 * h
    assert stage_parameters(gpt13b, 4) == [6 * layer + v * h, 6 * layer, 6 * layer,
                                           6 * layer + 2 * h + v * h]
    model = MemoryModel(gpt13b, Training("bf16"))
    table = model.chunk_bytes_per_token(4)
    assert table[1][0] == activation_bytes_per_token(gpt13b, 6, first=False, last=False)
    config = SimpleNamespace(num_layers=24, hidden_size=2048, num_attention_heads=16,
                             ffn_hidden_size=8192, mtp_num_layers=None)
    assert stage_memory(ModelShape.from_config(config, v), Training("bf16"), 4, 4,
                        [8192] * 4) == stage_memory(gpt13b, Training("bf16"), 4, 4, [8192] * 4)


# ------------------------------------------------------------------ recurrent layers (M, G)

#: tests/gpt.py's small Mamba-2 (4 heads of 8 in 2 groups, state 8) and gated delta net (2 key
#: heads, 4 value heads of 8)
MAMBA = dict(mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, mamba_num_heads=4)
GDN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
           linear_num_value_heads=4)
MAMBA_FLAGS = ["--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
               "--mamba-num-heads", "4"]
GDN_FLAGS = ["--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
             "--linear-num-key-heads", "2", "--linear-num-value-heads", "4"]


def test_recurrent_parameters_by_hand():
    """Megatron's MambaLayer and GatedDeltaNet layer, counted by hand; per TP rank the
    projections, convolutions and per-head vectors split, the norms do not."""
    shape = _hybrid("M-G", **MAMBA, **GDN)
    norm = 2 * H
    inner, conv = 4 * 8, 4 * 8 + 2 * 2 * 8  # d_inner; x B C
    mamba = (norm + H * (2 * inner + 2 * 2 * 8 + 4)  # in_proj: z x B C dt
             + conv * 4 + conv  # depthwise convolution (width 4) and its bias
             + 3 * 4  # dt_bias, A_log, D per head
             + inner + inner * H)  # gated norm, out_proj
    qk, v = 2 * 8, 4 * 8
    gdn = (norm + H * (2 * qk + 2 * v + 2 * 4)  # in_proj: q k v z beta alpha
           + (2 * qk + v) * 4  # convolution over q k v (width 4, no bias)
           + 2 * 4  # dt_bias, A_log per value head
           + 2 * 8 + v * H)  # output norm over one head (LayerNorm), out_proj
    assert shape.kind_parameters("mamba") == mamba
    assert shape.kind_parameters("gdn") == gdn
    assert stage_parameters(_hybrid("M-|G*", **MAMBA, **GDN), 2) == [
        mamba + shape.kind_parameters("mlp") + V * H,
        gdn + shape.kind_parameters("attention") + norm + V * H]
    # TP 2: everything but the two norms (and the GDN's output norm) halves
    assert shape.kind_parameters("mamba", 2) == norm + (mamba - norm) // 2
    assert shape.kind_parameters("gdn", 2) == norm + 2 * 8 + (gdn - norm - 2 * 8) // 2
    with pytest.raises(ValueError, match="must divide by mamba_num_groups 3"):
        _hybrid("M-", **{**MAMBA, "mamba_num_groups": 3})


def test_recurrent_activations_per_kind():
    """M and G keep no keys and values; their per-token bytes grow with the hidden sizes; the
    state a segment starts from is held by every segment but the first; the reference kernels
    keep whole padded chunks, the CUDA ones do not."""
    from megatron_seq1f1b.planner.recurrent import recurrent_unit_bytes

    shape = _hybrid("M-G", **MAMBA, **GDN)
    for kind in ("mamba", "gdn"):
        for kernels in ("cuda", "reference"):
            total, kv = kind_activation_bytes(shape, kind, dtype="fp32",
                                              recurrent_kernels=kernels)
            assert kv == 0 and total > 0
            units = recurrent_unit_bytes(shape, kind, dtype="fp32", kernels=kernels)
            assert units.bytes(48, True) > units.bytes(48, False)  # the carried state
        reference = recurrent_unit_bytes(shape, kind, dtype="fp32", kernels="reference")
        chunk = 128 if kind == "mamba" else 64
        # a short unit pays for a whole chunk: 1 or chunk - 1 tokens of one chunk cost alike
        assert reference.bytes(1, False) == reference.bytes(chunk - 1, False)
        assert reference.bytes(chunk + 1, False) > 1.5 * reference.bytes(chunk, False)
    # stage 0 of 2, 4 micro-batches of 192 tokens in 4 segments: with the CUDA kernels it holds
    # less than unsplit, with the reference kernels (every segment a padded chunk) more
    model = {k: MemoryModel(_hybrid("M-|M-", **MAMBA), Training("fp32", optimizer=None),
                            recurrent_kernels=k) for k in ("cuda", "reference")}
    held = {k: [m.stage_bytes(build_schedule(2, 4, len(lengths)), lengths)[0]["activations"]
                for lengths in ([192], [48] * 4)] for k, m in model.items()}
    assert held["cuda"][1] < held["cuda"][0]
    assert held["reference"][1] > held["reference"][0]


def test_balanced_partition_of_recurrent_patterns_is_nearly_uniform():
    """Recurrent layers cost linear time: a pattern of Mamba-2 (or GDN) layers with one
    attention layer is cut nearly uniformly; attention everywhere is not."""
    from megatron_seq1f1b.schedules.partition import split_sequence

    def spread(pattern: str) -> float:
        config = SimpleNamespace(
            hidden_size=1024, num_layers=len(pattern), num_attention_heads=16, kv_channels=None,
            num_query_groups=None, ffn_hidden_size=4096, gated_linear_unit=False,
            mtp_num_layers=None, num_moe_experts=None, moe_layer_freq=1)
        lengths = split_sequence(4096, 4, "balanced", config=config, vocab_size=32000,
                                 pattern=pattern)
        assert sum(lengths) == 4096
        return max(lengths) / min(lengths)

    mamba, gdn, attention = spread("M-M-M*-"), spread("G-G-G*-"), spread("*-*-*-*")
    assert mamba < 1.1 and gdn < 1.1, (mamba, gdn)
    assert mamba - 1 < (attention - 1) / 3, (mamba, attention)


def test_planner_cli_takes_recurrent_patterns(tmp_path):
    """--hybrid-layer-pattern with M and G: weights per stage from the --mamba-* / --linear-*
    sizes; the reference kernels' activations as the rehearsal on CPU counts them."""
    from megatron_seq1f1b.planner import main

    pattern = "M-M-|M*-|G-*G|-G*-"
    flags = ["--seq-length", "4096", "--pp", "4", "--microbatches", "8", "--hidden-size",
             "256", "--num-attention-heads", "4", "--vocab-size", "1000", "--splits", "1", "4",
             "--top", "0", "--hybrid-layer-pattern", pattern, *MAMBA_FLAGS, *GDN_FLAGS]
    shape = ModelShape(num_layers=15, hidden_size=256, num_attention_heads=4, vocab_size=1000,
                       hybrid_layer_pattern=pattern, tied_embeddings=True, **MAMBA, **GDN)
    stages = {}
    for kernels in ("cuda", "reference"):
        out = tmp_path / f"{kernels}.json"
        assert main(flags + ["--recurrent-kernels", kernels, "--json", str(out)]) == 0
        candidates = json.loads(out.read_text())["candidates"]
        for candidate in candidates:
            assert [s["weights"] for s in candidate["stages"]] == [
                4 * n for n in stage_parameters(shape, 4)]
        stages[kernels] = {(c["num_splits"], c["schedule"], c["partition"]): c["stages"]
                           for c in candidates}
    key = next(iter(stages["cuda"]))
    assert stages["reference"][key][0]["activations"] > stages["cuda"][key][0]["activations"]


# ------------------------------------------------------------------ rehearsed vs predicted

BASE = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "192",
        "--vocab-size", "64", "--num-microbatches", "4", "--iters", "1", "--warmup", "0",
        "--count-saved", "yes", "--disable-bias-linear"]

PREDICTED = [  # (model flags, pipeline stages, stage, attention, k)
    (["--hybrid-layer-pattern", "*-*E|*-*-", "--num-experts", "4"], 2, 0, "flash", 4),
    (["--hybrid-layer-pattern", "*-*E|*-*-", "--num-experts", "4"], 2, 1, "flash", 4),
    (["--hybrid-layer-pattern", "*-*E|*-*-/*-", "--num-experts", "4"], 2, 0, "flash", 1),
    (["--hybrid-layer-pattern", "*-*E|*-*-/*-", "--num-experts", "4"], 2, 1, "flash", 4),
    (["--hybrid-layer-pattern", "*-*E|*-*-/*-/*-", "--num-experts", "4"], 2, 1, "local", 3),
    (["--num-layers", "4", "--mtp-num-layers", "2"], 2, 1, "flash", 3),
    # recurrent layers: the rehearsal runs the reference kernels (CPU); k = 4 segments of about
    # 48 tokens, each padded to a whole scan chunk (128 for Mamba-2, 64 for the delta rule)
    (["--hybrid-layer-pattern", "M-M-|M*-", *MAMBA_FLAGS], 2, 0, "flash", 1),
    (["--hybrid-layer-pattern", "M-M-|M*-", *MAMBA_FLAGS, "--seq1f1b-partition", "balanced"],
     2, 0, "flash", 4),
    (["--hybrid-layer-pattern", "G-*G|-G*-", *GDN_FLAGS, "--seq1f1b-partition", "balanced"],
     2, 0, "flash", 4),
    (["--hybrid-layer-pattern", "G-*G|-G*-", *GDN_FLAGS], 2, 1, "flash", 1),
]


@pytest.mark.parametrize("flags,pp,stage,attention,k", PREDICTED,
                         ids=["hybrid-s0", "hybrid-last", "hybrid-mtp-s0-k1", "hybrid-mtp-last",
                              "hybrid-mtp2-last-local", "gpt-mtp2-last", "mamba-s0-k1",
                              "mamba-s0-k4-balanced", "gdn-s0-k4-balanced", "gdn-last-k1"])
def test_planner_predicts_the_rehearsed_stage(ranks, flags, pp, stage, attention, k):
    """Per layer kind, with and without MTP: the planner's weights are the rehearsed stage's
    parameters exactly and its activations within 10% of the bytes autograd saved there
    (measured: Mamba-2 stage 0 0.999 at k=1 and k=4; GDN stage 0 1.005 at k=4, stage 1 0.975
    at k=1)."""
    if "--hybrid-layer-pattern" in flags and not HYBRID:
        pytest.skip("HybridModel is in megatron-core 0.18 and later")
    argv = BASE + flags + ["--pipeline-model-parallel-size", str(pp), "--rehearse-stage",
                           str(stage), "--attention-backend", attention, "--seq1f1b-splits",
                           str(k)]
    (out,) = ranks.run(1, cases.cli, case=f"rehearse-kinds-{'-'.join(flags)}-{stage}-{k}",
                       argv=argv)
    rehearsal, predicted = out["rehearsal"], out["predicted"]
    assert predicted["same_actions"]
    assert rehearsal["parameter_bytes"] == predicted["weights"]
    share = predicted["activations"] / rehearsal["activation_bytes"]
    assert 0.9 <= share <= 1.1, (share, rehearsal["lengths"])


REHEARSED = [  # (model, pp, vpp, k, partition)
    (ModelSpec(hybrid="*-*E|*-*-/*-", extra=(("num_moe_experts", 4), ("moe_router_topk", 2),
                                              ("add_bias_linear", False),
                                              ("moe_token_dispatcher_type", "alltoall"))),
     2, None, 3, "balanced"),
    (ModelSpec(hybrid="*-|-E|*-|*-", extra=(("num_moe_experts", 4), ("add_bias_linear", False),
                                             ("moe_token_dispatcher_type", "alltoall"))),
     2, 2, 2, "uniform"),
    (ModelSpec(extra=(("mtp_num_layers", 2),)), 2, None, 3, "uniform"),
    # stage 0 without attention layers: it cuts by the kind stage 1 has (local, dense:
    # [38, 33, 30, 27]; by its own, none, it would cut [39, 33, 30, 26])
    (ModelSpec(hybrid="--|*-*-", hidden_size=16, seq_length=128), 2, None, 4, "balanced"),
]


@pytest.mark.parametrize("model,pp,vpp,k,partition", REHEARSED,
                         ids=["hybrid-mtp-balanced", "hybrid-vpp", "gpt-mtp",
                              "attention-free-stage"])
def test_rehearsed_hybrid_stage_does_what_the_stage_does_in_a_pipeline(ranks, model, pp, vpp, k,
                                                                       partition):
    """A HybridModel's stage (its '|' part, MTP on the last) and a GPTModel's MTP stage built
    alone: the same actions, parameters and saved activations as in the real pipeline."""
    if model.hybrid and not HYBRID:
        pytest.skip("HybridModel is in megatron-core 0.18 and later")
    results = ranks.run(pp, cases.pipeline_then_rehearsal,
                        case=f"rehearse-kinds-{model.hybrid or 'gpt'}-{vpp}", pp=pp, k=k,
                        schedule="1f1b", model=model, data=DataSpec(num_microbatches=4),
                        vpp=vpp, partition=partition)
    mtp = "/" in model.hybrid or bool(dict(model.extra).get("mtp_num_layers"))
    for r in results:
        real, alone, stage = r["real"], r["rehearsal"], r["stage"]
        assert alone["actions"] == real["actions"], stage
        assert alone["lengths"] == real["lengths"], stage  # cut by the whole pattern's costs
        assert alone["parameter_bytes"] == real["parameter_bytes"], stage
        assert r["mtp"] == [mtp and c * pp + stage == pp * (vpp or 1) - 1
                            for c in range(vpp or 1)], (stage, r["mtp"])
        assert abs(alone["activation_bytes"] - real["saved_peak"]) <= 0.05 * real["saved_peak"], \
            (stage, alone["activation_bytes"], real["saved_peak"])


def test_a_rehearsed_stage_cuts_with_the_pipelines_attention(ranks):
    """A stage without attention layers cannot see the kind its cut weighs: untold, it is
    refused; a stage whose own attention differs from the pipeline's is refused as the stage
    agreement would refuse it. (The cut itself: the attention-free-stage case above.)"""
    if not HYBRID:
        pytest.skip("HybridModel is in megatron-core 0.18 and later")
    from megatron_seq1f1b.runtime.model_hooks import AttentionKind

    model = ModelSpec(hybrid="--|*-*-", hidden_size=16, seq_length=128)
    untold, mixed, agreed = (
        ranks.run(1, cases.rehearsal_refusals, case="rehearse-attention", model=model,
                  stage=stage, attention=attention)
        for stage, attention in ((0, None), (1, AttentionKind.CAUSAL), (1, AttentionKind.DENSE)))
    assert "has no attention layer" in untold[0] and "attention=" in untold[0], untold
    assert "would refuse to run together" in mixed[0], mixed
    assert agreed == [""]


# ------------------------------------------------------------------ the planner's command line

PLANNER = ["--seq-length", "8192", "--pp", "4", "--microbatches", "8", "--hidden-size", "1024",
           "--num-attention-heads", "8", "--vocab-size", "32000", "--num-experts", "4",
           "--disable-bias-linear", "--bf16", "--splits", "1", "4", "--top", "0"]


def test_planner_cli_costs_and_memory_per_layer_kind(tmp_path):
    """--hybrid-layer-pattern: each virtual stage's FLOPs and memory by its own layers (an
    MLP-only stage has no attention term and no keys and values; MTP loads the last)."""
    from megatron_seq1f1b.planner import load_calibration, main

    pattern = "*-*E|----|*-*E|*-*-/*-"
    out, costs = tmp_path / "plan.json", tmp_path / "costs.json"
    assert main(PLANNER + ["--hybrid-layer-pattern", pattern, "--json", str(out),
                           "--save-calibration", str(costs)]) == 0
    stages = load_calibration(str(costs)).stages
    assert stages[1].forward.c == 0 < stages[0].forward.c  # '----': no attention
    assert stages[0].forward.c == stages[2].forward.c
    assert stages[3].forward.a > stages[2].forward.a  # output layer and the MTP depth
    data = json.loads(out.read_text())
    shape = ModelShape(num_layers=16, hidden_size=1024, num_attention_heads=8, vocab_size=32000,
                       add_bias_linear=False, num_moe_experts=4, hybrid_layer_pattern=pattern,
                       tied_embeddings=True)
    for candidate in data["candidates"]:
        weights = [s["weights"] for s in candidate["stages"]]
        assert weights == [2 * n for n in stage_parameters(shape, 4)]
    k1 = next(c for c in data["candidates"] if c["num_splits"] == 1)["stages"]
    assert k1[1]["activations"] < k1[0]["activations"]  # MLPs only
    # a GPTModel with MTP: the last stage pays for the depths
    plain, mtp = tmp_path / "plain.json", tmp_path / "mtp.json"
    at = PLANNER.index("--num-experts")
    gpt = PLANNER[:at] + PLANNER[at + 2:] + ["--num-layers", "16"]
    assert main(gpt + ["--json", str(plain)]) == 0
    assert main(gpt + ["--mtp-num-layers", "2", "--json", str(mtp)]) == 0
    last = [json.loads(p.read_text())["candidates"][0]["stages"][3] for p in (plain, mtp)]
    assert last[1]["weights"] > last[0]["weights"]
    assert last[1]["activations"] > last[0]["activations"]


@pytest.mark.parametrize("flags,message", [
    (["--hybrid-layer-pattern", "*-|*-|*-"], "3 '|' stages: give --pp x --vpp = 3"),
    (["--hybrid-layer-pattern", "*+|*-|*-|*-"], "not +"),
    (["--hybrid-layer-pattern", "*M|*-|*-|*-", "--mamba-num-groups", "3"],
     "32 heads must divide by mamba_num_groups 3"),
    (["--hybrid-layer-pattern", "*G|*-|*-|*-", "--linear-num-key-heads", "5"],
     "must be a multiple of linear_num_key_heads 5"),
    (["--hybrid-layer-pattern", "*-|*-|*-|*-/*-", "--mtp-num-layers", "2"], "1 MTP depths"),
    (["--hybrid-layer-pattern", "*-|*-|*-|*E", "--num-layers", "4"], "has 8 layers"),
])
def test_planner_cli_refuses_patterns_it_cannot_cost(flags, message, capsys):
    from megatron_seq1f1b.planner import main

    with pytest.raises(SystemExit) as exit_:
        main(PLANNER + flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
