"""Segment-aware core attention and rotary embeddings (installed by ``enable``).

Inside a segmented step, core attention gets this segment's queries against
the keys/values of segments ``0..j`` of the same micro-batch (see
:mod:`megatron_seq1f1b.kv_cache`), with the causal mask aligned to the bottom
right: query ``i`` (position ``start + i``) sees keys ``0 .. start + i``.
Outside a segmented step, or with a single segment, the original forward
runs untouched.

Backends:

* Megatron's local ``DotProductAttention``: it asserts equal query/key
  lengths when no mask is given, so we pass an explicit boolean mask
  ``[1, 1, L, end]`` (True = masked), or the user's own mask already sliced by
  :func:`~megatron_seq1f1b.segments.slice_batch` (Megatron uses a given mask
  as is). Its softmax is switched to the masked (non-causal) kernel for the
  call, because the fused causal kernel ignores masks and needs L == end.
* Transformer Engine's ``TEDotProductAttention``: ``causal_bottom_right``
  (TE's plain ``causal`` is aligned top-left when lengths differ); masks are
  dropped, as TE ignores them for causal attention anyway.

Sliding windows (``window_size=(w, 0)``, per layer as Megatron decides with
``window_attn_skip_freq``): query ``i`` sees keys ``start + i - w .. start + i``,
so a segment gets only rows ``[max(0, start - w), end)``; both backends align
their window bottom-right, which is then exactly the full sequence's window.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_seq1f1b import segments
from megatron_seq1f1b.kv_cache import KVAppend

_ORIGINAL = "_seq1f1b_original_forward"


def _segmented() -> "segments._Active | None":
    current = segments.active()
    if current is None or current.info.num_splits == 1:
        return None
    return current


def first_row(current, window: int | None) -> int:
    """The oldest key row this segment's queries can see."""
    return 0 if window is None else max(0, current.info.start - window)


def layer_window(core_attention) -> int | None:
    """Left window of this layer in keys (``None``: the whole prefix).

    Megatron's local attention keeps the layer's window on its softmax;
    Transformer Engine keeps its own ``window_size`` (``-1`` = unbounded).
    """
    softmax = getattr(core_attention, "scale_mask_softmax", None)
    window = getattr(softmax if softmax is not None else core_attention, "window_size", None)
    if window is None or window[0] is None or window[0] < 0:
        return None
    if window[1] not in (0, -1):
        raise ValueError(
            f"Seq1F1B: sliding window {tuple(window)} looks ahead {window[1]} tokens; causal "
            "segments cannot see later segments' keys; use window_size=(w, 0)"
        )
    return int(window[0])


def prefix_kv(layer, key, value, current, window: int | None = None):
    """Keys/values ``[first_row, end)`` of this micro-batch for `layer`, this segment's rows added."""
    info, run = current.info, current.run
    if key.shape[0] != info.length:
        raise RuntimeError(
            f"Seq1F1B: attention received {key.shape[0]} keys for segment {info.index} of "
            f"{info.length} tokens; batches must be cut with megatron_seq1f1b.slice_batch "
            "and pipeline inputs must have the segment's shape"
        )
    entry = run.kv.get(info.microbatch, info.chunk, layer)
    if current.phase == segments.FORWARD:
        if entry is None:
            if info.index != 0:
                raise RuntimeError(f"Seq1F1B: {_where(info)} forwarded before segment 0")
            entry = run.kv.create(
                info.microbatch, info.chunk, layer, key, value, sum(info.lengths)
            )
        if info.index in entry.forwarded:
            raise RuntimeError(
                f"Seq1F1B: {_where(info)} forwarded twice; a repeated forward would overwrite "
                "the key/value cache (recomputation must run inside the segment's backward)"
            )
        if len(entry.forwarded) != info.index:  # segments 0..index-1, each once (checked)
            missing = sorted(set(range(info.index)) - entry.forwarded)
            raise RuntimeError(f"Seq1F1B: {_where(info)} forwarded before segments {missing}")
        entry.forwarded.add(info.index)
        write = True
    else:
        # Recomputation inside the segment's backward: the cache already holds
        # this segment's rows; reuse them, write nothing, count nothing.
        if entry is None or info.index not in entry.forwarded:
            raise RuntimeError(f"Seq1F1B: {_where(info)} recomputed without a cached forward")
        write = False
    return KVAppend.apply(key, value, run.kv, entry, info, write, first_row(current, window))


def _where(info) -> str:
    return f"micro-batch {info.microbatch}, segment {info.index}, chunk {info.chunk}"


