"""Mamba-2 (``M``) and gated-delta-net (``G``) layers in the planner's memory model.

A recurrent layer keeps no keys and values: what crosses a Seq1F1B cut is a fixed-size state
(:mod:`megatron_seq1f1b.segments.state_carry`), so its activations grow linearly with a
segment, plus what its chunked scan keeps per chunk. Pure: no torch, no Megatron; ``shape`` is a
:class:`~megatron_seq1f1b.planner.footprint.ModelShape` (read by attribute).

**Parameters** (Megatron-Core 0.19's ``MambaLayer`` / ``MambaMixer`` and the ``TransformerLayer``
whose ``self_attention`` is a ``GatedDeltaNet``, as
:func:`~megatron_seq1f1b.runtime.hybrid_spec.local_hybrid_stack_spec` builds them; checked
against built stages in ``tests/test_planner_hybrid.py``). Mamba-2: the layer's norm, ``in_proj``
``h -> 2 d_inner + 2 groups d_state + heads`` (z, x, B, C, dt; no bias), the depthwise
convolution over ``x B C`` (weight of width 4, ``MambaMixer``'s ``d_conv``, and a bias),
``dt_bias``, ``A_log`` and ``D`` (one per head), the gated RMS norm's weight (``d_inner``) and
``out_proj`` ``d_inner -> h`` (no bias); ``d_inner`` is ``heads x head_dim``, the heads
``mamba_num_heads`` or ``2 h / head_dim``. Gated delta net: the layer's input norm, ``in_proj``
``h -> 2 qk + 2 v + 2 value_heads`` (q, k, v, the gate z, beta, alpha; no bias), the
convolution over ``q k v`` (``linear_conv_kernel_dim`` wide, no bias), ``dt_bias`` and
``A_log`` per value head, the output norm over one head (``linear_value_head_dim``, not split)
and ``out_proj`` ``v -> h``. Per TP rank every projection, the convolution and the per-head
vectors divide by TP; the layer norm and the GDN's output norm stay whole.

**Activations** depend on the kernels, so both sets are modelled (``kernels``):

* ``"cuda"`` (mamba_ssm, causal-conv1d, fla; the GPU default): what their autograd functions
  save, from their ``save_for_backward`` lists (not measured here: no CUDA kernels on the test
  machines). Mamba-2 over a whole micro-batch runs the fused ``mamba_split_conv1d_scan_combined``
  (the contiguous ``zxBCdt``, the scan's output, then Megatron's gated norm and ``out_proj``
  inputs); inside segments the two kernels that take states (the convolution's input and output
  and the scan's ``dA_cumsum``, fp32 per head and padded chunk, besides); the gated delta net
  saves the convolution's input, the L2-normalised queries and keys (and their copies per value
  head), values, gate, beta, the fp32 decays and fla's ``[tokens, heads, 64]`` triangular block
  ``A``, then the output norm's inputs and outputs.
* ``"reference"`` (:mod:`megatron_seq1f1b.runtime.recurrent_reference`, installed on CPU by
  :func:`megatron_seq1f1b.runtime.cpu.enable`): plain torch autograd, derived tensor by tensor
  from that code and checked against the rehearsal's count (``tests/test_planner_hybrid.py``; a
  layer alone matched the bytes autograd saved exactly in fp32, whole micro-batches and
  segments, padded or not, of one chunk or several). Besides the per-token tensors the chunked
  scans keep, per chunk of ``L`` tokens (128 for Mamba-2, ``MambaMixer``'s ``chunk_size``; 64
  for the delta rule) and padded up to whole chunks, several ``[L, L]`` matrices per head
  (Mamba-2: 4 in fp32; the delta rule: 7 in fp32 and one in fp64), so a short segment costs as
  much as a whole chunk: there more segments hold *more*. A unit of one chunk, or of whole
  chunks, saves a few copies fewer (its reshapes are views). Kernel internals are fp32 (the
  reference computes in fp32); the extra casts of half precision are not modelled.

What a segment carries to the next (Mamba-2: the convolution window ``[b, conv, 3]`` and the
SSM state ``[b, heads, head_dim, d_state]`` in the parameters' dtype; GDN: the window
``[b, conv, W]`` and the fp32 state ``[b, heads, d_k, d_v]``) lives from the producer's forward
to the consumer's backward. It is charged to the consumer (every segment but the first), from
its forward to its backward, where the kernels save it as their initial state (the reference's
scans also keep one more ``[L, ...]`` product for the first chunk, which then has a state with a
gradient); Mamba-2's window enters the convolution as its first ``W - 1`` tokens
(:mod:`megatron_seq1f1b.runtime.recurrent_hooks`), so every segment holds that many more of its
input and outputs. The producer's hold before the consumer's forward is not counted (a few MiB
per layer at real sizes), nor are the layer norms' statistics (as for the other kinds).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KERNELS", "MAMBA_CHUNK", "GDN_CHUNK", "MAMBA_CONV_WIDTH", "MambaSizes", "GdnSizes",
           "mamba_sizes", "gdn_sizes", "recurrent_parameters", "recurrent_token_bytes",
           "RecurrentUnits", "recurrent_unit_bytes", "chunk_recurrent_units", "RECURRENT_KINDS"]

#: Which kernels run the recurrent layers: mamba_ssm / causal-conv1d / fla on CUDA, or the
#: package's torch references (CPU).
KERNELS = ("cuda", "reference")
#: The layer kinds this module counts (:data:`~megatron_seq1f1b.schedules.partition.KINDS`).
RECURRENT_KINDS = ("mamba", "gdn")
#: ``MambaMixer``'s defaults, which Megatron's builders do not change: the scan's chunk and the
#: convolution's width.
MAMBA_CHUNK = 128
MAMBA_CONV_WIDTH = 4
#: The delta rule's chunk (fla's kernel and the reference).
GDN_CHUNK = 64
#: fla's triangular block ``A`` is ``[tokens, heads, 64]``.
FLA_BLOCK = 64

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _split(count: int, tensor_parallel_size: int, what: str) -> int:
    if count % tensor_parallel_size:
        raise ValueError(f"{what} ({count}) must divide by the tensor-parallel size "
                         f"{tensor_parallel_size}")
    return count // tensor_parallel_size


@dataclass(frozen=True)
class MambaSizes:
    """One TP rank's Mamba-2 sizes: ``heads`` (of ``head_dim``), ``groups`` of B and C,
    ``state`` (d_state), ``inner`` (heads x head_dim), ``conv`` (channels of x B C) and
    ``in_proj`` (z x B C dt)."""

    heads: int
    head_dim: int
    groups: int
    state: int
    inner: int
    conv: int
    in_proj: int
    width: int = MAMBA_CONV_WIDTH


@dataclass(frozen=True)
class GdnSizes:
    """One TP rank's gated-delta-net sizes: ``key_heads`` and ``heads`` (value heads) of
    ``key_dim`` and ``value_dim``, ``qk`` and ``v`` (their widths), ``conv`` (q k v) and the
    convolution's ``width``."""

    key_heads: int
    heads: int
    key_dim: int
    value_dim: int
    qk: int
    v: int
    conv: int
    width: int


