"""The packed-document (THD) kernels of ``attention/varlen.py``, on CPU.

PyTorch's ``varlen_attn`` runs on CUDA only, so its path is driven here by
fakes with each torch version's signature and semantics (read from the
released wheels' ``torch/nn/attention/varlen.py``): 2.10 takes ``is_causal``
and no scale, 2.11 ``scale`` and ``window_size``, 2.12-2.14 also
``enable_gqa``. Like the real flash kernel, a fake aligns causal masks and
windows bottom-right per sequence and computes FULL attention for
``window_size=(-1, -1)``; without ``enable_gqa`` it refuses fewer key heads
than query heads. Widening ``varlen.KERNEL_DEVICES`` / ``KERNEL_DTYPES``
sends CPU fp64 calls down the kernel branch; each test there fails if the
call fell back to the per-piece loop, and compares outputs and gradients
with it (fp64, 1e-12).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_seq1f1b.attention import varlen
from megatron_seq1f1b.segments.documents import Documents
from megatron_seq1f1b.segments.packed import Packed

_TOLIST = torch.Tensor.tolist  # the fakes read their cuts with it (uncounted: not our code)
HEADS, DIM, SCALE = 4, 16, 0.3
LOGGER = "megatron_seq1f1b.attention.varlen"


def _flash_semantics(query, key, value, cu_q, cu_k, scale, window_size, top_left=False):
    """What flash attention's variable-length kernel computes: per sequence, query ``i`` over
    keys ``[p - left, p + right]`` (a negative bound: unbounded) where ``p`` is the query's
    key position, aligned bottom-right (the last query on the last key), or top-left."""
    rows = torch.arange(query.shape[0])
    cols = torch.arange(key.shape[0])
    cu_q, cu_k = cu_q.long(), cu_k.long()
    seq_q = torch.bucketize(rows, cu_q[1:], right=True)
    seq_k = torch.bucketize(cols, cu_k[1:], right=True)
    if top_left:
        position = cu_k[:-1][seq_q] + (rows - cu_q[:-1][seq_q])
    else:
        position = cu_k[1:][seq_q] - (cu_q[1:][seq_q] - rows)
    allowed = seq_q[:, None] == seq_k[None, :]
    left, right = window_size
    if right >= 0:
        allowed = allowed & (cols[None, :] <= position[:, None] + right)
    if left >= 0:
        allowed = allowed & (cols[None, :] >= position[:, None] - left)
    groups = key.shape[1]
    q = query.view(query.shape[0], groups, -1, query.shape[-1])  # [T, g, h / g, d]
    scores = torch.einsum("qgrd,kgd->grqk", q, key) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = torch.einsum("grqk,kgd->qgrd", probs, value)
    return out.reshape(query.shape[0], query.shape[1], value.shape[-1])


class _Fake:
    """Records each call (the key heads it got) and checks the plan's arguments."""

    def __init__(self):
        self.calls: list[dict] = []

    def run(self, query, key, value, cu_q, cu_k, max_q, max_k, scale, window_size,
            enable_gqa: bool, top_left: bool = False):
        assert type(max_q) is int and type(max_k) is int, "maxima must be host integers"
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == query.device
        lengths_q = [b - a for a, b in zip(_TOLIST(cu_q), _TOLIST(cu_q)[1:])]
        lengths_k = [b - a for a, b in zip(_TOLIST(cu_k), _TOLIST(cu_k)[1:])]
        assert (max_q, max_k) == (max(lengths_q), max(lengths_k))
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ValueError("Expect query and key/value to have the same number of heads")
        self.calls.append(dict(key_heads=key.shape[1], window_size=window_size))
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        return _flash_semantics(query, key, value, cu_q, cu_k, scale, tuple(window_size),
                                top_left)


def fake_2_10(record: _Fake):
    """torch 2.10: ``is_causal``, no scale (1/sqrt(d)), no window, no GQA."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                    return_aux=None):
        return record.run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, None,
                          (-1, 0) if is_causal else (-1, -1), False)

    return varlen_attn


def fake_2_11(record: _Fake):
    """torch 2.11: keyword-only ``scale`` and ``window_size`` (default (-1, -1): full)."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                    scale=None, window_size=(-1, -1)):
        return record.run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                          window_size, False)

    return varlen_attn


