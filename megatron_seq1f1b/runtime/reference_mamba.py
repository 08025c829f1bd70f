"""Reference Mamba-2 kernels (mamba_ssm's chunked scan, its fused split-conv-scan, the gated
RMSNorm) with initial and final states.

Part of :mod:`megatron_seq1f1b.runtime.recurrent_reference` (what each stands in for there).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_seq1f1b.runtime.reference_conv import (
    _ACTIVATIONS, _compute_dtype, _conv_core, _pad_time, _segments,
)

# --------------------------------------------------------------------------------------------------
# Mamba-2 chunked scan (SSD)
# --------------------------------------------------------------------------------------------------
def _ssd_chunked(x, dt, A, B, C, chunk_size, initial_states, seg):
    """Chunked state-space-duality scan (no ``D``, no ``z``).

    x [b, l, h, p], dt [b, l, h] (after bias/softplus/limits), A [h], B/C [b, l, h, n] (per head),
    initial_states [b, h, p, n] or None, seg [b, l] or None. All in the compute dtype.
    Per chunk: the quadratic (masked, decayed ``C B^T``) form inside the chunk, plus the state
    entering the chunk, which is passed from chunk to chunk.
    Returns (y [b, l, h, p], final [b, h, p, n]).
    """
    b, l, h, p = x.shape
    n = B.shape[-1]
    L = int(chunk_size)
    nc = -(-l // L)
    pad = nc * L - l
    # padded tokens: dt = 0 (no decay), x = 0 (no input): they change no state
    x, dt, B, C = (_pad_time(t, pad) for t in (x, dt, B, C))
    if seg is not None and pad:
        seg = torch.cat([seg, seg[:, -1:].expand(b, pad)], dim=1)
    x = x.reshape(b, nc, L, h, p)
    dt = dt.reshape(b, nc, L, h)
    B = B.reshape(b, nc, L, h, n)
    C = C.reshape(b, nc, L, h, n)
    cum = torch.cumsum(dt * A, dim=2)  # [b, nc, L, h]: log-decay from the chunk start

    # intra-chunk: y_t += sum_{s<=t, same segment} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    mask = causal.view(1, 1, L, L)
    if seg is not None:
        segc = seg.reshape(b, nc, L)
        mask = mask & (segc[:, :, :, None] == segc[:, :, None, :])
    diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [b, nc, t, s, h]
    decay = torch.where(mask[..., None], diff, torch.full_like(diff, -math.inf)).exp()
    scores = torch.einsum("bcthn,bcshn->bctsh", C, B) * decay * dt[:, :, None, :, :]
    y = torch.einsum("bctsh,bcshp->bcthp", scores, x)

    # each chunk's own contribution to the state at its end (tokens of the chunk's last segment)
    to_end = torch.exp(cum[:, :, -1:, :] - cum) * dt  # [b, nc, L, h]
    if seg is not None:
        to_end = to_end * (segc == segc[:, :, -1:]).to(to_end.dtype)[..., None]
    chunk_states = torch.einsum("bcsh,bcshp,bcshn->bchpn", to_end, x, B)

    # inter-chunk: pass the state along, resetting where the segment changes
    if initial_states is None:
        state = x.new_zeros(b, h, p, n)
    else:
        state = initial_states
    outs = []
    for c in range(nc):
        carry = None
        if seg is not None:
            prev_seg = segc[:, c - 1, -1:] if c > 0 else torch.zeros_like(segc[:, 0, :1])
            carry = (segc[:, c] == prev_seg).to(x.dtype)  # [b, L]
        decay_in = torch.exp(cum[:, c])  # [b, L, h]
        inter = torch.einsum("blhn,bhpn->blhp", C[:, c] * decay_in[..., None], state)
        if carry is not None:
            inter = inter * carry[:, :, None, None]
        outs.append(y[:, c] + inter)
        keep = decay_in[:, -1]  # [b, h]
        if carry is not None:
            keep = keep * carry[:, -1:]
        state = state * keep[:, :, None, None] + chunk_states[:, c]
    y = torch.stack(outs, dim=1).reshape(b, nc * L, h, p)[:, :l] if nc else y.reshape(b, 0, h, p)
    return y, state


def _process_dt(dt, dt_bias, dt_softplus, dt_limit, cd):
    """dt (+ dt_bias), softplus (identity above 20, as the kernel's), clamped to ``dt_limit``."""
    dt = dt.to(cd)
    if dt_bias is not None:
        dt = dt + dt_bias.to(cd)
    if dt_softplus:
        dt = F.softplus(dt)  # threshold 20: log1p(exp(x)) for x <= 20, x above (the kernel's rule)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])  # the kernel always clamps (default [0, inf))


def _heads(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """[b, l, g, n] -> [b, l, h, n]: head i reads group i // (h // g)."""
    g = t.shape[2]
    return t if g == nheads else t.repeat_interleave(nheads // g, dim=2)


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
    state_dtype=None,
):
    """Matches ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``.

    x [b, l, h, p], dt [b, l, h], A [h], B/C [b, l, g, n] (g divides h), D [h] or [h, p],
    z [b, l, h, p], dt_bias [h], initial_states [b, h, p, n], seq_idx [b, l] (non-decreasing in each
    row), cu_seqlens [num_seqs + 1] (read only for ``return_varlen_states``; batch 1).

    Recurrence per head: ``dt_t = clamp(softplus?(dt_t + dt_bias), *dt_limit)``,
    ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T`` (reset to zero where ``seq_idx`` changes; a
    virtual token with ``seq_idx`` 0 holding ``initial_states`` precedes position 0),
    ``y_t = S_t C_t + D x_t``, ``out = y * silu(z)`` when ``z`` is given.
    Returns ``out`` [b, l, h, p] (x's dtype), ``(out, final_states)`` with ``return_final_states``
    (state after the last token, dtype ``state_dtype`` or C's), and with ``return_varlen_states``
    ``(out, varlen_states)`` / ``(out, final_states, varlen_states)``: varlen_states
    [num_seqs, h, p, n] is the state after each sequence's last token, restarted at each
    ``cu_seqlens`` start (sequence 0 from ``initial_states`` when it starts the segment owning them)
    -- mamba_ssm's answer when ``cu_seqlens`` and ``seq_idx`` agree (it omits ``initial_states`` for
    a first sequence ending inside the first chunk; this is the recurrence's value). Unlike
    mamba_ssm, varlen states have a backward here.
    """
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"nheads {h} is not a multiple of ngroups {g}")
    if tuple(B.shape) != (b, l, g, n) or tuple(C.shape) != tuple(B.shape):
        raise ValueError(f"B/C must be [b, l, g, n]; got {tuple(B.shape)}, {tuple(C.shape)}")
    if tuple(dt.shape) != (b, l, h) or tuple(A.shape) != (h,):
        raise ValueError(f"dt must be [b, l, h] and A [h]; got {tuple(dt.shape)}, {tuple(A.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError("z must have x's shape")
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        raise ValueError(f"D must be [h] or [h, p]; got {tuple(D.shape)}")
    if initial_states is not None and tuple(initial_states.shape) != (b, h, p, n):
        raise ValueError(f"initial_states must be [b, h, p, n]; got {tuple(initial_states.shape)}")
    if seq_idx is not None and tuple(seq_idx.shape) != (b, l):
        raise ValueError("seq_idx must be [b, l]")
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens must be provided if return_varlen_states is True")
        if b != 1:
            raise ValueError("passing cu_seqlens to get the varlen states needs batch size 1")

    cd = _compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    dtp = _process_dt(dt, dt_bias, dt_softplus, dt_limit, cd)
    xf = x.to(cd)
    Af = A.to(cd)
    Bh = _heads(B.to(cd), h)
    Ch = _heads(C.to(cd), h)
    init = initial_states.to(cd) if initial_states is not None else None
    seg = _segments(seq_idx) if seq_idx is not None else None

    y, final = _ssd_chunked(xf, dtp, Af, Bh, Ch, chunk_size, init, seg)
    if D is not None:
        Df = D.to(cd)
        y = y + xf * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.to(cd))
    out = y.to(x.dtype)
    sdt = state_dtype if state_dtype is not None else C.dtype
    result = [out]
    if return_final_states:
        result.append(final.to(sdt))
    if return_varlen_states:
        bounds = [int(v) for v in cu_seqlens.tolist()]
        first_owns = seq_idx is None or int(seq_idx[0, 0]) == 0
        states = []
        for i in range(len(bounds) - 1):
            s, e = bounds[i], bounds[i + 1]
            start = init if (s == 0 and first_owns and init is not None) else None
            _, st = _ssd_chunked(
                xf[:, s:e], dtp[:, s:e], Af, Bh[:, s:e], Ch[:, s:e], chunk_size, start, None
            )
            states.append(st)
        result.append(torch.cat(states, dim=0).to(sdt))
    return result[0] if len(result) == 1 else tuple(result)


# --------------------------------------------------------------------------------------------------
# gated RMSNorm (mamba_ssm.ops.triton.layernorm_gated)
# --------------------------------------------------------------------------------------------------
def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Matches ``mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn``.

    RMS-normalises each group of ``group_size`` channels (all channels when None) of the last dim,
    scales by ``weight`` (+ ``bias``); with ``z``: ``norm(x) * silu(z)`` if ``norm_before_gate``
    else ``norm(x * silu(z))``. Computed in fp32 (fp64 for fp64 input), returned in x's dtype.
    """
    cd = _compute_dtype(x, weight, z)
    N = x.shape[-1]
    gs = N if group_size is None else int(group_size)
    if N % gs:
        raise ValueError(f"hidden size {N} is not a multiple of group_size {gs}")
    xf = x.to(cd)
    zf = z.to(cd) if z is not None else None
    if zf is not None and not norm_before_gate:
        xf = xf * F.silu(zf)
    xg = xf.reshape(*xf.shape[:-1], N // gs, gs)
    xg = xg * torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)
    out = xg.reshape(xf.shape) * weight.to(cd)
    if bias is not None:
        out = out + bias.to(cd)
    if zf is not None and norm_before_gate:
        out = out * F.silu(zf)
    return out.to(x.dtype)


class RMSNormGated(torch.nn.Module):
    """Matches ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` (Megatron imports it as
    ``RMSNormGated``): same constructor, ``weight`` (ones), ``bias`` registered as None,
    ``forward(x, z=None)`` = :func:`rmsnorm_fn`."""

    def __init__(
        self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None
    ):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return rmsnorm_fn(
            x,
            self.weight,
            self.bias,
            z=z,
            eps=self.eps,
            group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
        )


RMSNorm = RMSNormGated


# --------------------------------------------------------------------------------------------------
# Mamba-2 training kernel: conv + scan (+ gated norm, + out projection)
# --------------------------------------------------------------------------------------------------
def mamba_split_conv1d_scan_combined(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    initial_states=None,
    seq_idx=None,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    activation="silu",
    rmsnorm_weight=None,
    rmsnorm_eps=1e-6,
    outproj_weight=None,
    outproj_bias=None,
    headdim=None,
    ngroups=1,
    norm_before_gate=True,
    state_dtype=None,
    *,
    conv_initial_states=None,
    return_conv_final_states=False,
):
    """Matches ``mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined``.

    zxbcdt [b, l, 2*d_nonssm + 2*dim + 2*ngroups*n + h] splits into ``zx0`` (SwiGLU branch, output
    ``silu(first half) * second half``), ``z`` [dim], ``xBC`` [dim + 2*ngroups*n] and ``dt`` [h];
    ``xBC`` goes through the causal conv (conv1d_weight [dim + 2*ngroups*n, w], ``seq_idx``,
    ``activation``), splits into x, B, C, and the scan runs with ``dt_softplus=True``, ``dt_bias``,
    ``dt_limit``, ``D`` ([h] with ``headdim``, or [h, p]), ``initial_states`` (the SSM state),
    ``seq_idx``; ``z`` gates in the scan, or, with ``rmsnorm_weight`` [dim], through the gated
    RMSNorm (group size dim / ngroups, ``norm_before_gate``). Then ``[swiglu(zx0), y]`` and the
    optional ``F.linear(., outproj_weight, outproj_bias)``.
    Returns ``out`` or ``(out, final_states)``.

    Extension (not in mamba_ssm, whose fused kernel has no conv state): ``conv_initial_states``
    [b, conv_dim, w-1] feeds the conv window (with ``seq_idx``, it belongs to ``seq_idx`` 0 like the
    SSM state) and ``return_conv_final_states`` appends the conv's final window (the last w-1
    ``xBC`` inputs of the last token's sequence) to the returned tuple. On GPU the same carry needs
    ``causal_conv1d_fn`` + ``mamba_chunk_scan_combined`` (Megatron's non-mem-eff path).
    """
    if activation not in _ACTIVATIONS:
        raise NotImplementedError("activation must be None, silu, or swish")
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim must be passed when D is 1-D")
        (nheads,) = D.shape
    else:
        nheads, headdim = D.shape
    b, l, _ = zxbcdt.shape
    dim = nheads * headdim
    if nheads % ngroups:
        raise ValueError("nheads must be a multiple of ngroups")
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    if d_nonssm < 0 or zxbcdt.shape[-1] != 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads:
        raise ValueError("zxbcdt's last dimension does not match D / conv1d_weight / ngroups")
    if tuple(dt_bias.shape) != (nheads,) or tuple(A.shape) != (nheads,):
        raise ValueError("dt_bias and A must be [nheads]")
    zx0, z, xBC, dt = torch.split(
        zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1
    )

    conv_out, conv_final = _conv_core(
        xBC.transpose(1, 2),
        conv1d_weight,
        conv1d_bias,
        seq_idx,
        conv_initial_states,
        activation,
        return_conv_final_states,
    )
    xBC = conv_out.to(zxbcdt.dtype).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(b, l, nheads, headdim)
    B = B.reshape(b, l, ngroups, dstate)
    C = C.reshape(b, l, ngroups, dstate)
    z = z.reshape(b, l, nheads, headdim)
    y, final_states = mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=D,
        z=z if rmsnorm_weight is None else None,
        dt_bias=dt_bias,
        initial_states=initial_states,
        seq_idx=seq_idx,
        dt_softplus=True,
        dt_limit=dt_limit,
        return_final_states=True,
        state_dtype=state_dtype,
    )
    y = y.reshape(b, l, dim)
    if rmsnorm_weight is not None:
        y = rmsnorm_fn(
            y,
            rmsnorm_weight,
            None,
            z=z.reshape(b, l, dim),
            eps=rmsnorm_eps,
            group_size=dim // ngroups,
            norm_before_gate=norm_before_gate,
        )
    if d_nonssm > 0:
        gate, up = zx0.chunk(2, dim=-1)
        y = torch.cat([(F.silu(gate.to(y.dtype)) * up.to(y.dtype)), y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(
            y,
            outproj_weight.to(y.dtype),
            outproj_bias.to(y.dtype) if outproj_bias is not None else None,
        )
    elif outproj_bias is not None:
        raise ValueError("outproj_bias without outproj_weight")
    result = [y]
    if return_final_states:
        result.append(final_states)
    if return_conv_final_states:
        result.append(conv_final.to(zxbcdt.dtype))
    return result[0] if len(result) == 1 else tuple(result)