def mamba_sizes(shape, tensor_parallel_size: int = 1) -> MambaSizes:
    """``shape``'s Mamba-2 sizes on one TP rank (ValueError where Megatron would refuse)."""
    t, h = tensor_parallel_size, shape.hidden_size
    head_dim = shape.mamba_head_dim
    heads = shape.mamba_num_heads or 2 * h // head_dim
    if not shape.mamba_num_heads and (2 * h) % head_dim:
        raise ValueError(f"Mamba-2: d_inner = 2 x hidden ({2 * h}) must divide by "
                         f"mamba_head_dim {head_dim}")
    groups = shape.mamba_num_groups
    if heads % groups:
        raise ValueError(f"Mamba-2: {heads} heads must divide by mamba_num_groups {groups}")
    heads, groups = _split(heads, t, "Mamba-2 heads"), _split(groups, t, "mamba_num_groups")
    state = shape.mamba_state_dim
    inner = heads * head_dim
    conv = inner + 2 * groups * state
    return MambaSizes(heads, head_dim, groups, state, inner, conv, inner + conv + heads)


def gdn_sizes(shape, tensor_parallel_size: int = 1) -> GdnSizes:
    """``shape``'s gated-delta-net sizes on one TP rank (ValueError where Megatron would
    refuse)."""
    t = tensor_parallel_size
    key_heads, heads = shape.linear_num_key_heads, shape.linear_num_value_heads
    if heads % key_heads:
        raise ValueError(f"gated delta net: linear_num_value_heads {heads} must be a multiple "
                         f"of linear_num_key_heads {key_heads}")
    key_heads = _split(key_heads, t, "linear_num_key_heads")
    heads = _split(heads, t, "linear_num_value_heads")
    qk, v = key_heads * shape.linear_key_head_dim, heads * shape.linear_value_head_dim
    return GdnSizes(key_heads, heads, shape.linear_key_head_dim, shape.linear_value_head_dim,
                    qk, v, 2 * qk + v, shape.linear_conv_kernel_dim)


