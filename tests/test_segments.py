"""Segment-aware model: segments by hand equal the full sequence."""

import os

import pytest

from gpt import DataSpec, ModelSpec
from segment_cases import compare_by_hand, error_messages, leak_check

ROPE = ModelSpec()
LEARNED = ModelSpec(position_embedding_type="learned_absolute")
GQA = ModelSpec(num_attention_heads=4, num_query_groups=2)
MLA = ModelSpec(mla=True, normalization="RMSNorm")

CASES = {
    "rope_k4_uniform": dict(model=ROPE, lengths=(8, 8, 8, 8)),
    "rope_k3_balanced": dict(model=ROPE, lengths=(13, 10, 9)),
    "rope_k2_mbs2": dict(model=ROPE, lengths=(20, 12), data=DataSpec(num_microbatches=1, micro_batch_size=2)),
    "learned_k4": dict(model=LEARNED, lengths=(11, 8, 7, 6)),
    "gqa_k3": dict(model=GQA, lengths=(12, 10, 10)),
    "explicit_mask_k4": dict(model=ROPE, lengths=(8, 8, 8, 8), data=DataSpec(num_microbatches=1, explicit_mask=True)),
    "two_microbatches_interleaved": dict(
        model=ROPE, lengths=(16, 16), data=DataSpec(num_microbatches=2), interleave_microbatches=True
    ),
    "rmsnorm_swiglu_k3": dict(model=ModelSpec(normalization="RMSNorm", gated_linear_unit=True), lengths=(14, 10, 8)),
    "recompute_full_uniform": dict(
        model=ROPE, lengths=(12, 10, 10),
        overrides=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ),
    "recompute_full_block": dict(
        model=ROPE, lengths=(12, 10, 10),
        overrides=dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    ),
    # Sliding windows: shorter than a segment, longer than two, and mixed with
    # full-attention layers (window_attn_skip_freq); the mask given explicitly too.
    "window_5_k4": dict(model=ROPE, lengths=(8, 8, 8, 8), overrides=dict(window_size=(5, 0))),
    "window_19_k4_gqa": dict(model=GQA, lengths=(11, 8, 7, 6), overrides=dict(window_size=(19, 0))),
    "window_skip_explicit_mask": dict(
        model=ROPE, lengths=(12, 10, 10), data=DataSpec(num_microbatches=1, explicit_mask=True),
        overrides=dict(window_size=(6, 0), window_attn_skip_freq=2),
    ),
    # Multi-latent attention: its own RoPE (plain and YaRN) at the segment's offset, the
    # up-projected K/V cached; with its up-projection recomputed in the backward too.
    "mla_rope_k4": dict(model=MLA, lengths=(11, 8, 7, 6)),
    "mla_yarn_k3": dict(model=ModelSpec(mla=True, normalization="RMSNorm",
                                        extra=(("rope_type", "yarn"),)), lengths=(12, 10, 10)),
    "recompute_selective_core_attn": dict(
        model=GQA, lengths=(12, 10, 10),
        overrides=dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    ),
}


if os.environ.get("SEQ1F1B_FULL") == "1":  # CI time: its recompute is the same code as below
    CASES["mla_recompute_up_proj"] = dict(
        model=MLA, lengths=(12, 10, 10),
        overrides=dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
    )


@pytest.mark.parametrize("name", list(CASES))
def test_segments_by_hand_equal_full_sequence(ranks, name):
    (result,) = ranks.run(1, compare_by_hand, case=name, **CASES[name])
    assert not result["problems"], "\n".join(result["problems"])


def test_tensor_parallel_with_sequence_parallel(ranks):
    results = ranks.run(2, compare_by_hand, case="tp2_sp", model=GQA, lengths=(12, 10, 10), tp=2, sp=True)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def test_fake_transformer_engine_gets_bottom_right_causal_and_prefix_keys(ranks):
    from megatron.core.transformer.enums import AttnMaskType

    (result,) = ranks.run(1, compare_by_hand, case="fake_te", model=GQA, lengths=(12, 10, 10), fake_te=True)
    assert not result["problems"], "\n".join(result["problems"])
    calls = result["te_calls"]
    # Forward-only logits pass (4 layers x 3 segments), then the training pass.
    query_lengths = [c[0][0] for c in calls]
    key_lengths = [c[1][0] for c in calls]
    assert query_lengths[:12] == [12] * 4 + [10] * 4 + [10] * 4
    assert key_lengths[:12] == [12] * 4 + [22] * 4 + [32] * 4
    assert all(c[3] == AttnMaskType.causal_bottom_right and c[4] for c in calls)
    assert all(c[1][2] == 2 for c in calls), "keys arrive with their query groups (GQA)"


def test_fake_transformer_engine_sliding_window_gets_only_keys_in_reach(ranks):
    (result,) = ranks.run(1, compare_by_hand, case="fake_te_window", model=GQA,
                          lengths=(12, 10, 10), fake_te=True,
                          overrides=dict(window_size=(7, 0), window_attn_skip_freq=[1, 0, 1, 1]))
    assert not result["problems"], "\n".join(result["problems"])
    key_lengths = [c[1][0] for c in result["te_calls"][:12]]
    # Segments start at 0, 12, 22; layer 2 keeps the whole prefix.
    assert key_lengths == [12] * 4 + [17, 22, 17, 17] + [17, 32, 17, 17]


def test_no_growth_over_iterations(ranks):
    (result,) = ranks.run(1, leak_check, case="leak", iterations=20)
    tensors, rss = result["tensors"], result["rss_kib"]
    assert tensors[-1] == tensors[2], tensors
    assert rss[-1] - rss[4] < 8 * 1024, rss  # KiB


EXPECTED_ERRORS = {
    "context_parallel": "context_parallel_layer_spec(spec)",
    "sliding_window_ahead": "use window_size=(w, 0)",
    "moe_capacity": "dropless MoE",
    "mtp": "mtp_use_repeated_layer",
    "offloading": "offloading",
    "cuda_graphs": "CUDA graphs",
    "yarn": "position_embedding_type='yarn'",
    "not_gpt": "supports Megatron-Core GPTModel",
    "segment_1_first": "segment 1, chunk 0 forwarded before segment 0",
    "twice": "forwarded twice",
    "not_sliced": "slice_batch",
    "unsliced_mask": "expected [..., 16, 16]",
    "slice_bad_shape": "expected [..., 32]",
    "leak_at_close": "still alive at the end of the iteration",
    "sp_divisibility": "divisible by the tensor-parallel size 2; [17, 15]",
    "bad_lengths": "must be positive",
    "tp_comm_overlap": "userbuffers sized for the whole sequence",
    "fp8_attention": "FP8 attention (fp8_dot_product_attention)",
    "fp8_lengths": "divisible by 8 (Transformer Engine's FP8 GEMMs); [12, 20]",
    "attention_bias": "does not support an attention_bias",
}


def test_unsupported_options_and_misuse_fail_clearly(ranks):
    (messages,) = ranks.run(1, error_messages, case="errors")
    for name, fragment in EXPECTED_ERRORS.items():
        assert messages[name] is not None, f"{name}: no error raised"
        assert fragment in messages[name], f"{name}: {messages[name]}"

