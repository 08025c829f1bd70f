"""Reference gated delta rule (fla's chunked kernel and L2 norm) with initial and final states.

Part of :mod:`megatron_seq1f1b.runtime.recurrent_reference` (what each stands in for there).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_seq1f1b.runtime.reference_conv import _compute_dtype, _pad_time

# --------------------------------------------------------------------------------------------------
# gated delta rule (fla)
# --------------------------------------------------------------------------------------------------
def l2norm(x, eps=1e-6, output_dtype=None, dim=-1):
    """Matches ``fla.modules.l2norm.l2norm``: ``x / sqrt(sum(x^2) + eps)`` over the last dim, in
    fp32 (fp64 for fp64 input), returned in ``output_dtype`` or x's dtype. ``dim`` (last only) is
    accepted for Megatron's ``torch_chunk_gated_delta_rule``, which passes it."""
    if dim not in (-1, x.dim() - 1):
        raise NotImplementedError("l2norm normalises the last dimension")
    cd = _compute_dtype(x)
    xf = x.to(cd)
    y = xf * torch.rsqrt(xf.square().sum(dim=-1, keepdim=True) + eps)
    return y.to(output_dtype if output_dtype is not None else x.dtype)


def _gdr_chunked(q, k, v, g, beta, scale, state, L):
    """Chunked gated delta rule on [b, T, h, .] (q/k already per value head), state [b, h, K, V].

    Recurrence: ``S_t = exp(g_t) S_{t-1}``; ``u_t = beta_t (v_t - S_t^T k_t)``;
    ``S_t += k_t u_t^T``; ``o_t = scale S_t^T q_t``. Per chunk the u's solve the unit
    lower-triangular system ``(I + M) U = beta V - diag(beta gamma) K S_0`` with
    ``gamma_t = exp(sum_{s<=t} g_s)`` and ``M[t,s] = beta_t (gamma_t/gamma_s) k_t.k_s`` (s < t),
    then outputs and the chunk's end state.
    """
    b, T, h, K = k.shape
    V = v.shape[-1]
    nc = -(-T // L)
    pad = nc * L - T
    # padded tokens: g = 0 (no decay), k = 0 (no update)
    q, k, v, g, beta = (_pad_time(t, pad) for t in (q, k, v, g, beta))
    q = q.reshape(b, nc, L, h, K).permute(0, 3, 1, 2, 4)  # [b, h, nc, L, K]
    k = k.reshape(b, nc, L, h, K).permute(0, 3, 1, 2, 4)
    v = v.reshape(b, nc, L, h, V).permute(0, 3, 1, 2, 4)
    g = g.reshape(b, nc, L, h).permute(0, 3, 1, 2)  # [b, h, nc, L]
    beta = beta.reshape(b, nc, L, h).permute(0, 3, 1, 2)
    # decays summed in fp64: a chunk's sums reach hundreds, where fp32 differences of two
    # sums lose digits (a whole sequence and its segments would then round differently)
    G = g.to(torch.float64).cumsum(dim=-1)
    incl = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    diff = G[..., :, None] - G[..., None, :]
    # gamma_t / gamma_s for s <= t, 0 above the diagonal
    ratio = torch.where(incl, diff, torch.full_like(diff, -math.inf)).exp().to(q.dtype)
    kk = k @ k.transpose(-1, -2)
    M = beta[..., None] * torch.where(strict, ratio, torch.zeros_like(ratio)) * kk
    eye = torch.eye(L, dtype=q.dtype, device=q.device)
    tri = eye + M
    Tv = torch.linalg.solve_triangular(tri, beta[..., None] * v, upper=False, unitriangular=True)
    Tk = torch.linalg.solve_triangular(
        tri, (beta * G.exp().to(q.dtype))[..., None] * k, upper=False, unitriangular=True
    )
    qk = (q @ k.transpose(-1, -2)) * ratio
    outs = []
    for c in range(nc):
        U = Tv[:, :, c] - Tk[:, :, c] @ state  # [b, h, L, V]
        Gc = G[:, :, c]
        o = (q[:, :, c] * Gc.exp().to(q.dtype)[..., None]) @ state + qk[:, :, c] @ U
        outs.append(o * scale)
        to_end = (Gc[..., -1:] - Gc).exp().to(q.dtype)  # [b, h, L]
        state = (
            Gc[..., -1].exp().to(q.dtype)[..., None, None] * state
            + (k[:, :, c] * to_end[..., None]).transpose(-1, -2) @ U
        )
    if nc:
        o = torch.stack(outs, dim=2).reshape(b, h, nc * L, V)[:, :, :T].permute(0, 2, 1, 3)
    else:
        o = v.new_zeros(b, 0, h, V)
    return o, state


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
    **kwargs,
):
    """Matches ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.

    q/k [B, T, H, K], v [B, T, HV, V] (HV a multiple of H; value head j reads q/k head
    j // (HV // H)), g [B, T, HV] (log decay), beta [B, T, HV], scale (default K ** -0.5),
    initial_state [N, HV, K, V] (N = B, or the number of sequences with ``cu_seqlens``, B = 1, each
    sequence on its own). Per value head: ``S_t = exp(g_t) S_{t-1}``,
    ``S_t += beta_t k_t (v_t - S_t^T k_t)^T``, ``o_t = scale S_t^T q_t``.
    Options as fla's: ``use_qk_l2norm_in_kernel`` (``l2norm`` of q and k first),
    ``use_beta_sigmoid_in_kernel`` (beta = sigmoid(beta), times 2 with ``allow_neg_eigval``),
    ``state_v_first`` (states as [N, HV, V, K]), kwargs ``chunk_size`` (fla: 16/32/64; any here),
    ``use_gate_in_kernel`` with ``A_log`` / ``dt_bias`` (g = -exp(A_log) softplus(g + dt_bias)).
    Returns ``(o, final_state)``: o [B, T, HV, V] in q's dtype; final_state in fp32 (fp64 for fp64
    input) or None. ``cu_seqlens_cpu`` / ``chunk_indices`` are ignored; ``cp_context`` is refused.
    """
    if cp_context is not None:
        raise NotImplementedError("chunk_gated_delta_rule reference: cp_context is not supported")
    if "head_first" in kwargs:
        raise DeprecationWarning(
            "head_first has been removed. Inputs must be in `[B, T, H, ...]` format."
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError("q and k must have the same number of heads")
    Bsz, _, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"num_v_heads (HV={HV}) must be divisible by num_heads (H={H})")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    chunk_size = int(kwargs.get("chunk_size", 64))
    use_gate_in_kernel = kwargs.get("use_gate_in_kernel", False)
    if scale is None:
        scale = K**-0.5

    cd = _compute_dtype(q, k, v, g, beta, initial_state)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    qf, kf, vf, gf, bf = (t.to(cd) for t in (q, k, v, g, beta))
    if use_gate_in_kernel:
        A_log = kwargs.get("A_log")
        if A_log is None:
            raise ValueError("A_log must be provided when use_gate_in_kernel=True.")
        dt_bias = kwargs.get("dt_bias")
        if dt_bias is not None:
            gf = gf + dt_bias.to(cd)
        gf = -A_log.to(cd).exp() * F.softplus(gf)
    if use_beta_sigmoid_in_kernel:
        bf = bf.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    if HV != H:
        qf = qf.repeat_interleave(HV // H, dim=2)
        kf = kf.repeat_interleave(HV // H, dim=2)

    if cu_seqlens is None:
        spans = [(None, None)]
        nseq = Bsz
    else:
        if Bsz != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {Bsz} when using `cu_seqlens`."
            )
        bounds = [int(x) for x in cu_seqlens.tolist()]
        spans = list(zip(bounds[:-1], bounds[1:]))
        nseq = len(spans)
    h0 = None
    if initial_state is not None:
        if initial_state.shape[0] != nseq:
            raise ValueError(
                f"The number of initial states is expected to be {nseq}, "
                f"not {initial_state.shape[0]}"
            )
        h0 = initial_state.to(cd)
        if state_v_first:
            h0 = h0.transpose(-1, -2)
        if tuple(h0.shape) != (nseq, HV, K, V):
            raise ValueError(f"initial_state must be [N, HV, K, V] = {(nseq, HV, K, V)}")
    outs, finals = [], []
    for i, (s, e) in enumerate(spans):
        sl = slice(None) if s is None else slice(s, e)
        n_i = Bsz if s is None else 1
        st = (h0 if s is None else h0[i : i + 1]) if h0 is not None else qf.new_zeros(n_i, HV, K, V)
        o, st = _gdr_chunked(
            qf[:, sl], kf[:, sl], vf[:, sl], gf[:, sl], bf[:, sl], scale, st, chunk_size
        )
        outs.append(o)
        finals.append(st)
    o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    final = None
    if output_final_state:
        final = torch.cat(finals, dim=0) if len(finals) > 1 else finals[0]
        if state_v_first:
            final = final.transpose(-1, -2)
        final = final.contiguous()
    return o.to(q.dtype), final