def recurrent_parameters(shape, kind: str, tensor_parallel_size: int = 1) -> int:
    """One ``mamba`` or ``gdn`` layer's parameters on one TP rank (module docstring)."""
    h, norm = shape.hidden_size, shape._norm(shape.hidden_size)
    if kind == "mamba":
        m = mamba_sizes(shape, tensor_parallel_size)
        return (norm + h * m.in_proj + m.conv * (m.width + 1) + 3 * m.heads + m.inner
                + m.inner * h)
    if kind == "gdn":
        g = gdn_sizes(shape, tensor_parallel_size)
        return (norm + h * (2 * g.qk + 2 * g.v + 2 * g.heads) + g.conv * g.width
                + 2 * g.heads + shape._norm(g.value_dim) + g.v * h)
    raise ValueError(f"not a recurrent layer kind: {kind!r}")


def _check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"recurrent kernels must be one of {KERNELS}, got {kernels!r}")


def recurrent_token_bytes(shape, kind: str, *, dtype: str = "bf16", kernels: str = "cuda",
                          whole: bool = False, tensor_parallel_size: int = 1,
                          sequence_parallel: bool = False) -> float:
    """Bytes one token of one sample leaves for the backward in a ``mamba`` or ``gdn`` layer,
    the part that grows with the tokens (the module docstring says what; the per-chunk and
    per-segment rest is :func:`recurrent_unit_bytes`). ``whole``: a whole micro-batch (Megatron's
    own path: Mamba-2's fused kernel), else a Seq1F1B segment. Per TP rank; the ``[s, b, h]``
    inputs of the norm and of ``in_proj`` split with ``sequence_parallel`` only."""
    _check_kernels(kernels)
    e, t = DTYPE_BYTES[dtype], tensor_parallel_size
    hidden = 2 * shape.hidden_size / (t if sequence_parallel else 1)  # norm's and in_proj's input
    if kind == "mamba":
        m = mamba_sizes(shape, t)
        if kernels == "reference":
            # zxBCdt (Megatron's contiguous copy, z read from it), out_proj's input; fp32: the
            # convolution's padded input, its output before and after SiLU, dt + dt_bias and
            # softplus (clamp's input), the scan's y and SiLU(z), the gated norm's input, rstd
            # per group and its output
            return float(e * (hidden + m.in_proj + m.inner)
                         + 4 * (3 * m.conv + 2 * m.heads + 4 * m.inner + m.groups))
        # zxBCdt, the scan's output, the norm's input and out_proj's input (rstd per group);
        # segments: the convolution's input and output too (their own kernels)
        conv = 0 if whole else 2 * m.conv
        return float(e * (hidden + m.in_proj + conv + 3 * m.inner) + 4 * m.groups)
    if kind == "gdn":
        g = gdn_sizes(shape, t)
        if kernels == "reference":
            # out_proj's input; fp32: the convolution's padded input and its output, q and k
            # before the L2 norm and its rsqrt, alpha + dt_bias, softplus and beta per value
            # head, the output norm's input, statistics and output, the gate and SiLU(gate)
            stats = 2 if shape.normalization == "LayerNorm" else 1
            return float(e * (hidden + g.v)
                         + 4 * (2 * g.conv + 2 * g.qk + 2 * g.key_heads
                                + (3 + stats) * g.heads + 4 * g.v))
        # the convolution's input, the L2-normed q and k (and their copies per value head),
        # v, the gate, beta, fla's block A, the output norm's input and output and out_proj's
        # input; fp32: rstd of q and k, alpha + dt_bias, softplus, the decays, SiLU(gate),
        # the output norm's statistics
        repeated = 2 * g.heads * g.key_dim if g.heads != g.key_heads else 0
        stats = 2 if shape.normalization == "LayerNorm" else 1
        return float(e * (hidden + g.conv + 2 * g.qk + repeated + 5 * g.v
                          + g.heads * (1 + FLA_BLOCK))
                     + 4 * (2 * g.key_heads + (3 + stats) * g.heads + g.v))
    raise ValueError(f"not a recurrent layer kind: {kind!r}")


