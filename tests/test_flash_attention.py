"""FlashDotProductAttention (PyTorch SDPA) equals Megatron's DotProductAttention.

Every layout is compared, loss and each parameter gradient (relative 1e-5,
fp32, no dropout), with Megatron's local attention on the full sequence
(tests/gpt.py builds every reference with it).
"""

import inspect

import pytest
import torch

import flash_cases as cases
from gpt import DataSpec, ModelSpec, run_layout

FLASH = ModelSpec(attention="flash")
GQA_WINDOWS = ModelSpec(attention="flash", num_query_groups=2,
                        extra=(("window_size", (5, 0)), ("window_attn_skip_freq", 2)))
DATA = DataSpec(num_microbatches=3)


def _check(results):
    problems = [f"rank {r['rank']}: {p}" for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert any(r["entries"] for r in results), "no rank reported losses"


def test_megatron_lm_swap_full_sequence_equals_local(ranks):
    """No pipelining, whole sequence (is_causal), query-key layer scaling on: the swap
    Megatron-LM's --attention-backend flash --transformer-impl local gets."""
    model = ModelSpec(extra=(("apply_query_key_layer_scaling", True),))
    (result,) = ranks.run(1, cases.megatron_lm_swap, case="flash-lm-swap", model=model,
                          data=DataSpec(num_microbatches=2))
    _check([result])
    assert result["cores"] == ["FlashDotProductAttention"] * 4
    assert result["before_keys"] == result["after_keys"] == [result["spec_keys"]]
    assert result["spec_cores"] == result["cores"]
    # the balanced partition's cost model: causal pairs for flash, the rectangle for local
    assert result["dense_before"] and not result["dense_after"]


def test_segments_gqa_windows_and_no_dense_mask(ranks):
    """Seq1F1B k=3 on one rank, GQA, windows on layers 1 and 3: equal to the local reference.
    Only windowed layers create a [sq, sk] tensor (their mask), once per segment shape for
    both layers and both micro-batches; the others hand SDPA is_causal or a lower-right
    CausalBias."""
    (result,) = ranks.run(1, cases.recorded_layout, case="flash-recorded", model=GQA_WINDOWS,
                          data=DataSpec(num_microbatches=2),
                          seq1f1b=dict(num_splits=3, partition="balanced"))
    _check([result])
    calls = result["calls"]
    assert any(c["sk"] > c["sq"] for c in calls if not c["window"]), "no segment over a prefix"
    made: dict = {}  # segment shape -> masks made for it
    for call in calls:
        if call["window"]:
            assert call["sdpa"] == [("Tensor", False)], call
            shape = (call["sq"], call["sk"])
            made[shape] = made.get(shape, 0) + len(call["dense"])
        elif call["sq"] == call["sk"]:
            assert call["sdpa"] == [(None, True)] and not call["dense"], call
        else:
            assert call["sdpa"] == [("CausalBias", False)] and not call["dense"], call
    # the tensors one window mask takes to make, counted as the calls were
    from flash_cases import _Recorder
    from megatron_seq1f1b.attention.varlen import window_mask

    with _Recorder() as one:
        window_mask(11, 16, 4, "cpu")
    once = sum(shape == (11, 16) for shape in one.shapes)
    windowed = [c for c in calls if c["window"]]
    assert len(windowed) > len(made) and set(made.values()) == {once}, made  # shared


@pytest.mark.parametrize("name,layout", [
    ("pp2-k3-balanced", dict(model=FLASH, pp=2)),
    ("pp2-k3-forward-only", dict(model=FLASH, pp=2, forward_only=True)),
    ("pp2-vpp2-k3-gqa-windows", dict(model=GQA_WINDOWS, pp=2, vpp=2)),
])
def test_seq1f1b_equals_local_full_sequence(ranks, name, layout):
    results = ranks.run(2, run_layout, case=f"flash-{name}", data=DATA,
                        seq1f1b=dict(num_splits=3, partition="balanced"), **layout)
    _check(results)


def test_multi_latent_attention_segments(ranks):
    """MLA (separate K/V widths) with segments, against the full sequence's torch attention."""
    (result,) = ranks.run(1, run_layout, case="flash-mla",
                          model=ModelSpec(mla=True, normalization="RMSNorm", attention="flash"),
                          data=DataSpec(num_microbatches=2),
                          seq1f1b=dict(num_splits=3, partition="balanced"))
    _check([result])


# ------------------------------------------------------------------ in this process


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def _flash(**kwargs):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_seq1f1b.attention.flash import FlashDotProductAttention

    call = dict(config=_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                attention_type="self")
    return FlashDotProductAttention(**{**call, **kwargs})


def test_takes_megatrons_constructor_keywords():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    names = [n for n in inspect.signature(DotProductAttention.__init__).parameters if n != "self"]
    values = dict(config=_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                  attention_type="self", attention_dropout=0.0, softmax_scale=0.5,
                  cp_comm_type="p2p", pg_collection=None)
    assert set(names) <= set(values), names
    module = _flash(**{n: values[n] for n in names}, k_channels=8, v_channels=6, num_splits=None)
    assert module.softmax_scale == 0.5 and (module.k_channels, module.v_channels) == (8, 6)
    assert list(module.parameters()) == [] and module.state_dict() == {}
    assert module.window_size == (-1, 0)
    with pytest.raises(TypeError, match="does not take num_splits"):
        _flash(num_splits=2)


@pytest.mark.parametrize("change,message", [
    (dict(attention_mask=torch.zeros(1, 1, 4, 4, dtype=torch.bool)),
     "explicit attention_mask .*--no-create-attention-mask-in-dataloader"),
    (dict(attention_bias=torch.zeros(1, 2, 4, 4)), "attention_bias"),
    (dict(packed_seq_params=object()), "packed sequences"),
    (dict(attn_mask_type="padding"), "causal only"),
    (dict(keys=6), "AttnMaskType.causal .*pass causal_bottom_right"),
    (dict(keys=3, attn_mask_type="causal_bottom_right"), r"fewer keys \(3\) than queries \(4\)"),
])
def test_unsupported_inputs_fail_clearly(change, message):
    from megatron.core.transformer.enums import AttnMaskType

    keys = change.pop("keys", 4)
    if "attn_mask_type" in change:
        change["attn_mask_type"] = AttnMaskType[change["attn_mask_type"]]
    query, key = torch.zeros(4, 1, 2, 8), torch.zeros(keys, 1, 2, 8)
    with pytest.raises(ValueError, match=message):
        _flash()(query, key, key, change.pop("attention_mask", None), **change)


@pytest.mark.parametrize("change,message", [
    (dict(config=dict(softmax_type="learnable")), "softmax_type='learnable'"),
    (dict(config=dict(window_size=(4, 2))), r"window_size=\(4, 2\).*use window_size=\(w, 0\)"),
    (dict(attn_mask_type="no_mask"), "causal attention only"),
])
def test_unsupported_configurations_fail_at_construction(change, message):
    from megatron.core.transformer.enums import AttnMaskType

    kwargs = {}
    if "config" in change:
        kwargs["config"] = _config(**change["config"])
    if "attn_mask_type" in change:
        kwargs["attn_mask_type"] = AttnMaskType[change["attn_mask_type"]]
    with pytest.raises(ValueError, match=message):
        _flash(**kwargs)


def test_bottom_right_window_and_model_hooks():
    """A segment of 3 queries over 7 keys, window 2: TE's bottom-right window; the module is
    treated like TE's attention (K/V prefix, bottom-right mask) and not as dense attention."""
    from megatron_seq1f1b.attention.flash import window_mask
    from megatron_seq1f1b.attention.segmented import is_te_attention, layer_window

    expected = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]],
                            dtype=torch.bool)
    assert torch.equal(window_mask(3, 7, 2, "cpu"), expected)
    windowed = _flash(config=_config(window_size=(2, 0)))
    assert windowed.window_size == (2, 0) and layer_window(windowed) == 2
    assert is_te_attention(windowed) and layer_window(_flash()) is None