@contextlib.contextmanager
def _masked_softmax(core_attention):
    from megatron.core.transformer.enums import AttnMaskType

    softmax = core_attention.scale_mask_softmax
    saved = softmax.attn_mask_type
    softmax.attn_mask_type = AttnMaskType.padding
    try:
        yield
    finally:
        softmax.attn_mask_type = saved


def _segment_mask(attention_mask, current, device, window: int | None):
    info = current.info
    if attention_mask is None:
        return current.run.causal_mask(info, device, window)
    if tuple(attention_mask.shape[-2:]) != (info.length, info.end):
        raise ValueError(
            f"Seq1F1B: attention_mask of shape {tuple(attention_mask.shape)} for segment "
            f"{info.index} (tokens {info.start}..{info.end}); expected [..., {info.length}, "
            f"{info.end}]: cut the batch with megatron_seq1f1b.slice_batch"
        )
    if window is None:
        return attention_mask
    # Megatron's windowed softmax builds its own mask; keep the given one in step.
    keys = torch.arange(first_row(current, window), info.end, device=device)
    queries = torch.arange(info.start, info.end, device=device).unsqueeze(1)
    return attention_mask[..., first_row(current, window):] | (keys < queries - window)


def _reject_unsliceable(packed_seq_params, attention_bias) -> None:
    """Inputs shaped for the whole sequence that a segment cannot cut (yet)."""
    if packed_seq_params is not None:
        raise ValueError(
            "Seq1F1B does not support packed sequences (THD, packed_seq_params); use "
            "padded [b, s] batches"
        )
    if attention_bias is not None:
        raise ValueError(
            "Seq1F1B does not support an attention_bias (it is shaped for the whole "
            "sequence, not a segment); run without it"
        )


def local_attention_forward(core_attention, original):
    """Forward for Megatron's ``DotProductAttention``."""
    from megatron.core.transformer.enums import AttnMaskType

    def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        current = _segmented()
        if current is None:
            return original(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        _reject_unsliceable(packed_seq_params, attention_bias)
        window = layer_window(core_attention)
        key, value = prefix_kv(core_attention, key, value, current, window)
        mask = _segment_mask(attention_mask, current, query.device, window)
        with _masked_softmax(core_attention):
            return original(query, key, value, mask, attn_mask_type=AttnMaskType.padding,
                            attention_bias=attention_bias, packed_seq_params=None)

    return forward


def te_attention_forward(core_attention, original):
    """Forward for Transformer Engine's ``TEDotProductAttention`` (and look-alikes)."""
    from megatron.core.transformer.enums import AttnMaskType

    def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        current = _segmented()
        if current is None:
            return original(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                            **kwargs)
        _reject_unsliceable(packed_seq_params, attention_bias)
        mask_type = attn_mask_type if attn_mask_type is not None else core_attention.attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.causal_bottom_right, "causal"):
            raise ValueError(
                f"Seq1F1B needs causal self-attention; this layer uses {mask_type}"
            )
        key, value = prefix_kv(core_attention, key, value, current, layer_window(core_attention))
        return original(query, key, value, None, attn_mask_type=AttnMaskType.causal_bottom_right,
                        attention_bias=attention_bias, packed_seq_params=None, **kwargs)

    return forward


def rotary_forward(rotary, original):
    """RotaryEmbedding.forward with the segment's position offset."""

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        current = _segmented()
        if current is None:
            return original(max_seq_len, offset, packed_seq, cp_group)
        info = current.info
        if max_seq_len != info.length:
            raise RuntimeError(
                f"Seq1F1B: rotary embedding asked for {max_seq_len} positions in segment "
                f"{info.index} of {info.length} tokens; cut each segment's batch with "
                "megatron_seq1f1b.slice_batch"
            )
        return original(max_seq_len, offset + info.start, packed_seq, cp_group)

    return forward


def install_forward(module, make_forward) -> bool:
    """Replace `module.forward` (instance attribute, state_dict untouched); idempotent."""
    if hasattr(module, _ORIGINAL):
        return False
    original = module.forward
    setattr(module, _ORIGINAL, original)
    module.forward = make_forward(module, original)
    return True


def is_te_attention(module) -> bool:
    """TE's attention, or a core attention that declares TE's contract (``bottom_right_causal``:
    takes ``attn_mask_type=causal_bottom_right`` and a K/V prefix)."""
    return getattr(type(module), "bottom_right_causal", False) or any(
        cls.__name__ == "TEDotProductAttention" for cls in type(module).__mro__)
