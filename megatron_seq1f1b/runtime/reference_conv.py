"""Reference causal convolutions (``causal_conv1d``'s and fla's) with initial and final states.

Part of :mod:`megatron_seq1f1b.runtime.recurrent_reference` (what each stands in for, and how
Seq1F1B carries a window across a cut, is said there); the shared dtype and document helpers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_ACTIVATIONS = (None, "silu", "swish")

# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def _compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """fp64 when any floating input is fp64, else fp32 (the kernels accumulate in fp32)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _segments(seq_idx: torch.Tensor) -> torch.Tensor:
    """Segment number of each token ([b, l] int64): it grows by one wherever ``seq_idx`` changes,
    a virtual token with ``seq_idx`` 0 preceding position 0 (segment 0 owns the initial state)."""
    seq_idx = seq_idx.long()
    prev = torch.cat([torch.zeros_like(seq_idx[:, :1]), seq_idx[:, :-1]], dim=1)
    return (seq_idx != prev).long().cumsum(dim=1)


def _pad_time(t: torch.Tensor, pad: int, dim: int = 1) -> torch.Tensor:
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


# --------------------------------------------------------------------------------------------------
# causal depthwise convolution
# --------------------------------------------------------------------------------------------------
def _conv_core(x, weight, bias, seq_idx, initial_states, activation, with_final):
    """Causal depthwise conv over [b, d, l]: ``out[t] = bias + sum_k w[k] x[t - (w-1) + k]``.

    ``initial_states`` [b, d, w-1] are the inputs before position 0 (zeros without it). With
    ``seq_idx`` [b, l] a tap contributes only when its token's ``seq_idx`` equals the output token's
    (the initial-state positions count as ``seq_idx`` 0), and tokens with ``seq_idx < 0`` output 0.
    Returns (out in the compute dtype, final [b, d, w-1] or None): the last ``w-1`` inputs of
    ``[initial_states, x]``, with ``seq_idx`` those of the last token's sequence (others zeroed).
    """
    b, d, _ = x.shape
    w = weight.shape[-1]
    cd = _compute_dtype(x, weight, bias, initial_states)
    xf = x.to(cd)
    if initial_states is None:
        prefix = xf.new_zeros(b, d, w - 1)
    else:
        if tuple(initial_states.shape) != (b, d, w - 1):
            raise ValueError(f"initial_states must be [b, d, w-1] = {(b, d, w - 1)}")
        prefix = initial_states.to(cd)
    xx = torch.cat([prefix, xf], dim=-1)  # [b, d, w-1+l]
    wf = weight.to(cd)
    if seq_idx is None:
        out = F.conv1d(xx, wf.unsqueeze(1), groups=d)
    else:
        windows = xx.unfold(-1, w, 1)  # [b, d, l, w]
        sid = seq_idx.long()
        pre = torch.full(
            (b, w - 1), 0 if initial_states is not None else -1, dtype=torch.long, device=sid.device
        )
        sid_ext = torch.cat([pre, sid], dim=1)
        same = (sid_ext.unfold(-1, w, 1) == sid[:, :, None]).to(cd)  # [b, l, w]
        out = (windows * wf[None, :, None, :] * same[:, None]).sum(-1)
    if bias is not None:
        out = out + bias.to(cd)[None, :, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    if seq_idx is not None:
        out = out * (seq_idx >= 0).to(cd)[:, None, :]
    final = None
    if with_final:
        final = xx[..., xx.shape[-1] - (w - 1) :]
        if seq_idx is not None:
            keep = (sid_ext[:, sid_ext.shape[1] - (w - 1) :] == sid[:, -1:]).to(cd)
            final = final * keep[:, None, :]
    return out, final


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """Matches ``causal_conv1d.causal_conv1d_fn`` (Dao-AILab/causal-conv1d).

    x [b, d, l], weight [d, w], bias [d], seq_idx [b, l] (taps of another sequence are zero; tokens
    with ``seq_idx < 0`` output 0), initial_states [b, d, w-1] (the inputs before position 0),
    final_states_out [b, d, w-1] (written to), activation None / "silu" / "swish".
    Returns ``out`` [b, d, l] (x's dtype), or ``(out, final_states)`` with ``return_final_states``:
    the last ``w-1`` inputs of ``[initial_states, x]`` (zero-filled on the left when shorter), in
    x's dtype, differentiable. As the kernel, ``seq_idx`` excludes ``initial_states`` and final
    states (Seq1F1B on packed data: prepend the carried window as tokens of the first document
    instead). The kernel's layout constraints (channel-last for states / seq_idx, width 2..4) are
    not imposed.
    """
    if activation not in _ACTIVATIONS:
        raise NotImplementedError("activation must be None, silu, or swish")
    if seq_idx is not None:
        assert initial_states is None, "initial_states must be None if seq_idx is not None"
        assert not return_final_states, "If seq_idx is not None, we don't return final_states_out"
    out, final = _conv_core(
        x, weight, bias, seq_idx, initial_states, activation, return_final_states
    )
    out = out.to(x.dtype)
    if not return_final_states:
        return out
    final = final.to(x.dtype)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def causal_conv1d(
    x,
    weight=None,
    bias=None,
    residual=None,
    initial_state=None,
    output_final_state=False,
    activation=None,
    backend="triton",
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
    **kwargs,
):
    """Matches ``fla.modules.convolution.causal_conv1d`` (flash-linear-attention; used by GDN).

    x [B, T, D] (or [B, T, ...] flattened to D), weight [D, W], bias [D], residual [B, T, D] (added
    after the activation), initial_state [N, D, W]: the last W inputs before each sequence (only the
    last W-1 enter the convolution), N = B, or the number of sequences with ``cu_seqlens`` (B = 1;
    each sequence convolved on its own). Returns ``(y, final_state)``: y in x's shape and dtype,
    final_state [N, D, W] = the last W inputs of ``[initial_state or zeros, x]`` per sequence (x's
    dtype), or None without ``output_final_state``. ``backend`` and ``chunk_indices`` are ignored
    (same numbers); ``cp_context`` is refused.
    """
    if cp_context is not None:
        raise NotImplementedError("causal_conv1d reference: cp_context is not supported")
    if weight is None:
        raise NotImplementedError("causal_conv1d reference needs a weight")
    if activation not in _ACTIVATIONS:
        raise NotImplementedError("activation must be None, silu, or swish")
    shape = x.shape
    D, W = weight.shape
    xs = x.reshape(x.shape[0], x.shape[1], D)
    if cu_seqlens is None:
        spans = [(None, None)]
        nseq = xs.shape[0]
    else:
        if xs.shape[0] != 1:
            raise ValueError("causal_conv1d with cu_seqlens expects batch size 1")
        bounds = [int(v) for v in cu_seqlens.tolist()]
        spans = list(zip(bounds[:-1], bounds[1:]))
        nseq = len(spans)
    if initial_state is not None and tuple(initial_state.shape) != (nseq, D, W):
        raise ValueError(f"initial_state must be [N, D, W] = {(nseq, D, W)}")
    ys, finals = [], []
    for i, (s, e) in enumerate(spans):
        if s is None:
            xi, hi = xs, initial_state
        else:
            xi, hi = xs[:, s:e], (initial_state[i : i + 1] if initial_state is not None else None)
        xt = xi.transpose(1, 2)  # [n, D, T]
        y, _ = _conv_core(
            xt, weight, bias, None, hi[..., 1:] if hi is not None else None, activation, False
        )
        ys.append(y.transpose(1, 2))
        if output_final_state:
            prefix = hi if hi is not None else xt.new_zeros(xt.shape[0], D, W)
            full = torch.cat([prefix.to(xt.dtype), xt], dim=-1)
            finals.append(full[..., full.shape[-1] - W :])
    y = torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]
    if residual is not None:
        y = y + residual.reshape(y.shape).to(y.dtype)
    y = y.to(x.dtype).reshape(shape)
    final = torch.cat(finals, dim=0).to(x.dtype) if output_final_state else None
    return y, final