def test_trainer_attention_backend_flag(tmp_path):
    """scripts/pretrain_gpt.py --attention-backend flash (with Seq1F1B segments) trains like
    the default local attention: the same losses (4 steps at a high learning rate: at
    initialization attention is nearly uniform, so the first loss alone hardly depends on it).
    The two runs start side by side: most of each is importing Megatron-Core."""
    from concurrent.futures import ThreadPoolExecutor

    from test_trainer import train

    common = ["--train-iters", "4", "--global-batch-size", "2", "--position-embedding-type",
              "rope", "--num-query-groups", "2", "--lr", "1e-2"]
    with ThreadPoolExecutor(2) as pool:
        flash = pool.submit(train, tmp_path, "flash", 1, *common, "--attention-backend", "flash",
                            "--seq1f1b", "--seq1f1b-splits", "2")
        local = pool.submit(train, tmp_path, "local", 1, *common)
        ours, theirs = (run.result()[0]["summary"]["losses"] for run in (flash, local))
    assert len(ours) == len(theirs) == 4
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)


def test_megatron_lm_asks_for_it_with_attention_backend_flash_and_local_impl():
    """Megatron-LM's own enum value, only with --transformer-impl local; the post-wrap hook is
    added without --seq1f1b too (core_v0.19), and the dataloader's mask is refused."""
    import argparse
    import types

    from megatron.core.transformer.enums import AttnBackend
    from megatron_seq1f1b import megatron_lm

    def args(**flags):
        return argparse.Namespace(**{"transformer_impl": "local", **flags})

    assert megatron_lm.flash_attention_requested(args(attention_backend=AttnBackend.flash))
    assert not megatron_lm.flash_attention_requested(args(attention_backend=AttnBackend.auto))
    assert not megatron_lm.flash_attention_requested(
        args(attention_backend=AttnBackend.flash, transformer_impl="transformer_engine"))
    config = types.SimpleNamespace(post_wrap_hooks=[])
    megatron_lm.add_post_wrap_hook(config, args(attention_backend=AttnBackend.flash))
    assert config.post_wrap_hooks == [megatron_lm.prepare_model]
    with pytest.raises(ValueError, match="add --no-create-attention-mask-in-dataloader"):
        megatron_lm.prepare_model([], args(attention_backend=AttnBackend.flash))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_bottom_right_causal_on_cpu_is_exact_and_keeps_no_mask(dtype):
    """A segment over its prefix on CPU: two mask-free flash calls merged by log-sum-exp equal
    SDPA with causal_lower_right (output and every gradient), and autograd keeps no
    [queries, keys] tensor (PyTorch's own CPU path materializes and keeps the mask)."""
    from torch.nn.attention.bias import causal_lower_right

    from megatron_seq1f1b.attention.prefix import bottom_right_causal

    b, h, sq, sk, d = 2, 3, 24, 80, 16
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(b, n, h, d, dtype=dtype, generator=generator) for n in (sq, sk, sk)]
    weights = torch.randn(b, h, sq, d, dtype=dtype, generator=generator)

    def run(attention):
        q, k, v = (t.clone().permute(0, 2, 1, 3).requires_grad_() for t in inputs)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            out = attention(q, k, v)
        (out * weights).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad], saved

    expected, theirs = run(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(sq, sk), scale=0.25))
    got, ours = run(lambda q, k, v: bottom_right_causal(q, k, v, scale=0.25))
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for name, e, g in zip(("out", "dq", "dk", "dv"), expected, got):
        assert ((e - g).abs().max() / e.abs().max()).item() < tolerance, name
    assert any(shape[-2:] == (sq, sk) for shape in theirs)  # the test would see a mask
    assert not any(shape[-2:] == (sq, sk) for shape in ours), ours