def fake_2_12(record: _Fake, top_left: bool = False):
    """torch 2.12, 2.13 and 2.14 (one signature): ``enable_gqa`` and inference-only extras."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                    scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                    block_table=None, num_splits=None):
        return record.run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                          window_size, enable_gqa, top_left)

    return varlen_attn


def fake_no_causal(record: _Fake):
    """A varlen_attn that cannot be asked for causal attention (neither flag)."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        return record.run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, (-1, -1),
                          False)

    return varlen_attn


@contextlib.contextmanager
def _kernel_on_cpu(monkeypatch, function):
    """``function`` as this torch's varlen_attn, taken for CPU fp64 calls; fresh choices."""
    with monkeypatch.context() as patch:
        patch.setattr(varlen, "KERNEL_DEVICES", ("cuda", "cpu"))
        patch.setattr(varlen, "KERNEL_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
        patch.setattr(varlen, "_CHOSEN", {})
        patch.setattr(varlen, "_varlen_attn", lambda: function)
        yield


class _Syncs:
    """Counts what reads a tensor back to the host (a device sync on CUDA) while active."""

    NAMES = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__", "cpu")

    def __init__(self):
        self.calls: list[str] = []

    @contextlib.contextmanager
    def counting(self, monkeypatch):
        with monkeypatch.context() as patch:
            for name in self.NAMES:
                original = getattr(torch.Tensor, name)

                def counted(tensor, *args, _name=name, _original=original, **kwargs):
                    self.calls.append(_name)
                    return _original(tensor, *args, **kwargs)

                patch.setattr(torch.Tensor, name, counted)
            patch.setattr(torch.cuda, "synchronize",
                          lambda *args, **kwargs: self.calls.append("synchronize"))
            yield self.calls


#: (documents per sample, segment [start, end), window)
CASES = {
    "several-documents": (((0, 7, 19, 30),), (0, 48), None),
    "crossing": (((0, 10, 27),), (20, 64), None),
    "micro-batch-2": (((0, 10, 27), (0, 33)), (20, 64), None),
    "crossing-window": (((0, 10, 27), (0, 33)), (20, 64), 5),
}


class _Segment:
    """One segment's packing and leaf Q, K, V (``[L, b, h, d]``, ``[keys, b, g, d]``)."""

    def __init__(self, case: str, groups: int, seed: int = 0):
        starts, (start, end), window = CASES[case]
        self.view = Documents(starts, 64).view(start, end, window)
        self.window = window
        samples = len(starts)
        self.packed = Packed.of(self.view, samples, "cpu")
        generator = torch.Generator().manual_seed(seed)

        def leaf(*shape):
            return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

        keys = end - self.view.key_start
        self.inputs = (leaf(end - start, samples, HEADS, DIM), leaf(keys, samples, groups, DIM),
                       leaf(keys, samples, groups, DIM))
        self.grad = torch.randn(end - start, samples, HEADS * DIM, generator=generator,
                                dtype=torch.float64)

    def forward(self, attend=None):
        packed = self.packed
        q, k, v = packed.pack(*self.inputs)
        if attend is None:
            out = varlen.attention(q, k, v, packed.cu_q, packed.cu_k, packed.max_q, packed.max_k,
                                   scale=SCALE, window=self.window,
                                   cu_q_tensor=packed.cu_q_tensor,
                                   cu_k_tensor=packed.cu_k_tensor)
        else:
            out = attend(q, k, v)
        return packed.unpack(out)

    def output_and_grads(self, attend=None):
        out = self.forward(attend)
        return (out.detach(), *torch.autograd.grad(out, self.inputs, self.grad))

    def reference(self):
        """The per-piece loop (host cuts, one SDPA call per document piece)."""
        packed = self.packed
        return self.output_and_grads(lambda q, k, v: varlen._per_piece(
            q, k, v, packed.cu_q, packed.cu_k, scale=SCALE, window=self.window, dropout=0.0))


def _assert_close(got, want):
    for name, a, b in zip(("output", "query grad", "key grad", "value grad"), got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


KERNEL_FAKES = {"2.10": fake_2_10, "2.11": fake_2_11, "2.12-2.14": fake_2_12}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("groups", [HEADS, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("version", list(KERNEL_FAKES))
def test_kernel_path_equals_per_piece(monkeypatch, version, groups, case):
    """Each version's varlen_attn serves the call (no per-piece fallback), equal to the
    per-piece loop in output and gradients; GQA keys go unrepeated where enable_gqa exists."""
    if version == "2.10" and CASES[case][2] is not None:
        pytest.skip("torch 2.10 has no window_size: test_windows_without_window_size")
    record = _Fake()
    segment = _Segment(case, groups)
    with _kernel_on_cpu(monkeypatch, KERNEL_FAKES[version](record)):
        got = segment.output_and_grads()
    assert len(record.calls) == 2, "expected the self-check and the call itself"  # no fallback
    window, call = CASES[case][2], record.calls[-1]
    causal = (-1, 0) if version == "2.10" else (-1 if window is None else window, 0)
    assert call["window_size"] == causal
    assert call["key_heads"] == (groups if version == "2.12-2.14" else HEADS)
    _assert_close(got, segment.reference())


@pytest.mark.parametrize("version", list(KERNEL_FAKES))
def test_no_host_sync_per_layer(monkeypatch, version):
    """After the once-per-kind self-check, a layer's packing, kernel call and backward read
    nothing back from the device: cuts and maxima come from the plan."""
    record, syncs = _Fake(), _Syncs()
    segment = _Segment("micro-batch-2", 2)
    with _kernel_on_cpu(monkeypatch, KERNEL_FAKES[version](record)):
        segment.output_and_grads()  # the first call of its kind runs the self-check
        with syncs.counting(monkeypatch) as calls:
            got = segment.output_and_grads()
    assert calls == [], f"host reads on the kernel path: {calls}"
    assert len(record.calls) == 3  # self-check, warm-up, counted call: no fallback
    _assert_close(got, segment.reference())


def test_flash_attention_thd_passes_the_plan(monkeypatch):
    """FlashDotProductAttention's THD path, given the PackedSeqParams a Seq1F1B segment
    builds (attention/segmented.py), hands the plan's host cuts to the kernel: no sync."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_seq1f1b.attention.flash import FlashDotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=2, kv_channels=DIM, attention_dropout=0.0,
                               params_dtype=torch.float64)
    attention = FlashDotProductAttention(config, 1, AttnMaskType.causal, "self",
                                         softmax_scale=SCALE)
    record, syncs = _Fake(), _Syncs()
    segment = _Segment("crossing", 2)
    packed = segment.packed

    def through_flash(q, k, v):
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_q_tensor,
                                 cu_seqlens_kv=packed.cu_k_tensor, max_seqlen_q=packed.max_q,
                                 max_seqlen_kv=packed.max_k)
        params.seq1f1b_host = (packed.cu_q, packed.cu_k)
        return attention(q, k, v, None, attn_mask_type=varlen.PADDING_CAUSAL_BOTTOM_RIGHT,
                         packed_seq_params=params)

    with _kernel_on_cpu(monkeypatch, fake_2_12(record)):
        segment.output_and_grads(through_flash)
        with syncs.counting(monkeypatch) as calls:
            got = segment.output_and_grads(through_flash)
    assert calls == [], f"host reads on the kernel path: {calls}"
    assert len(record.calls) == 3
    _assert_close(got, segment.reference())


def test_windows_without_window_size(monkeypatch, caplog):
    """torch 2.10 cannot express a window: windowed layers take the per-piece path, logged
    once with the reason; unwindowed ones still get the kernel."""
    record = _Fake()
    segment = _Segment("crossing-window", 2)
    with _kernel_on_cpu(monkeypatch, fake_2_10(record)), caplog.at_level(logging.INFO, LOGGER):
        got = segment.output_and_grads()
        segment.output_and_grads()
    assert record.calls == []
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 1 and "has no window_size" in messages[0], messages
    assert "one SDPA call per document piece" in messages[0]
    _assert_close(got, segment.reference())


@pytest.mark.parametrize("make,reason", [
    (lambda record: fake_2_12(record, top_left=True), "failed its self-check"),
    (fake_no_causal, "takes neither window_size nor is_causal"),
    (lambda record: None, "does not exist (torch < 2.10)"),
], ids=["top-left-kernel", "no-causal-argument", "torch-2.9"])
def test_fallback_is_logged_once(monkeypatch, caplog, make, reason):
    """A kernel that aligns top-left fails the self-check; one that cannot be asked for causal
    attention, or none at all (torch 2.9), is not tried: each time the per-piece path
    serves it, correctly, and one warning says which kernel runs and why."""
    record = _Fake()
    segment = _Segment("micro-batch-2", 2)
    with _kernel_on_cpu(monkeypatch, make(record)), caplog.at_level(logging.INFO, LOGGER):
        got = segment.output_and_grads()
        segment.output_and_grads()
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.WARNING, records
    assert reason in records[0].getMessage() and "per document piece" in records[0].getMessage()
    assert len(record.calls) <= 1  # at most the self-check
    _assert_close(got, segment.reference())


def test_kernel_use_is_logged_once(monkeypatch, caplog):
    segment = _Segment("crossing", 2)
    with _kernel_on_cpu(monkeypatch, fake_2_12(_Fake())), caplog.at_level(logging.INFO, LOGGER):
        segment.output_and_grads()
        segment.output_and_grads()
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 1, messages
    assert "PyTorch varlen_attn (window_size=(-1, 0) / (w, 0); enable_gqa; scale)" in messages[0]


def test_installed_torch_signature():
    """The adapter reads the installed varlen_attn (torch >= 2.12: every argument it uses);
    forced onto CPU, where its flash op does not exist, the self-check turns it down."""
    function = varlen._varlen_attn()
    if function is None:
        pytest.skip("torch < 2.10: no torch.nn.attention.varlen")
    kernel, why = varlen._adapter(function)
    assert kernel is not None, why
    parameters = inspect.signature(function).parameters
    assert kernel.windows == ("window_size" in parameters)
    assert kernel.gqa == ("enable_gqa" in parameters)
    assert kernel.scale == ("scale" in parameters)


def test_installed_kernel_on_cpu_falls_back(monkeypatch, caplog):
    function = varlen._varlen_attn()
    if function is None:
        pytest.skip("torch < 2.10: no torch.nn.attention.varlen")
    segment = _Segment("crossing", 2)
    with _kernel_on_cpu(monkeypatch, function), caplog.at_level(logging.INFO, LOGGER):
        got = segment.output_and_grads()
    (message,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "failed its self-check" in message, message
    _assert_close(got, segment.reference())


class _Ops(TorchDispatchMode):
    """Every aten op run, the shape of what it returned, and the storage each attention
    kernel read its keys and values from."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []
        self.kv_storage: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
        self.ops.append((str(func), shape))
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.kv_storage += [t.untyped_storage().data_ptr() for t in args[1:3]]
        return out


@pytest.mark.parametrize("case", ["crossing", "micro-batch-2"])
def test_per_piece_gqa_builds_no_mask_and_copies_no_keys(case):
    """The CPU / fallback path with GQA in full precision: per piece, queries per group over
    keys expanded without a copy; the CPU prefix kernels then serve the crossing piece, so no
    ``[sq, sk]`` mask exists (CausalBias would build one under ``enable_gqa``) and no K/V copy
    per query head, nor a zero-filled gradient of all tokens per piece; equal to flash
    semantics computed densely."""
    segment = _Segment(case, 2)
    packed = segment.packed
    q, k, v = packed.pack(*segment.inputs)
    grad = torch.randn(q.shape[0], HEADS, DIM, dtype=torch.float64)
    with _Ops() as recorded:
        out = varlen._per_piece(q, k, v, packed.cu_q, packed.cu_k, scale=SCALE, window=None,
                                dropout=0.0)
        got = (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))
    pieces = list(zip(packed.cu_q, packed.cu_q[1:], packed.cu_k, packed.cu_k[1:]))
    masks = {(b - a, d - c) for a, b, c, d in pieces}
    assert any(sq < sk for sq, sk in masks), "no piece with more keys than queries"
    shapes = [(op, shape) for op, shape in recorded.ops if shape[-2:] in masks]
    assert not shapes, f"[sq, sk] tensors: {shapes}"
    assert recorded.kv_storage and set(recorded.kv_storage) == {
        k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()}, "K/V copied"
    # the backward gathers the pieces' gradients once, not one zero-filled T-row tensor each
    assert sum("slice_backward" in op for op, _ in recorded.ops) <= 3
    dense = _flash_semantics(q, k, v, packed.cu_q_tensor, packed.cu_k_tensor, SCALE, (-1, 0))
    want = (dense.detach(), *torch.autograd.grad(dense, (q, k, v), grad))
    _assert_close(got, want)
