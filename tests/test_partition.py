"""split_sequence: sums, multiples, ordering, equal FLOPs, errors."""

from types import SimpleNamespace

import pytest

from megatron_seq1f1b import split_sequence
from megatron_seq1f1b.schedules.partition import CostModel


def config(**kw):
    fields = dict(hidden_size=4096, num_attention_heads=32, kv_channels=128, num_query_groups=32,
                  ffn_hidden_size=16384, gated_linear_unit=False, num_layers=32)
    fields.update(kw)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("seq,k,mult", [(64, 4, 1), (64, 3, 2), (1000, 7, 8), (7, 7, 1), (30, 4, 2)])
def test_uniform_sums_multiples_and_spread(seq, k, mult):
    if seq % mult:
        pytest.skip("not a valid request")
    lengths = split_sequence(seq, k, multiple_of=mult)
    assert sum(lengths) == seq and len(lengths) == k
    assert all(n > 0 and n % mult == 0 for n in lengths)
    assert max(lengths) - min(lengths) <= mult
    assert lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 8])
def test_balanced_equal_flops_non_increasing(k, mult):
    cfg = config()
    lengths = split_sequence(32768, k, "balanced", config=cfg, vocab_size=50257, multiple_of=mult)
    assert sum(lengths) == 32768 and all(n % mult == 0 for n in lengths)
    assert lengths == sorted(lengths, reverse=True)
    costs = CostModel.from_config(cfg, 50257).split_costs(lengths)
    # Rounding a boundary by at most one unit moves cost by at most that unit's cost.
    model = CostModel.from_config(cfg, 50257)
    unit_cost = model.per_token * mult + model.per_pair * mult * 32768
    assert max(costs) - min(costs) <= 2 * unit_cost


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_balanced_dense_attention_equal_costs(k):
    """Kernels that compute masked scores too (s x end per segment): costs do not add up
    to the whole sequence's, so the split is found by bisection; still equal."""
    cfg = config()
    lengths = split_sequence(32768, k, "balanced", config=cfg, vocab_size=50257,
                             dense_attention=True)
    assert sum(lengths) == 32768 and lengths == sorted(lengths, reverse=True)
    costs = CostModel.from_config(cfg, 50257, dense_attention=True).split_costs(lengths)
    assert max(costs) / min(costs) < 1.001


def test_balanced_long_sequence_first_segment_clearly_longer():
    lengths = split_sequence(32768, 4, "balanced", config=config(), vocab_size=50257, multiple_of=8)
    # The original Seq1F1B solver gives [11040, 8416, 7080, 6232] for this model.
    assert lengths[0] > 1.6 * lengths[-1]
    assert all(abs(a - b) <= 64 for a, b in zip(lengths, [11040, 8416, 7080, 6232]))


def test_balanced_respects_gqa_and_glu():
    plain = split_sequence(8192, 4, "balanced", config=config(), vocab_size=32000)
    # Fewer K/V heads and a gated MLP make the linear part heavier relative to attention,
    # so segments become more equal.
    lean = split_sequence(8192, 4, "balanced", config=config(num_query_groups=8,
                          gated_linear_unit=True), vocab_size=32000)
    assert lean[0] - lean[-1] < plain[0] - plain[-1]


def test_balanced_short_sequence_is_nearly_uniform():
    lengths = split_sequence(64, 4, "balanced", config=config(), vocab_size=50257)
    assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((8, 0), {}, "positive integer"),
        ((8, 3), {"multiple_of": 4}, "at most 2 splits"),
        ((10, 2), {"multiple_of": 4}, "not a multiple of 4"),
        ((8, 2, "cubic"), {}, "unknown partition method"),
        ((8, 2, "balanced"), {}, "needs the model's TransformerConfig"),
        ((8, 2), {"multiple_of": 0}, "multiple_of"),
    ],
)
def test_impossible_requests_raise_clear_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        split_sequence(*args, **kwargs)