def test_causal_spans_equal_masked_attention_with_one_key_gradient():
    """A context-parallel rank's two chunks of a segment (rows over keys up to their own end,
    after a prefix) in one call: output and every gradient equal SDPA with the explicit mask,
    and no saved or gradient tensor is padded to the keys per chunk."""
    from megatron_seq1f1b.attention.prefix import causal_spans

    b, h, d, prefix, chunk = 1, 2, 8, 16, 6  # segment of 4 chunks; this rank: chunks 0 and 3
    sk = prefix + 4 * chunk
    spans = [(0, chunk, 0, prefix + chunk), (chunk, chunk, 0, sk)]
    rows = list(range(prefix, prefix + chunk)) + list(range(sk - chunk, sk))
    mask = torch.tensor([[key <= pos for key in range(sk)] for pos in rows])
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(b, h, n, d, dtype=torch.float64, generator=generator)
              for n in (2 * chunk, sk, sk)]
    weights = torch.randn(b, h, 2 * chunk, d, dtype=torch.float64, generator=generator)

    def run(attention):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out = attention(q, k, v)
        (out * weights).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    expected = run(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.3))
    got = run(lambda q, k, v: causal_spans(q, k, v, spans, scale=0.3))
    for name, e, g in zip(("out", "dq", "dk", "dv"), expected, got):
        assert ((e - g).abs().max() / e.abs().max()).item() < 1e-12, name
    with pytest.raises(ValueError, match="span"):
        causal_spans(*inputs, [(0, chunk, 0, chunk - 1)], scale=0.3)

    # Saved: the inputs, one output and one log-sum-exp of the two chunks' rows, nothing
    # padded to the keys per chunk; the backward makes one key and one value gradient.
    from torch.utils._python_dispatch import TorchDispatchMode

    class KeySized(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for tensor in result if isinstance(result, (tuple, list)) else [result]:
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 4 \
                        and tensor.shape[-2] >= sk:
                    self.storages.add(tensor.untyped_storage().data_ptr())
            return result

    q, k, v = (x.clone().requires_grad_() for x in inputs)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x,
                                                  lambda x: x):
        out = causal_spans(q, k, v, spans, scale=0.3)
    assert saved == [(b, h, 2 * chunk, d), (b, h, sk, d), (b, h, sk, d), (b, h, 2 * chunk, d),
                     (b, h, 2 * chunk)], saved
    with KeySized() as mode:
        (out * weights).sum().backward()
    inputs_storage = {x.untyped_storage().data_ptr() for x in (k, v)}
    assert len(mode.storages - inputs_storage) == 2, mode.storages
