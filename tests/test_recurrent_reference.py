"""The torch reference kernels of megatron_seq1f1b.runtime.recurrent_reference against naive
per-token recurrences written here (fp64, forward and gradients, 1e-10), and the carry Seq1F1B
relies on: a sequence run in two parts, the first part's final states (conv window, SSM / delta-rule
state) fed as the second part's initial states, equals the sequence run whole (forward and
gradients, through the states and by handing the states' gradients back as Seq1F1B's backward
does)."""

import math

import pytest
import torch

from megatron_seq1f1b.runtime import recurrent_reference as ref

torch.set_num_threads(1)

TOL = dict(rtol=1e-10, atol=1e-10)
F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).requires_grad_()


def _close(a, b, what=""):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _grads(outputs, inputs, seed=123):
    """Gradients of sum(out * fixed random weights) over all outputs w.r.t. inputs."""
    g = _gen(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def _compare(outs_a, outs_b, inputs_a, inputs_b, names):
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        _close(a, b, f"output {i}")
    for n, ga, gb in zip(names, _grads(outs_a, inputs_a), _grads(outs_b, inputs_b)):
        _close(ga, gb, f"grad {n}")


def _twin(tensors):
    """Independent leaf copies (so the two implementations build separate graphs)."""
    return [
        None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in tensors
    ]


# ---------------------------------------------------------------------------------------------
# naive references
# ---------------------------------------------------------------------------------------------
def naive_ssm(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    softplus=False,
    limit=(0.0, math.inf),
    init=None,
    seq_idx=None,
):
    """Token by token. Returns (out, final state, list of states after each token)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    group = torch.tensor([i // (h // g) for i in range(h)])
    S = init if init is not None else torch.zeros(b, h, p, n, dtype=x.dtype)
    prev = torch.zeros(b, dtype=torch.long)
    outs, states = [], []
    for t in range(l):
        d = dt[:, t]
        if dt_bias is not None:
            d = d + dt_bias
        if softplus:
            d = torch.log1p(torch.exp(d))
        d = d.clamp(limit[0], limit[1])
        if seq_idx is not None:
            keep = (seq_idx[:, t].long() == prev).to(x.dtype)
            S = S * keep[:, None, None, None]
            prev = seq_idx[:, t].long()
        Bt, Ct = B[:, t][:, group], C[:, t][:, group]  # [b, h, n]
        S = (
            torch.exp(d * A)[:, :, None, None] * S
            + d[:, :, None, None] * x[:, t, :, :, None] * Bt[:, :, None, :]
        )
        y = (S * Ct[:, :, None, :]).sum(-1)
        if D is not None:
            y = y + x[:, t] * (D[:, None] if D.dim() == 1 else D)
        if z is not None:
            y = y * z[:, t] * torch.sigmoid(z[:, t])
        outs.append(y)
        states.append(S)
    return torch.stack(outs, 1), S, states


def naive_conv(x, w, bias=None, init=None, seq_idx=None, silu=False, init_id=0):
    """x [b, d, l], w [d, W]; out[t] = bias + sum_k w[k] x[t - W + 1 + k]."""
    b, d, l = x.shape
    W = w.shape[1]
    outs = []
    for t in range(l):
        acc = torch.zeros(b, d, dtype=x.dtype) if bias is None else bias.expand(b, d)
        for k in range(W):
            j = t - (W - 1) + k
            if j >= 0:
                val, sid = x[:, :, j], (seq_idx[:, j] if seq_idx is not None else None)
            elif init is not None:
                val, sid = init[:, :, W - 1 + j], torch.full((b,), init_id)
            else:
                continue
            if seq_idx is not None:
                val = val * (sid == seq_idx[:, t]).to(x.dtype)[:, None]
            acc = acc + w[:, k] * val
        if silu:
            acc = acc * torch.sigmoid(acc)
        if seq_idx is not None:
            acc = acc * (seq_idx[:, t] >= 0).to(x.dtype)[:, None]
        outs.append(acc)
    return torch.stack(outs, -1)


def naive_gated_rmsnorm(x, w, bias=None, z=None, eps=1e-6, group=None, before=True):
    N = x.shape[-1]
    group = group or N
    if z is not None and not before:
        x = x * z * torch.sigmoid(z)
    parts = []
    for i in range(N // group):
        xi = x[..., i * group : (i + 1) * group]
        parts.append(xi / torch.sqrt((xi * xi).mean(-1, keepdim=True) + eps))
    out = torch.cat(parts, -1) * w
    if bias is not None:
        out = out + bias
    if z is not None and before:
        out = out * z * torch.sigmoid(z)
    return out


def naive_gdr(q, k, v, g, beta, scale=None, init=None):
    """Token by token; q/k [b, T, H, K], v [b, T, HV, V].
    Returns (o, final, states after each token)."""
    b, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    src = torch.tensor([j // (HV // H) for j in range(HV)])
    S = init if init is not None else torch.zeros(b, HV, K, V, dtype=q.dtype)
    outs, states = [], []
    for t in range(T):
        qt, kt = q[:, t][:, src], k[:, t][:, src]
        S = torch.exp(g[:, t])[:, :, None, None] * S
        pred = (S * kt[..., None]).sum(-2)  # S^T k: [b, HV, V]
        u = beta[:, t][..., None] * (v[:, t] - pred)
        S = S + kt[..., None] * u[:, :, None, :]
        outs.append(scale * (S * qt[..., None]).sum(-2))
        states.append(S)
    return torch.stack(outs, 1), S, states


# ---------------------------------------------------------------------------------------------
# Mamba-2 chunked scan
# ---------------------------------------------------------------------------------------------
def _ssm_inputs(seed, b=2, l=11, h=4, p=3, g=2, n=5, D="vec", z=False, bias=False, init=False):
    r = _gen(seed)
    x = _randn(r, b, l, h, p)
    dt = _randn(r, b, l, h, scale=0.7)
    A = (-torch.exp(torch.rand(h, generator=r, dtype=F64))).requires_grad_()
    B = _randn(r, b, l, g, n)
    C = _randn(r, b, l, g, n)
    Dt = {"vec": _randn(r, h), "mat": _randn(r, h, p), None: None}[D]
    zt = _randn(r, b, l, h, p) if z else None
    bt = _randn(r, h, scale=0.5) if bias else None
    it = _randn(r, b, h, p, n) if init else None
    return x, dt, A, B, C, Dt, zt, bt, it


SCAN_CASES = {
    # name: (chunk, input options, dt handling, seq_idx rows or None)
    "D-vector": (4, dict(D="vec"), dict(softplus=False, limit=(0.0, math.inf)), None),
    "D-matrix-z-bias-softplus-limits-init": (
        4,
        dict(D="mat", z=True, bias=True, init=True),
        dict(softplus=True, limit=(0.4, 1.1)),
        None,
    ),
    "no-D-groups-1": (
        3,
        dict(D=None, g=1, init=True),
        dict(softplus=True, limit=(0.0, math.inf)),
        None,
    ),
    "heads-equal-groups": (
        5,
        dict(g=4, z=True, init=True),
        dict(softplus=True, limit=(0.0, math.inf)),
        None,
    ),
    "shorter-than-chunk": (
        16,
        dict(l=5, z=True, init=True, bias=True),
        dict(softplus=True, limit=(0.0, 2.0)),
        None,
    ),
    "multiple-of-chunk": (
        4,
        dict(l=12, init=True),
        dict(softplus=True, limit=(0.0, math.inf)),
        None,
    ),
    "chunk-1": (1, dict(l=6, D="mat", init=True), dict(softplus=True, limit=(0.0, math.inf)), None),
    "seq_idx-resets": (
        4,
        dict(l=13, z=True, bias=True, init=True),
        dict(softplus=True, limit=(0.0, math.inf)),
        [[0, 0, 0, 1, 1, 1, 1, 1, 2, 3, 3, 3, 3], [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]],
    ),
    "seq_idx-not-starting-at-0-drops-init": (
        4,
        dict(l=9, init=True),
        dict(softplus=True, limit=(0.0, math.inf)),
        [[1, 1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1]],
    ),
}


@pytest.mark.parametrize("case", list(SCAN_CASES))
def test_chunk_scan_matches_recurrence(case):
    chunk, opts, dtopts, rows = SCAN_CASES[case]
    inputs = _ssm_inputs(1, **opts)
    x, dt, A, B, C, D, z, bias, init = inputs
    seq_idx = torch.tensor(rows, dtype=torch.int32) if rows is not None else None
    out, final = ref.mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        chunk,
        D=D,
        z=z,
        dt_bias=bias,
        initial_states=init,
        seq_idx=seq_idx,
        dt_softplus=dtopts["softplus"],
        dt_limit=dtopts["limit"],
        return_final_states=True,
    )
    twin = _twin(inputs)
    n_out, n_final, _ = naive_ssm(
        *twin[:5], D=twin[5], z=twin[6], dt_bias=twin[7], init=twin[8], seq_idx=seq_idx, **dtopts
    )
    assert out.shape == x.shape and final.shape == (x.shape[0], x.shape[2], x.shape[3], B.shape[3])
    names = "x dt A B C D z dt_bias initial_states".split()
    keep = [i for i, t in enumerate(inputs) if t is not None]
    _compare(
        [out, final],
        [n_out, n_final],
        [inputs[i] for i in keep],
        [twin[i] for i in keep],
        [names[i] for i in keep],
    )


def test_chunk_scan_return_conventions_and_dtypes():
    x, dt, A, B, C, D, *_ = _ssm_inputs(2, b=1, l=6)
    out = ref.mamba_chunk_scan_combined(x, dt, A, B, C, 4, D=D)
    assert torch.is_tensor(out)
    cu = torch.tensor([0, 2, 6])
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.int32)
    res = ref.mamba_chunk_scan_combined(
        x, dt, A, B, C, 4, D=D, seq_idx=seq_idx, cu_seqlens=cu, return_varlen_states=True
    )
    assert len(res) == 2 and res[1].shape == (2, 4, 3, 5)
    res = ref.mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        4,
        D=D,
        seq_idx=seq_idx,
        cu_seqlens=cu,
        return_final_states=True,
        return_varlen_states=True,
    )
    assert len(res) == 3
    _close(res[1], res[2][-1:], "final state = last sequence's varlen state")
    # fp32 inputs: fp32 output; final states in state_dtype
    out32, fin = ref.mamba_chunk_scan_combined(
        *(t.detach().float() for t in (x, dt, A, B, C)),
        4,
        return_final_states=True,
        state_dtype=torch.float64,
    )
    assert out32.dtype == torch.float32 and fin.dtype == torch.float64
    with pytest.raises(ValueError):
        ref.mamba_chunk_scan_combined(x, dt, A, B, C, 4, return_varlen_states=True)


def test_chunk_scan_varlen_states():
    """cu_seqlens (with the matching seq_idx): each sequence's final state; the initial state
    belongs to the first."""
    cu = [0, 3, 9, 10, 14]
    seq_idx = torch.tensor(
        [[i for i in range(4) for _ in range(cu[i + 1] - cu[i])]], dtype=torch.int32
    )
    inputs = _ssm_inputs(3, b=1, l=14, z=True, bias=True, init=True)
    x, dt, A, B, C, D, z, bias, init = inputs
    out, final, varlen = ref.mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        4,
        D=D,
        z=z,
        dt_bias=bias,
        initial_states=init,
        seq_idx=seq_idx,
        cu_seqlens=torch.tensor(cu),
        dt_softplus=True,
        return_final_states=True,
        return_varlen_states=True,
    )
    twin = _twin(inputs)
    n_out, n_final, states = naive_ssm(
        *twin[:5],
        D=twin[5],
        z=twin[6],
        dt_bias=twin[7],
        init=twin[8],
        seq_idx=seq_idx,
        softplus=True,
    )
    n_varlen = torch.cat([states[e - 1] for e in cu[1:]], 0)
    _compare(
        [out, final, varlen],
        [n_out, n_final, n_varlen],
        list(inputs),
        twin,
        "x dt A B C D z dt_bias initial_states".split(),
    )


# ---------------------------------------------------------------------------------------------
# causal conv1d (causal-conv1d's and fla's)
# ---------------------------------------------------------------------------------------------
CONV_CASES = {
    "plain": dict(l=9, bias=True, act=None),
    "silu-init-final": dict(l=9, bias=True, act="silu", init=True, final=True),
    "swish-no-bias-final": dict(l=7, act="swish", final=True),
    "shorter-than-window-init-final": dict(l=2, bias=True, act="silu", init=True, final=True),
    "length-1-final-no-init": dict(l=1, act="silu", final=True),
    "seq_idx": dict(
        l=10,
        bias=True,
        act="silu",
        seq=[[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, -1, -1]],
    ),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_causal_conv1d_fn_matches_naive(case):
    o = CONV_CASES[case]
    r = _gen(4)
    b, d, W, l = 2, 5, 4, o["l"]
    x, w = _randn(r, b, d, l), _randn(r, d, W)
    bias = _randn(r, d) if o.get("bias") else None
    init = _randn(r, b, d, W - 1) if o.get("init") else None
    seq_idx = torch.tensor(o["seq"], dtype=torch.int32) if "seq" in o else None
    res = ref.causal_conv1d_fn(
        x,
        w,
        bias,
        seq_idx=seq_idx,
        initial_states=init,
        return_final_states=o.get("final", False),
        activation=o["act"],
    )
    outs = list(res) if isinstance(res, tuple) else [res]
    inputs = [x, w, bias, init]
    tw = _twin(inputs)
    n_out = naive_conv(tw[0], tw[1], tw[2], tw[3], seq_idx, silu=o["act"] is not None)
    n_outs = [n_out]
    if o.get("final"):
        prefix = tw[3] if tw[3] is not None else torch.zeros(b, d, W - 1, dtype=F64)
        n_outs.append(torch.cat([prefix, tw[0]], -1)[..., -(W - 1) :])
    keep = [i for i, t in enumerate(inputs) if t is not None]
    _compare(
        outs,
        n_outs,
        [inputs[i] for i in keep],
        [tw[i] for i in keep],
        ["x weight bias initial_states".split()[i] for i in keep],
    )


def test_causal_conv1d_fn_contract():
    r = _gen(5)
    x, w = _randn(r, 1, 3, 4), _randn(r, 3, 4)
    with pytest.raises(AssertionError):
        ref.causal_conv1d_fn(
            x,
            w,
            seq_idx=torch.zeros(1, 4, dtype=torch.int32),
            initial_states=torch.zeros(1, 3, 3, dtype=F64),
        )
    with pytest.raises(NotImplementedError):
        ref.causal_conv1d_fn(x, w, activation="gelu")
    buf = torch.empty(1, 3, 3, dtype=F64)
    _, fin = ref.causal_conv1d_fn(x, w, return_final_states=True, final_states_out=buf)
    assert fin is buf
    _close(buf, x.detach()[..., -3:])


@pytest.mark.parametrize("varlen", [False, True])
def test_fla_causal_conv1d_matches_naive(varlen):
    r = _gen(6)
    D, W = 6, 4
    if varlen:
        cu = [0, 2, 7, 11]
        x = _randn(r, 1, 11, D)
        h0 = _randn(r, 3, D, W)
    else:
        x = _randn(r, 2, 7, D)
        h0 = _randn(r, 2, D, W)
    w, bias, res_ = _randn(r, D, W), _randn(r, D), _randn(r, *x.shape)
    y, ht = ref.causal_conv1d(
        x,
        w,
        bias,
        residual=res_,
        initial_state=h0,
        output_final_state=True,
        activation="silu",
        cu_seqlens=torch.tensor(cu) if varlen else None,
    )
    inputs = [x, w, bias, res_, h0]
    tx, tw, tb, tr, th = _twin(inputs)
    spans = list(zip(cu[:-1], cu[1:])) if varlen else [(None, None)]
    ys, finals = [], []
    for i, (s, e) in enumerate(spans):
        xi = tx if s is None else tx[:, s:e]
        hi = th if s is None else th[i : i + 1]
        ys.append(naive_conv(xi.transpose(1, 2), tw, tb, hi[..., 1:], silu=True).transpose(1, 2))
        finals.append(torch.cat([hi, xi.transpose(1, 2)], -1)[..., -W:])
    n_y = torch.cat(ys, 1) + tr
    _compare(
        [y, ht],
        [n_y, torch.cat(finals, 0)],
        inputs,
        [tx, tw, tb, tr, th],
        "x weight bias residual initial_state".split(),
    )


# ---------------------------------------------------------------------------------------------
# gated RMSNorm, L2 norm
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [None, 3])
@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_gated_rmsnorm_matches_naive(group, before, gated):
    r = _gen(7)
    x, w, bias = _randn(r, 2, 5, 12), _randn(r, 12), _randn(r, 12)
    z = _randn(r, 2, 5, 12) if gated else None
    out = ref.rmsnorm_fn(x, w, bias, z=z, eps=1e-5, group_size=group, norm_before_gate=before)
    inputs = [x, w, bias, z]
    tw = _twin(inputs)
    n_out = naive_gated_rmsnorm(tw[0], tw[1], tw[2], tw[3], eps=1e-5, group=group, before=before)
    keep = [i for i, t in enumerate(inputs) if t is not None]
    _compare(
        [out], [n_out], [inputs[i] for i in keep], [tw[i] for i in keep], ["x", "w", "bias", "z"]
    )


def test_rmsnorm_gated_module():
    norm = ref.RMSNormGated(12, eps=1e-5, group_size=4, norm_before_gate=False, dtype=F64)
    assert ref.RMSNorm is ref.RMSNormGated and norm.bias is None
    assert torch.equal(norm.weight, torch.ones(12, dtype=F64))
    r = _gen(8)
    x, z = torch.randn(3, 12, generator=r, dtype=F64), torch.randn(3, 12, generator=r, dtype=F64)
    _close(
        norm(x, z), naive_gated_rmsnorm(x, norm.weight, None, z, eps=1e-5, group=4, before=False)
    )
    _close(norm(x), naive_gated_rmsnorm(x, norm.weight, None, None, eps=1e-5, group=4))
    assert norm(x.float()).dtype == torch.float32


def test_l2norm():
    r = _gen(9)
    x = _randn(r, 2, 3, 4, 5)
    y = ref.l2norm(x)
    (tx,) = _twin([x])
    _compare([y], [tx / torch.sqrt((tx * tx).sum(-1, keepdim=True) + 1e-6)], [x], [tx], ["x"])
    _close(ref.l2norm(x, dim=-1, eps=1e-6), y)
    assert ref.l2norm(x.detach().float(), output_dtype=torch.bfloat16).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# gated delta rule
# ---------------------------------------------------------------------------------------------
def _gdr_inputs(seed, b=2, T=11, H=2, HV=2, K=4, V=3, init=True, n_init=None):
    r = _gen(seed)
    q, k = _randn(r, b, T, H, K), _randn(r, b, T, H, K)
    with torch.no_grad():  # unit keys keep the delta rule contractive, as Megatron's l2norm does
        k /= k.norm(dim=-1, keepdim=True)
    v = _randn(r, b, T, HV, V)
    g = (-torch.rand(b, T, HV, generator=r, dtype=F64) * 0.7).requires_grad_()
    beta = torch.rand(b, T, HV, generator=r, dtype=F64).requires_grad_()
    h0 = _randn(r, n_init or b, HV, K, V) if init else None
    return [q, k, v, g, beta, h0]


GDR_CASES = {
    "basic": (4, {}, {}),
    "gva": (4, dict(H=2, HV=4), {}),
    "no-init": (4, dict(init=False), {}),
    "shorter-than-chunk": (64, dict(T=5), {}),
    "multiple-of-chunk": (4, dict(T=8), {}),
    "scale-l2norm-in-kernel": (3, {}, dict(scale=0.37, use_qk_l2norm_in_kernel=True)),
    "beta-sigmoid-neg-eigval": (
        4,
        {},
        dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    ),
    "state-v-first": (4, {}, dict(state_v_first=True)),
    "gate-in-kernel": (4, {}, dict(use_gate_in_kernel=True)),
}


@pytest.mark.parametrize("case", list(GDR_CASES))
def test_gated_delta_rule_matches_recurrence(case):
    chunk, shape, opts = GDR_CASES[case]
    inputs = _gdr_inputs(10, **shape)
    extra = []
    if opts.get("use_gate_in_kernel"):
        r = _gen(11)
        A_log, dt_bias = (
            _randn(r, inputs[2].shape[2], scale=0.3),
            _randn(r, inputs[2].shape[2], scale=0.3),
        )
        opts = dict(opts, A_log=A_log, dt_bias=dt_bias)
        extra = [A_log, dt_bias]
    q, k, v, g, beta, h0 = inputs
    h0_arg = h0.transpose(-1, -2) if (h0 is not None and opts.get("state_v_first")) else h0
    o, ht = ref.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0_arg, output_final_state=True, chunk_size=chunk, **opts
    )
    tw = _twin(inputs + extra)
    tq, tk, tv, tg, tb, th = tw[:6]
    if opts.get("use_qk_l2norm_in_kernel"):
        tq = tq / torch.sqrt((tq * tq).sum(-1, keepdim=True) + 1e-6)
        tk = tk / torch.sqrt((tk * tk).sum(-1, keepdim=True) + 1e-6)
    if opts.get("use_beta_sigmoid_in_kernel"):
        tb = 2 * torch.sigmoid(tb)
    if opts.get("use_gate_in_kernel"):
        tg = -torch.exp(tw[6]) * torch.log1p(torch.exp(tg + tw[7]))
    n_o, n_ht, _ = naive_gdr(tq, tk, tv, tg, tb, scale=opts.get("scale"), init=th)
    if opts.get("state_v_first"):
        n_ht = n_ht.transpose(-1, -2)
    keep = [i for i, t in enumerate(inputs + extra) if t is not None]
    names = "q k v g beta initial_state A_log dt_bias".split()
    _compare(
        [o, ht],
        [n_o, n_ht],
        [(inputs + extra)[i] for i in keep],
        [tw[i] for i in keep],
        [names[i] for i in keep],
    )


def test_gated_delta_rule_varlen():
    cu = [0, 3, 10, 11, 15]
    inputs = _gdr_inputs(12, b=1, T=15, H=1, HV=2, n_init=4)
    o, ht = ref.chunk_gated_delta_rule(
        *inputs[:5],
        initial_state=inputs[5],
        output_final_state=True,
        cu_seqlens=torch.tensor(cu),
        chunk_size=4,
    )
    tw = _twin(inputs)
    outs, finals = [], []
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        oi, hi, _ = naive_gdr(*(t[:, s:e] for t in tw[:5]), init=tw[5][i : i + 1])
        outs.append(oi)
        finals.append(hi)
    _compare(
        [o, ht], [torch.cat(outs, 1), torch.cat(finals, 0)], inputs, tw, "q k v g beta h0".split()
    )
    o2, none = ref.chunk_gated_delta_rule(
        *(t.detach() for t in inputs[:5]), cu_seqlens=torch.tensor(cu)
    )
    assert none is None and o2.shape == o.shape
    with pytest.raises(ValueError):
        ref.chunk_gated_delta_rule(
            *inputs[:5], initial_state=inputs[5][:2], cu_seqlens=torch.tensor(cu)
        )


def test_torch_dtypes_follow_fla():
    q, k, v, g, beta, h0 = (t.detach().float() for t in _gdr_inputs(13, T=6))
    o, ht = ref.chunk_gated_delta_rule(
        q.bfloat16(),
        k.bfloat16(),
        v.bfloat16(),
        g,
        beta.bfloat16(),
        initial_state=h0,
        output_final_state=True,
    )
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Mamba-2 training kernel (conv + scan + norm + projection)
# ---------------------------------------------------------------------------------------------
def _split_inputs(seed, b=2, l=10, h=4, p=2, g=2, n=3, W=4, d_nonssm=0, D="vec", init=False):
    r = _gen(seed)
    dim = h * p
    conv_dim = dim + 2 * g * n
    zxbcdt = _randn(r, b, l, 2 * d_nonssm + dim + conv_dim + h)
    cw, cb = _randn(r, conv_dim, W, scale=0.5), _randn(r, conv_dim, scale=0.3)
    dt_bias = _randn(r, h, scale=0.5)
    A = (-torch.exp(torch.rand(h, generator=r, dtype=F64))).requires_grad_()
    Dt = _randn(r, h) if D == "vec" else _randn(r, h, p)
    h0 = _randn(r, b, h, p, n) if init else None
    return [zxbcdt, cw, cb, dt_bias, A, Dt, h0], dict(
        h=h, p=p, g=g, n=n, dim=dim, d_nonssm=d_nonssm
    )


def _naive_split(
    zxbcdt,
    cw,
    cb,
    dt_bias,
    A,
    D,
    h0,
    meta,
    seq_idx=None,
    limit=(0.0, math.inf),
    rms_w=None,
    before=True,
    out_w=None,
    out_b=None,
    conv_init=None,
):
    h, p, g, n, dim, dn = (meta[k] for k in ("h", "p", "g", "n", "dim", "d_nonssm"))
    b, l, _ = zxbcdt.shape
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * dn, dim, dim + 2 * g * n, h], -1)
    xBC = naive_conv(
        xBC.transpose(1, 2), cw, cb, init=conv_init, seq_idx=seq_idx, silu=True
    ).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, g * n, g * n], -1)
    z4 = z.reshape(b, l, h, p)
    y, final, _ = naive_ssm(
        x.reshape(b, l, h, p),
        dt,
        A,
        B.reshape(b, l, g, n),
        C.reshape(b, l, g, n),
        D=D,
        z=z4 if rms_w is None else None,
        dt_bias=dt_bias,
        softplus=True,
        limit=limit,
        init=h0,
        seq_idx=seq_idx,
    )
    y = y.reshape(b, l, dim)
    if rms_w is not None:
        y = naive_gated_rmsnorm(y, rms_w, None, z, eps=1e-6, group=dim // g, before=before)
    if dn:
        a, c = zx0.chunk(2, -1)
        y = torch.cat([a * torch.sigmoid(a) * c, y], -1)
    if out_w is not None:
        y = y @ out_w.T + (out_b if out_b is not None else 0)
    return y, final


SPLIT_CASES = {
    # D vector + headdim, z gating in the scan (Megatron's own norm comes after)
    "megatron-default": dict(),
    "D-matrix-init-limits": dict(D="mat", init=True, limit=(0.3, 1.2)),
    "rmsnorm-gate-after": dict(rms=True, before=False, init=True),
    "rmsnorm-gate-before-swiglu-outproj": dict(rms=True, before=True, d_nonssm=3, outproj=True),
    "seq_idx": dict(
        init=True, seq=[[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]]
    ),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_conv1d_scan_matches_naive(case):
    o = SPLIT_CASES[case]
    inputs, meta = _split_inputs(
        14, D=o.get("D", "vec"), init=o.get("init", False), d_nonssm=o.get("d_nonssm", 0)
    )
    r = _gen(15)
    rms_w = _randn(r, meta["dim"]) if o.get("rms") else None
    out_w = _randn(r, 5, meta["dim"] + meta["d_nonssm"]) if o.get("outproj") else None
    out_b = _randn(r, 5) if o.get("outproj") else None
    seq_idx = torch.tensor(o["seq"], dtype=torch.int32) if "seq" in o else None
    limit = o.get("limit", (0.0, math.inf))
    zxbcdt, cw, cb, dt_bias, A, D, h0 = inputs
    y, final = ref.mamba_split_conv1d_scan_combined(
        zxbcdt,
        cw,
        cb,
        dt_bias,
        A,
        D,
        4,
        initial_states=h0,
        seq_idx=seq_idx,
        dt_limit=limit,
        return_final_states=True,
        rmsnorm_weight=rms_w,
        outproj_weight=out_w,
        outproj_bias=out_b,
        headdim=meta["p"] if D.dim() == 1 else None,
        ngroups=meta["g"],
        norm_before_gate=o.get("before", True),
    )
    all_in = inputs + [rms_w, out_w, out_b]
    tw = _twin(all_in)
    n_y, n_final = _naive_split(
        *tw[:7],
        meta,
        seq_idx=seq_idx,
        limit=limit,
        rms_w=tw[7],
        before=o.get("before", True),
        out_w=tw[8],
        out_b=tw[9],
    )
    keep = [i for i, t in enumerate(all_in) if t is not None]
    names = "zxbcdt conv_w conv_b dt_bias A D h0 rms_w out_w out_b".split()
    _compare(
        [y, final],
        [n_y, n_final],
        [all_in[i] for i in keep],
        [tw[i] for i in keep],
        [names[i] for i in keep],
    )


# ---------------------------------------------------------------------------------------------
# the carry across a cut (what Seq1F1B does between segments)
# ---------------------------------------------------------------------------------------------
def _handoff_grads(part1, part2, leaves, seed=321):
    """Seq1F1B's backward: segment 2 first (its initial states are detached leaves), then segment 1
    with the gradients of its final states = the gradients segment 2 returned for its initial
    states. part1() -> (outputs1, states1); part2(states) -> outputs2.
    Returns (outputs1, outputs2, grads of leaves, the loss weights)."""
    outs1, states1 = part1()
    carried = [s.detach().requires_grad_() for s in states1]
    outs2 = part2(carried)
    g = _gen(seed)
    w2 = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs2]
    w1 = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs1]
    loss2 = sum((o * w).sum() for o, w in zip(outs2, w2))
    grads2 = torch.autograd.grad(loss2, list(leaves) + carried, allow_unused=True)
    g_leaves2, g_states = grads2[: len(leaves)], grads2[len(leaves) :]
    loss1 = sum((o * w).sum() for o, w in zip(outs1, w1))
    loss1 = loss1 + sum((s * gs).sum() for s, gs in zip(states1, g_states) if gs is not None)
    g_leaves1 = torch.autograd.grad(loss1, list(leaves), allow_unused=True)
    total = [
        None if (a is None and c is None) else (0 if a is None else a) + (0 if c is None else c)
        for a, c in zip(g_leaves1, g_leaves2)
    ]
    return outs1, outs2, total, (w1, w2)


def _whole_grads(outs, leaves, cut, weights):
    w1, w2 = weights
    loss = sum(((o[:, :cut] * a).sum() + (o[:, cut:] * b).sum()) for o, a, b in zip(outs, w1, w2))
    return torch.autograd.grad(loss, list(leaves), allow_unused=True)


def _check_split(whole, part1, part2, leaves, cut, names):
    outs1, outs2, handoff, weights = _handoff_grads(part1, part2, leaves)
    for i, (o, a, b) in enumerate(zip(whole(), outs1, outs2)):
        _close(torch.cat([a, b], 1), o, f"output {i} of the two parts")
    # gradients by handing the state gradients back (Seq1F1B) ...
    for n, a, b in zip(names, handoff, _whole_grads(whole(), leaves, cut, weights)):
        _close(a, b, f"grad {n} (handoff)")
    # ... and by autograd straight through the states
    outs1, states1 = part1()
    outs2 = part2(states1)
    joined = [torch.cat([a, b], 1) for a, b in zip(outs1, outs2)]
    for n, a, b in zip(names, _grads(joined, leaves), _grads(whole(), leaves)):
        _close(a, b, f"grad {n} (through the states)")


SPLIT_CUTS = {
    # name: (length, cut, chunk, seq_idx row or None)
    "mid-chunk": (11, 6, 4, None),
    "at-chunk-boundary": (12, 8, 4, None),
    "first-part-shorter-than-window": (9, 2, 4, None),
    "second-part-shorter-than-window": (9, 7, 4, None),
    "both-shorter-than-chunk": (7, 3, 16, None),
    "document-crosses-cut": (12, 7, 4, [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2]),
    "document-starts-at-cut": (12, 5, 4, [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3]),
    "several-documents-in-window": (12, 7, 4, [0, 0, 0, 0, 1, 2, 3, 3, 3, 3, 3, 3]),
}


def _local(seq_idx, cut):
    """A segment's seq_idx: the global one minus that of the last token before the cut."""
    if seq_idx is None or cut == 0:
        return seq_idx
    return seq_idx - seq_idx[:, cut - 1 : cut]


@pytest.mark.parametrize("case", list(SPLIT_CUTS))
def test_split_mamba_fused_kernel_carries_state(case):
    """mamba_split_conv1d_scan_combined (Megatron's training kernel), conv-state extension."""
    l, cut, chunk, row = SPLIT_CUTS[case]
    inputs, meta = _split_inputs(16, b=2, l=l, init=True, D="mat")
    zxbcdt, cw, cb, dt_bias, A, D, h0 = inputs
    seq_idx = torch.tensor([row, row], dtype=torch.int32) if row is not None else None
    kw = dict(ngroups=meta["g"], return_final_states=True)

    def run(z, s, init, conv_init, conv_final):
        return ref.mamba_split_conv1d_scan_combined(
            z,
            cw,
            cb,
            dt_bias,
            A,
            D,
            chunk,
            initial_states=init,
            seq_idx=s,
            conv_initial_states=conv_init,
            return_conv_final_states=conv_final,
            **kw,
        )

    def whole():
        return [run(zxbcdt, seq_idx, h0, None, False)[0]]

    def part1():
        y, ssm, conv = run(
            zxbcdt[:, :cut],
            _local(seq_idx, 0) if seq_idx is None else seq_idx[:, :cut],
            h0,
            None,
            True,
        )
        return [y], [ssm, conv]

    def part2(states):
        s2 = None if seq_idx is None else _local(seq_idx, cut)[:, cut:]
        return [run(zxbcdt[:, cut:], s2, states[0], states[1], False)[0]]

    _check_split(whole, part1, part2, inputs, cut, "zxbcdt conv_w conv_b dt_bias A D h0".split())


@pytest.mark.parametrize(
    "case", ["mid-chunk", "first-part-shorter-than-window", "both-shorter-than-chunk"]
)
def test_split_mamba_unfused_kernels_carry_state(case):
    """causal_conv1d_fn + mamba_chunk_scan_combined (Megatron's non-mem-eff path) + gated RMSNorm,
    states carried through the kernels' own initial/final-state arguments."""
    l, cut, chunk, _ = SPLIT_CUTS[case]
    inputs, meta = _split_inputs(17, b=2, l=l, init=True)
    zxbcdt, cw, cb, dt_bias, A, D, h0 = inputs
    rms_w = _randn(_gen(18), meta["dim"])
    h, p, g, n, dim = (meta[k] for k in ("h", "p", "g", "n", "dim"))
    leaves = inputs + [rms_w]

    def run(z_in, init, conv_init):
        b, t, _ = z_in.shape
        z, xBC, dt = torch.split(z_in, [dim, dim + 2 * g * n, h], -1)
        xBC, conv_final = ref.causal_conv1d_fn(
            xBC.transpose(1, 2),
            cw,
            cb,
            initial_states=conv_init,
            return_final_states=True,
            activation="silu",
        )
        x, B, C = torch.split(xBC.transpose(1, 2), [dim, g * n, g * n], -1)
        y, ssm_final = ref.mamba_chunk_scan_combined(
            x.reshape(b, t, h, p),
            dt,
            A,
            B.reshape(b, t, g, n),
            C.reshape(b, t, g, n),
            chunk,
            D=D,
            dt_bias=dt_bias,
            initial_states=init,
            dt_softplus=True,
            return_final_states=True,
        )
        y = ref.rmsnorm_fn(
            y.reshape(b, t, dim), rms_w, None, z=z, group_size=dim // g, norm_before_gate=False
        )
        return y, ssm_final, conv_final

    def whole():
        return [run(zxbcdt, h0, None)[0]]

    def part1():
        y, ssm, conv = run(zxbcdt[:, :cut], h0, None)
        return [y], [ssm, conv]

    def part2(states):
        return [run(zxbcdt[:, cut:], states[0], states[1])[0]]

    _check_split(
        whole, part1, part2, leaves, cut, "zxbcdt conv_w conv_b dt_bias A D h0 rms_w".split()
    )


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("cut", [2, 6])
def test_split_gated_delta_net_carries_state(varlen, cut):
    """fla-style conv + l2norm + chunk_gated_delta_rule (Megatron's non-deterministic GDN path).
    varlen: packed documents [0, 4), [4, 9), [9, 13) in one row; the cut splits a document (cut 6)
    or falls in the first one (cut 2); each part passes cu_seqlens of its own pieces, with the
    crossing document's states carried and the others starting from zero."""
    r = _gen(19)
    T, Hk, HV, K, V, W = 13, 1, 2, 3, 2, 4
    b = 1 if varlen else 2
    conv_dim = 2 * Hk * K + HV * V
    qkv = _randn(r, b, T, conv_dim)
    cw = _randn(r, conv_dim, W, scale=0.5)
    g = (-torch.rand(b, T, HV, generator=r, dtype=F64) * 0.7).requires_grad_()
    beta = torch.rand(b, T, HV, generator=r, dtype=F64).requires_grad_()
    docs = [0, 4, 9, 13]
    leaves = [qkv, cw, g, beta]

    def run(qkv_in, g_in, beta_in, cu, conv_init, state_init):
        y, conv_final = ref.causal_conv1d(
            qkv_in,
            cw,
            None,
            initial_state=conv_init,
            output_final_state=True,
            activation="silu",
            cu_seqlens=cu,
        )
        bb, t, _ = y.shape
        q, k, v = torch.split(y, [Hk * K, Hk * K, HV * V], -1)
        q = ref.l2norm(q.reshape(bb, t, Hk, K))
        k = ref.l2norm(k.reshape(bb, t, Hk, K))
        o, state = ref.chunk_gated_delta_rule(
            q,
            k,
            v.reshape(bb, t, HV, V),
            g_in,
            beta_in,
            initial_state=state_init,
            output_final_state=True,
            cu_seqlens=cu,
            chunk_size=4,
        )
        return o, conv_final, state

    def pieces(lo, hi):
        cuts = sorted({lo, hi, *[d for d in docs if lo < d < hi]})
        return torch.tensor([c - lo for c in cuts])

    def whole():
        return [run(qkv, g, beta, torch.tensor(docs) if varlen else None, None, None)[0]]

    def part1():
        o, conv, state = run(
            qkv[:, :cut], g[:, :cut], beta[:, :cut], pieces(0, cut) if varlen else None, None, None
        )
        return [o], [conv[-1:] if varlen else conv, state[-1:] if varlen else state]

    def part2(states):
        conv, state = states
        cu = None
        if varlen:
            cu = pieces(cut, T)
            extra = len(cu) - 2  # documents after the crossing one start from zero
            conv = torch.cat([conv, conv.new_zeros(extra, *conv.shape[1:])], 0)
            state = torch.cat([state, state.new_zeros(extra, *state.shape[1:])], 0)
        return [run(qkv[:, cut:], g[:, cut:], beta[:, cut:], cu, conv, state)[0]]

    _check_split(whole, part1, part2, leaves, cut, "qkv conv_w g beta".split())