@pytest.mark.parametrize("dense", [False, True], ids=["flash", "dense"])
def test_window_pairs_count_what_the_masks_keep(dense):
    """Against brute force: pairs a windowed layer computes for every segment of a short sequence."""
    for window in (0, 3, 7, 40):
        model = CostModel(0.0, 0.0, dense, window, 1.0)
        for start in range(0, 24):
            for end in range(start + 1, 25):
                if dense:  # keys passed: [max(0, start - w), end), all scored
                    expected = (end - start) * (end - max(0, start - window))
                else:  # keys t - w .. t for every query t
                    expected = sum(min(t, window) + 1 for t in range(start, end))
                assert model.window_pairs(end - start, end) == expected, (window, start, end)


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("skip", [None, 4], ids=["all-windowed", "every-4th-full"])
def test_balanced_with_sliding_window_equal_costs(k, skip):
    cfg = config(window_size=(4096, 0), window_attn_skip_freq=skip)
    model = CostModel.from_config(cfg, 50257)
    assert model.window == 4096 and model.per_window_pair == (24 if skip else 32) * 4 * 4096
    lengths = split_sequence(32768, k, "balanced", config=cfg, vocab_size=50257)
    assert sum(lengths) == 32768 and lengths == sorted(lengths, reverse=True)
    costs = model.split_costs(lengths)
    assert max(costs) / min(costs) < 1.001
    # A window caps attention: the split is much closer to uniform than full attention's.
    full = split_sequence(32768, k, "balanced", config=config(), vocab_size=50257)
    assert lengths[0] - lengths[-1] < (full[0] - full[-1]) * (0.6 if skip else 0.3)


def _linear_weights_per_layer(spec_fields: dict) -> dict:
    """Mean weights of a layer's linear layers in a real model vs CostModel's count (one rank)."""
    from gpt import ModelSpec, build_chunks, init_parallel, make_config

    spec = ModelSpec(**spec_fields)
    init_parallel()
    config = make_config(spec)
    (gpt,) = build_chunks(spec, config)
    counted = sum(p.numel() for layer in gpt.decoder.layers
                  for name, p in layer.named_parameters()
                  if name.endswith("weight") and p.dim() == 2) / config.num_layers
    model = CostModel.from_config(config, spec.vocab_size)
    return {"model": counted, "cost_model": (model.per_token - 2 * config.hidden_size
                                             * spec.vocab_size) / config.num_layers / 2}


# MoE with every expert active (topk = E): what a token visits is what the layers hold.
MOE_ALL_ACTIVE = (("num_moe_experts", 2), ("moe_router_topk", 2), ("add_bias_linear", False),
                  ("moe_layer_freq", 2), ("moe_ffn_hidden_size", 40),
                  ("moe_shared_expert_intermediate_size", 24))


@pytest.mark.parametrize("fields", [dict(num_query_groups=2, gated_linear_unit=True),
                                    dict(mla=True, normalization="RMSNorm"),
                                    dict(gated_linear_unit=True, extra=MOE_ALL_ACTIVE)],
                         ids=["gqa-swiglu", "mla", "moe-mixed-shared"])
def test_cost_model_counts_the_linear_weights_a_layer_has(ranks, fields):
    (result,) = ranks.run(1, _linear_weights_per_layer, case=f"weights-{fields}",
                          spec_fields=fields)
    assert result["model"] == result["cost_model"], result


def test_segment_lengths_round_to_64_on_cuda_by_default():
    """Tensor-core friendly segments on CUDA (a requested multiple is strict, the layout's own
    multiple always applies); the default falls back where 64-token blocks do not fit."""
    from types import SimpleNamespace

    from megatron_seq1f1b.base.checks import rounding_multiple

    plain = SimpleNamespace(sequence_parallel=False)
    tp2 = SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2)
    fp8 = SimpleNamespace(sequence_parallel=True, tensor_model_parallel_size=2, fp8="hybrid")
    assert rounding_multiple(plain, 8192, 4, on_cuda=False) == 1
    assert rounding_multiple(plain, 8192, 4, on_cuda=True) == 64
    assert rounding_multiple(fp8, 8192, 4, on_cuda=True) == 64
    assert rounding_multiple(plain, 1000, 4, on_cuda=True) == 1  # 1000 tokens: no 64 blocks
    assert rounding_multiple(tp2, 256, 8, on_cuda=True) == 2  # 8 segments of 64 do not fit
    assert rounding_multiple(tp2, 8192, 4, requested=48, on_cuda=True) == 48
    assert rounding_multiple(fp8, 8192, 4, requested=24, on_cuda=False) == 48  # lcm with 16


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_balanced_lengths_at_64_stay_balanced_within_the_rounding(k):
    config_ = config(hidden_size=2048, num_layers=4, num_attention_heads=16, kv_channels=128,
                     num_query_groups=16, ffn_hidden_size=8192)
    exact = split_sequence(8192, k, "balanced", config=config_, vocab_size=50257)
    rounded = split_sequence(8192, k, "balanced", config=config_, vocab_size=50257,
                             multiple_of=64)
    assert sum(rounded) == 8192 and all(n % 64 == 0 for n in rounded)
    assert rounded == sorted(rounded, reverse=True)
    model = CostModel.from_config(config_, 50257)
    costs = model.split_costs(rounded)
    # rounding moves each boundary by at most 32 tokens: a segment's cost by at most two
    # 32-token slices at the sequence's end (the most expensive tokens)
    slice_cost = model.segment(32, 8192)
    assert max(costs) - min(costs) <= 4 * slice_cost, (exact, rounded)


