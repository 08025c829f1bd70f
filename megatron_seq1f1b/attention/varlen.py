"""Variable-length (THD) attention over documents: packing a segment, and the kernels.

A segment with documents is many small causal attentions: per sample, one
per document piece (:class:`~megatron_seq1f1b.segments.documents.Piece`), queries
``[q0, q1)`` over keys ``[k0, q1)``, aligned bottom-right. Transformer
Engine and PyTorch's flash kernel take such a batch as *THD*: queries and
keys of all pieces packed along one token dimension, cut by cumulative
lengths (``cu_seqlens_q``, ``cu_seqlens_kv``). No ``[queries, keys]`` mask
exists anywhere.

* :class:`~megatron_seq1f1b.segments.packed.Packed`: one segment's packing (made once per segment and window,
  shared by its layers). With micro-batch size 1 queries and keys are views
  (the K/V buffer's rows ``[key_start, end)`` are exactly the pieces' keys);
  with more samples they are gathered (one copy of the segment's Q, K, V).
* :func:`attention`: the kernel. On CUDA PyTorch's ``varlen_attn`` (its flash
  kernel, torch >= 2.9) where it exists; elsewhere one SDPA call per piece,
  causal (``is_causal``), or bottom-right for the piece that crosses into the
  segment (:func:`~megatron_seq1f1b.attention.prefix.bottom_right_causal`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_seq1f1b.attention.prefix import bottom_right_causal


class MaskType(NamedTuple):
    """A Transformer Engine mask type Megatron's ``AttnMaskType`` lacks (TE reads ``.name``)."""

    name: str


#: THD needs a padding mask type; the document crossing into a segment from earlier ones has
#: more keys than queries, aligned bottom-right.
PADDING_CAUSAL_BOTTOM_RIGHT = MaskType("padding_causal_bottom_right")


_VERIFIED: dict = {}


def _torch_varlen(device: torch.device, dtype: torch.dtype, window: bool):
    """PyTorch's ``varlen_attn`` if it exists here and, checked once per device, dtype and
    window use against per-piece SDPA, aligns causal pieces bottom-right as this module does
    (a kernel that aligned them top-left would be silently wrong)."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if window and "window_size" not in inspect.signature(varlen_attn).parameters:
        return None
    key = (device, dtype, window)
    if key not in _VERIFIED:
        _VERIFIED[key] = _agrees(varlen_attn, device, dtype, window)
    return varlen_attn if _VERIFIED[key] else None


def _agrees(varlen_attn, device, dtype, window: bool) -> bool:
    """Two sequences, one with more keys than queries: varlen_attn against the SDPA path."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    make = lambda n: torch.randn(n, 2, 64, generator=generator).to(device, dtype)  # noqa: E731
    query, key, value = make(40), make(56), make(56)
    cu_q, cu_k, w = (0, 24, 40), (0, 40, 56), (7 if window else None)
    try:
        fast = _call_varlen(varlen_attn, query, key, value, cu_q, cu_k, 24, 40, 0.125, w, None, None)
    except Exception:  # noqa: BLE001 - a kernel that does not run here is not used
        return False
    slow = _per_piece(query, key, value, cu_q, cu_k, scale=0.125, window=w, dropout=0.0)
    return bool(torch.allclose(fast.float(), slow.float(), atol=2e-2, rtol=2e-2))


def _call_varlen(varlen_attn, query, key, value, cu_q, cu_k, max_q, max_k, scale, window,
                 cu_q_tensor, cu_k_tensor):
    device = query.device
    cu_q_t = cu_q_tensor if cu_q_tensor is not None else torch.tensor(
        cu_q, dtype=torch.int32, device=device)
    cu_k_t = cu_k_tensor if cu_k_tensor is not None else torch.tensor(
        cu_k, dtype=torch.int32, device=device)
    heads, groups = query.shape[1], key.shape[1]
    if groups != heads:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
    extra = {} if window is None else {"window_size": (window, 0)}
    return varlen_attn(query, key, value, cu_q_t, cu_k_t, max_q, max_k, scale=scale, **extra)


def window_mask(sq: int, sk: int, window: int, device) -> torch.Tensor:
    """Boolean ``[sq, sk]`` mask (True = attend): causal, bottom-right, ``window`` keys back."""
    rows = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    keys = torch.arange(sk, device=device)
    return (keys <= rows) & (keys >= rows - window)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              cu_q: tuple[int, ...], cu_k: tuple[int, ...], max_q: int, max_k: int, *,
              scale: float, window: int | None = None, dropout: float = 0.0,
              cu_q_tensor: torch.Tensor | None = None,
              cu_k_tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention per sequence of a THD batch, aligned bottom-right; ``[T, h, dv]`` out.

    ``query`` ``[Tq, heads, d]``, ``key`` / ``value`` ``[Tk, groups, d]`` (GQA
    when groups < heads). Sequence ``i`` is queries ``cu_q[i]:cu_q[i+1]`` over
    keys ``cu_k[i]:cu_k[i+1]``.
    """
    varlen = None
    if query.is_cuda and dropout == 0.0 and key.shape[-1] == value.shape[-1] \
            and query.dtype in (torch.float16, torch.bfloat16):
        varlen = _torch_varlen(query.device, query.dtype, window is not None)
    if varlen is not None:
        return _call_varlen(varlen, query, key, value, cu_q, cu_k, max_q, max_k, scale, window,
                            cu_q_tensor, cu_k_tensor)
    return _per_piece(query, key, value, cu_q, cu_k, scale=scale, window=window, dropout=dropout)


def _per_piece(query, key, value, cu_q, cu_k, *, scale: float, window: int | None,
               dropout: float) -> torch.Tensor:
    """One SDPA call per sequence (no mask tensor unless a window needs one)."""
    heads, groups = query.shape[1], key.shape[1]
    outputs = []
    for i in range(len(cu_q) - 1):
        q = query[cu_q[i]:cu_q[i + 1]].transpose(0, 1)  # [h, sq, d]
        k = key[cu_k[i]:cu_k[i + 1]].transpose(0, 1)
        v = value[cu_k[i]:cu_k[i + 1]].transpose(0, 1)
        sq, sk = q.shape[1], k.shape[1]
        if groups != heads:
            k = k.repeat_interleave(heads // groups, dim=0)
            v = v.repeat_interleave(heads // groups, dim=0)
        if window is not None:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=window_mask(sq, sk, window, q.device), dropout_p=dropout,
                scale=scale)
        else:
            out = bottom_right_causal(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                      scale=scale, dropout=dropout).squeeze(0)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