@dataclass(frozen=True)
class RecurrentUnits:
    """What a chunk's recurrent layers hold per unit (a segment of one sample) beyond their
    per-token bytes: per scan chunk size ``(L, bytes per padded token, bytes per chunk, bytes
    per chunk after the first, bytes per padded token fewer in a unit of one chunk, bytes per
    token fewer in a unit of whole chunks)``,
    ``per_unit`` bytes, and ``carried`` bytes in every segment after the first (the state it
    starts from)."""

    scans: tuple = ()
    per_unit: float = 0.0
    carried: float = 0.0

    def bytes(self, length: int, carries: bool) -> float:
        """A unit of ``length`` tokens (one sample); ``carries``: not its micro-batch's first
        segment."""
        total = self.per_unit + (self.carried if carries else 0.0)
        for size, per_token, per_chunk, later, single, exact in self.scans:
            chunks = -(-length // size)
            per_token -= (single if chunks == 1 else 0.0) + (exact if length % size == 0
                                                             else 0.0)
            total += chunks * size * per_token + chunks * per_chunk + max(chunks - 1, 0) * later
        return float(total)

    def __add__(self, other: "RecurrentUnits") -> "RecurrentUnits":
        scans: dict = {}
        for size, *terms in (*self.scans, *other.scans):
            held = scans.get(size, (0.0,) * 5)
            scans[size] = tuple(a + b for a, b in zip(held, terms))
        return RecurrentUnits(tuple((size, *terms) for size, terms in sorted(scans.items())),
                              self.per_unit + other.per_unit, self.carried + other.carried)

    def scaled(self, factor: float) -> "RecurrentUnits":
        return RecurrentUnits(tuple((size, *(x * factor for x in terms))
                                    for size, *terms in self.scans),
                              self.per_unit * factor, self.carried * factor)

    def __bool__(self) -> bool:
        return bool(self.scans) or bool(self.per_unit) or bool(self.carried)


def recurrent_unit_bytes(shape, kind: str, *, dtype: str = "bf16", kernels: str = "cuda",
                         whole: bool = False, tensor_parallel_size: int = 1) -> RecurrentUnits:
    """A ``mamba`` or ``gdn`` layer's bytes per unit beyond :func:`recurrent_token_bytes`: the
    scan's per-chunk tensors (padded to whole chunks), constants, and the carried state (module
    docstring)."""
    _check_kernels(kernels)
    e, t = DTYPE_BYTES[dtype], tensor_parallel_size
    if kind == "mamba":
        m = mamba_sizes(shape, t)
        H, P, N, L = m.heads, m.head_dim, m.state, MAMBA_CHUNK
        state = H * P * N
        # segments: the carried window enters the convolution as its first W - 1 tokens
        window = 0 if whole else m.width - 1
        if kernels == "reference":
            # per padded token: the decays, C.B, C.B x decay, the scores (4 [L, L] per head),
            # dt padded, the decay to the chunk's end (and its copy), the decay from its
            # start; copies of C and B per head (twice B, C padded), of x (three); per chunk
            # the state entering it and, once it has a gradient, C x decay. A unit of one
            # chunk reads x, B and C as views: one copy of each; without padding x is one.
            padded = 4 * (4 * L * H + 4 * H + 3 * H * P + 4 * H * N)
            copy = 4 * L * H * N
            single = 4 * (2 * H * N + H * P)
            return RecurrentUnits(((L, padded, 4 * state, copy, single, 4 * H * P),),
                                  per_unit=L * L + 4 * (m.width - 1 + 3 * window) * m.conv
                                  + 8 * H, carried=copy)
        if whole:
            return RecurrentUnits()
        # dA_cumsum (fp32 per head, padded chunks); the convolution's window tokens; the
        # initial SSM state
        return RecurrentUnits(((L, 4 * H, 0.0, 0.0, 0.0, 0.0),), per_unit=2 * e * window * m.conv,
                              carried=e * state)
    if kind == "gdn":
        g = gdn_sizes(shape, t)
        H, K, V, L = g.heads, g.key_dim, g.value_dim, GDN_CHUNK
        if kernels == "reference":
            # per padded token: 7 fp32 and 1 fp64 [L, L] per head (decay ratios, their masked
            # and fp32 copies, k.k, M, I + M, q.k and q.k x ratio); q, k (four copies), v, the
            # two solves' outputs, U, the decays (fp64 and fp32) and beta products; per chunk
            # the state entering it and its total decay (fp64); once the state has a gradient,
            # q x decay and the decay's fp32 copy. A unit of one chunk reads q and k as views
            # (one copy of q, one of k); without padding beta is no copy either.
            padded = 4 * (9 * L * H + 8 * H * K + 3 * H * V + 11 * H)
            later = 4 * L * H * K + 4 * H
            single = 4 * 4 * H * K
            return RecurrentUnits(((L, padded, 4 * H * K * V + 8 * H, later, single, 4 * H),),
                                  per_unit=2 * L * L + 4 * (g.width - 1) * g.conv + 8 * H,
                                  carried=later)
        # the fp32 initial state and the window the kernels save
        return RecurrentUnits(carried=4 * H * K * V + e * g.width * g.conv)
    raise ValueError(f"not a recurrent layer kind: {kind!r}")


def chunk_recurrent_units(shape, layers, *, mtp: bool = False, dtype: str = "bf16",
                          kernels: str = "cuda", whole: bool = False,
                          tensor_parallel_size: int = 1) -> RecurrentUnits:
    """:func:`recurrent_unit_bytes` summed over a chunk's ``layers`` (layer-kind tuples) and,
    with ``mtp``, the MTP depths' layers."""
    total = RecurrentUnits()
    kinds = [kind for layer in layers for kind in layer]
    if mtp:
        kinds += [kind for depth in shape.mtp_layers() for layer in depth for kind in layer]
    for kind in kinds:
        if kind in RECURRENT_KINDS:
            total = total + recurrent_unit_bytes(
                shape, kind, dtype=dtype, kernels=kernels, whole=whole,
                tensor_parallel_size=tensor_parallel_size)
    return total