def test_hybrid_pattern_costs_by_layer_kind():
    """A hybrid pattern's layers cost what their symbols compute: '*' + '-' is a GPT layer,
    MLP and MoE layers have no attention term (their cut is uniform), a pipeline '|' changes
    nothing, MTP depths add their layers, projection and logits; unknown kinds are refused."""
    gpt = CostModel.from_config(config(num_layers=2), 50257)
    hybrid = CostModel.from_config(config(num_layers=4), 50257, pattern="*-|*-")
    assert (hybrid.per_token, hybrid.per_pair) == (gpt.per_token, gpt.per_pair)
    moe = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=4096)
    linear = CostModel.from_config(config(num_layers=2, **moe), 50257, pattern="-E")
    assert linear.per_pair == 0 and linear.per_token > 0
    assert split_sequence(4096, 4, "balanced", cost=linear) == [1024] * 4
    attention_first = split_sequence(4096, 4, "balanced", config=config(num_layers=4),
                                     vocab_size=50257, pattern="*-*-")
    assert attention_first[0] > attention_first[-1]  # causal attention: later tokens cost more
    mtp = CostModel.from_config(config(num_layers=4, mtp_num_layers=2), 50257,
                                pattern="*-*-/*-/*-")
    h, v = 4096, 50257
    assert mtp.per_pair == 2 * hybrid.per_pair  # two more attention layers
    assert mtp.per_token == hybrid.per_token * 2 + 2 * 2 * (2 * h * h + h * v) - 2 * h * v
    unbuilt = CostModel.from_config(config(num_layers=4), 50257, pattern="*-*-/*-")
    assert unbuilt == hybrid  # '/' depths are built only with mtp_num_layers
    gpt_mtp = CostModel.from_config(config(num_layers=2, mtp_num_layers=1), 50257)
    assert gpt_mtp.per_pair == 1.5 * gpt.per_pair
    with pytest.raises(ValueError, match="no cost model for X"):
        CostModel.from_config(config(num_layers=4), 50257, pattern="*X-G")
    # recurrent layers: linear in the sequence, so a pattern of them is cut nearly uniformly
    recurrent = CostModel.from_config(config(num_layers=6), 50257, pattern="M-M-G-")
    assert recurrent.per_pair == 0 and recurrent.per_token > hybrid.per_token / 2
    assert split_sequence(4096, 4, "balanced", config=config(num_layers=6), vocab_size=50257,
                          pattern="M-M-G-") == [1024] * 4
    mixed = split_sequence(4096, 4, "balanced", config=config(num_layers=7), vocab_size=50257,
                           pattern="M-M-M*-")
    assert mixed[0] > mixed[-1] and mixed[0] - mixed[-1] < attention_first[0] - attention_first[-1]


def test_documents_by_budget_cut_where_documents_end():
    """backward_by_documents' cut: whole documents packed up to the budget, a longer one cut
    alone (by cost, as a micro-batch of one document); only common ends that are multiples."""
    from megatron_seq1f1b.schedules.partition import split_documents, split_documents_by_budget
    from megatron_seq1f1b.segments.documents import Documents

    cost = CostModel(1.0, 0.01)
    assert split_documents_by_budget(Documents(((0, 5, 24, 41),), 48), 12, cost) == \
        [5, 10, 9, 9, 8, 7]
    assert split_documents_by_budget(Documents(((0, 100, 200),), 300), 1024, cost) == [300]
    # 300 and 500 are no multiples of 16: [0, 3440) is one piece, cut alone like [3440, 7536)
    found = split_documents_by_budget(Documents(((0, 300, 500, 3440),), 7536), 1024, cost,
                                      multiple_of=16)
    assert found == split_documents(Documents.whole(3440), 4, cost, multiple_of=16) + \
        split_documents(Documents.whole(4096), 4, cost, multiple_of=16)
    # more segments than the cap: cut as the documents partition cuts into the capped count
    seventeen = Documents((tuple(range(0, 204, 17)),), 204)
    assert len(split_documents_by_budget(seventeen, 16, cost)) == 24
    assert split_documents_by_budget(seventeen, 16, cost, max_splits=16) == \
        split_documents(seventeen, 13, cost)
    # an end in one sample only is no end
    assert split_documents_by_budget(Documents(((0, 4), (0, 6)), 12), 5, cost) == \
        split_documents(Documents.whole(12), 3, cost)
