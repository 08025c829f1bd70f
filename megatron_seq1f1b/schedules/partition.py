"""Cutting a sequence into segments: equal tokens, or equal compute.

With causal attention a token at position t attends to t+1 keys, so a segment
late in the sequence costs more than an early one of the same length. The
"balanced" split gives every segment the same estimated forward FLOPs, which
keeps the pipeline even; earlier segments come out longer.

Cost model (forward FLOPs of a segment of ``s`` tokens ending at position
``P``, i.e. covering positions ``P-s .. P-1``)::

    cost(s, P) = a * s + c * (s * P - s**2 / 2 + s / 2)

* ``a`` (per token): for every layer the QKV projection
  ``2 h (h_q + 2 h_kv)``, the output projection ``2 h_q h``, the MLP
  ``2 h f (1 + g) + 2 f h`` (``g`` = 1 with a gated linear unit), plus the
  output layer ``2 h V`` once per token;
* ``c`` (per query-key pair): ``4 h_q`` per layer for ``Q K^T`` and ``A V``;
  the causal segment has ``sum_{t=P-s}^{P-1} (t + 1) = s P - s^2/2 + s/2``
  such pairs;

with ``h`` hidden size, ``h_q = heads * kv_channels``,
``h_kv = query_groups * kv_channels``, ``f`` FFN size, ``V`` vocabulary.
Mixture-of-experts layers count the router and the experts a token visits
(``topk`` plus a shared expert; :func:`_mlp_weights`).
Multi-latent attention replaces the QKV/output terms by its down- and
up-projections and the pair term by ``2 heads (q_dim + v_dim)``
(:func:`_attention_shape`).
Backward costs about twice the forward for every term, so equal forward
FLOPs also mean equal backward FLOPs.

``dense_attention=True`` models kernels that compute the whole
``s x P`` score block and mask it afterwards (Megatron's local
``DotProductAttention``): the quadratic term becomes ``s * P``. Flash-style
kernels (Transformer Engine) skip masked blocks: causal pairs.

Sliding windows (``window_size=(w, 0)``, on the layers Megatron picks with
``window_attn_skip_freq``): a query at position ``t`` sees ``min(t, w) + 1``
keys, so those layers' attention cost grows with the position only up to
``w`` (``per_window_pair`` counts their pairs; dense kernels compute
``s * min(P, s + w)``). With ``w`` much shorter than the sequence the
balanced split comes out nearly uniform.

The ``"measured"`` split balances a *measured* cost instead of FLOPs: any
``cost(length, end)`` that grows with the length, usually fitted time per
segment (:class:`megatron_seq1f1b.planner.Calibration`). Kernels are not
equally efficient on linear layers and attention, so equal FLOPs are not
equal time. Both balanced splits share one solver (:func:`_equal_cost_ends`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

METHODS = ("uniform", "balanced", "measured", "documents")
#: The partitions a run can name alone (``--seq1f1b-partition``): "measured" needs calibrated
#: costs, so its cut is passed as lengths (``split_lengths``, ``--seq1f1b-split-lengths``).
NAMED_PARTITIONS = tuple(m for m in METHODS if m != "measured")

SegmentCost = Callable[[float, float], float]  # cost(length, end), growing with length


@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs of a segment: ``per_token * s + per_pair * causal_pairs(s, end)``.

    (Plus ``per_window_pair`` times the pairs of windowed layers, if any.)
    """

    per_token: float
    per_pair: float
    dense_attention: bool = False
    window: int | None = None
    per_window_pair: float = 0.0

    @classmethod
    def from_config(cls, config, vocab_size: int | None = None,
                    dense_attention: bool = False, pattern: str | None = None) -> "CostModel":
        """Coefficients from a Megatron ``TransformerConfig`` (whole model).

        ``pattern``: a HybridModel's ``hybrid_layer_pattern`` (every stage's, ``|`` and
        ``/`` included): each layer costs what its symbol holds (:func:`layer_kinds`), an
        MLP or MoE layer has no pair term. Multi-token prediction (``mtp_num_layers``) adds
        per depth its layers, the projection of embedding and hidden state, and one more
        output layer."""
        h = config.hidden_size
        attention_weights, pair_flops = _attention_shape(config)
        main, depths = layer_kinds(config, pattern)
        per_token, attention_layers = 0, []
        for number, layer in enumerate(main, start=1):
            per_token += sum(_layer_weights(config, kind, attention_weights) for kind in layer)
            if "attention" in layer:
                attention_layers.append(number)
        mtp_pairs = 0
        for depth in depths:
            per_token += 2 * h * h + h * (vocab_size or 0)  # eh_proj, the depth's logits
            for layer in depth:
                per_token += sum(_layer_weights(config, kind, attention_weights)
                                 for kind in layer)
                mtp_pairs += "attention" in layer
        per_token = 2 * per_token + 2 * h * (vocab_size or 0)
        windowed = windowed_layers(config, attention_layers)
        window = config.window_size[0] if windowed else None
        full = len(attention_layers) - windowed + mtp_pairs
        return cls(float(per_token), float(full * pair_flops), dense_attention, window,
                   float(windowed * pair_flops))

    def pairs(self, length: float, end: float) -> float:
        """Query-key products a segment's attention computes."""
        return length * end if self.dense_attention else causal_pairs(length, end)

    def window_pairs(self, length: float, end: float) -> float:
        """Query-key products of a windowed layer's attention over this segment."""
        if self.window is None:
            return self.pairs(length, end)
        if self.dense_attention:
            return length * min(end, length + self.window)
        # Positions below w see t + 1 keys (causal), the rest w + 1.
        start, knee = end - length, min(max(end - length, self.window), end)
        return causal_pairs(knee - start, knee) + (end - knee) * (self.window + 1)

    def attention(self, length: float, end: float) -> float:
        """Attention FLOPs of the segment (all layers)."""
        total = self.per_pair * self.pairs(length, end)
        if self.per_window_pair:
            total += self.per_window_pair * self.window_pairs(length, end)
        return total

    def segment(self, length: float, end: float) -> float:
        """Forward FLOPs of ``length`` tokens ending at position ``end``."""
        return self.per_token * length + self.attention(length, end)

    def backward_parts(self, length: float, end: float) -> tuple[float, float]:
        """(input-gradient, weight-gradient) FLOPs of the segment's backward.

        Weight gradients are the linear layers' GEMMs (as many FLOPs as their
        forward); input gradients repeat those GEMMs and attention twice
        (scores and values, each differentiated both ways).
        """
        linear = self.per_token * length
        return linear + 2 * self.attention(length, end), linear

    def length_for(self, share: float, end: float) -> float:
        """Length of the segment ending at ``end`` that costs ``share`` (closed form)."""
        a, c = self.per_token, self.per_pair
        if self.per_window_pair:
            return _length_by_bisection(self.segment)(share, end)
        if self.dense_attention or c == 0:
            per_token_here = a + c * end  # a s + c s end = share
            return share / per_token_here if per_token_here > 0 else end
        # a s + c (s end - s^2/2 + s/2) = share -> (c/2) s^2 - (a + c end + c/2) s + share = 0
        b = a + c * end + c / 2
        return (b - math.sqrt(max(b * b - 2 * c * share, 0.0))) / c

    def split_costs(self, lengths: list[int]) -> list[float]:
        costs, end = [], 0
        for length in lengths:
            end += length
            costs.append(self.segment(length, end))
        return costs


def _attention_shape(config) -> tuple[int, int]:
    """(weights of one attention layer's projections, its FLOPs per query-key pair).

    Standard: QKV and output projections; ``Q K^T`` and ``A V`` over ``h_q``.
    Multi-latent attention: query (down + up, or one projection), K/V down to
    the latent (plus the shared RoPE key), up to the heads, output; scores
    over ``qk_head_dim + qk_pos_emb_head_dim``, values over ``v_head_dim``.
    """
    h, heads = config.hidden_size, config.num_attention_heads
    if getattr(config, "multi_latent_attention", False):
        q_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        v_dim = config.v_head_dim
        rank = getattr(config, "q_lora_rank", None)
        query = h * heads * q_dim if rank is None else h * rank + rank * heads * q_dim
        latent = config.kv_lora_rank
        kv = h * (latent + config.qk_pos_emb_head_dim) + latent * heads * (config.qk_head_dim + v_dim)
        return query + kv + heads * v_dim * h, 2 * heads * (q_dim + v_dim)
    kv_channels = config.kv_channels or h // heads
    groups = config.num_query_groups or heads
    h_q, h_kv = heads * kv_channels, groups * kv_channels
    return h * (h_q + 2 * h_kv) + h_q * h, 4 * h_q


def _moe_layers(config) -> list[bool]:
    """Per layer: mixture of experts? (Megatron's ``moe_layer_freq`` rule.)"""
    layers = config.num_layers
    if not getattr(config, "num_moe_experts", None):
        return [False] * layers
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(layers)]
    return [bool(x) for x in freq]


def _mlp_weights(config, moe: bool) -> int:
    """Weights one token goes through in a layer's MLP.

    Dense: ``h f (1 + g) + f h``. Mixture of experts: the router ``h E``, the
    ``topk`` experts it picks (``moe_ffn_hidden_size`` wide) and the shared
    expert, if any: what a token costs, not what the layer holds.
    """
    h = config.hidden_size
    gated = 2 if config.gated_linear_unit else 1

    def mlp(width: int) -> int:
        return h * width * gated + width * h

    if not moe:
        return mlp(config.ffn_hidden_size or 4 * h)
    width = getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size or 4 * h
    shared = getattr(config, "moe_shared_expert_intermediate_size", None) or 0
    return (h * config.num_moe_experts + config.moe_router_topk * mlp(width)
            + (mlp(shared) if shared else 0))


#: A HybridModel pattern's symbols by what their layer computes per token (Megatron-Core
#: ``hybrid_layer_allocation.Symbols``): attention (MLA ``+``, sparse ``D`` alike), a dense
#: MLP, a mixture of experts, Mamba-2 and a gated delta net (recurrent: linear in the
#: sequence, no pair term).
KINDS = {"*": "attention", "+": "attention", "D": "attention", "-": "mlp", "E": "moe",
         "M": "mamba", "G": "gdn"}


def _mamba_weights(config) -> int:
    """What one token costs in Megatron's ``MambaMixer``, as weights: its projections and
    convolution, and the scan's state update and read-out (``d_inner x d_state`` each)."""
    h, headdim = config.hidden_size, getattr(config, "mamba_head_dim", 64)
    heads = getattr(config, "mamba_num_heads", None) or 2 * h // headdim
    inner = heads * headdim
    groups, state = getattr(config, "mamba_num_groups", 8), getattr(config, "mamba_state_dim", 128)
    conv = inner + 2 * groups * state
    return h * (2 * inner + 2 * groups * state + heads) + inner * h + conv * 4 + 2 * inner * state


def _gdn_weights(config) -> int:
    """What one token costs in Megatron's ``GatedDeltaNet``, as weights: its projections and
    convolution, and the delta rule's state update and read-out (``d_k x d_v`` per head)."""
    h = config.hidden_size
    key_dim = getattr(config, "linear_key_head_dim", 128)  # Megatron-Core's defaults
    qk = getattr(config, "linear_num_key_heads", 16) * key_dim
    heads = getattr(config, "linear_num_value_heads", 32)
    value_dim = getattr(config, "linear_value_head_dim", 128)
    v = heads * value_dim
    conv = (2 * qk + v) * (getattr(config, "linear_conv_kernel_dim", 4) or 4)
    return h * (2 * qk + 2 * v + 2 * heads) + v * h + conv + 3 * heads * key_dim * value_dim


Layer = tuple  # what one layer computes per token: ("attention", "mlp"), ("moe",), ...


def layer_kinds(config, pattern: str | None = None) -> tuple[list[Layer], list[list[Layer]]]:
    """(the decoder's layers, each MTP depth's), each layer the kinds it computes: from a
    hybrid ``pattern`` one kind per symbol, else a GPTModel's (attention and an MLP, or MoE
    by ``moe_layer_freq``; each of ``mtp_num_layers`` depths one layer like the last)."""
    if pattern is None:
        main = [("attention", "moe" if moe else "mlp") for moe in _moe_layers(config)]
        return main, [main[-1:]] * (getattr(config, "mtp_num_layers", None) or 0)
    main, *depths = pattern.split("/")
    unknown = sorted(set(pattern.replace("|", "").replace("/", "")) - set(KINDS))
    if unknown:
        raise ValueError(f"hybrid pattern {pattern!r}: no cost model for {' '.join(unknown)} "
                         "(attention *, +, D; MLP -; MoE E; Mamba-2 M; gated delta net G)")
    if not getattr(config, "mtp_num_layers", None):
        depths = []  # the '/' depths are built only with mtp_num_layers (Megatron-LM sets it)
    return ([(KINDS[c],) for c in main.replace("|", "")],
            [[(KINDS[c],) for c in depth] for depth in depths])


def _layer_weights(config, kind: str, attention_weights: int) -> int:
    """Weights one token goes through in a layer of this kind."""
    if kind == "attention":
        return attention_weights
    if kind == "mamba":
        return _mamba_weights(config)
    if kind == "gdn":
        return _gdn_weights(config)
    return _mlp_weights(config, kind == "moe")


def windowed_layers(config, attention_layers: Sequence[int] | None = None) -> int:
    """How many attention layers use a sliding window (Megatron's
    ``is_layer_window_attention`` rule); ``attention_layers``: their layer numbers (every
    layer of a GPTModel by default)."""
    window = getattr(config, "window_size", None)
    if not window or window[0] is None or window[0] < 0:
        return 0
    skip = getattr(config, "window_attn_skip_freq", None)
    layers = range(1, config.num_layers + 1) if attention_layers is None else attention_layers
    if skip is None:
        return len(layers)
    if isinstance(skip, int):
        return sum(1 for n in layers if n % skip != 0)
    return sum(1 for n in layers if skip[n - 1])


def causal_pairs(length: float, end: float) -> float:
    """Query-key pairs of a causal segment of ``length`` queries ending at ``end``."""
    return length * end - length * length / 2 + length / 2


def split_sequence(
    seq_length: int,
    num_splits: int,
    method: str = "uniform",
    *,
    config=None,
    vocab_size: int | None = None,
    multiple_of: int = 1,
    dense_attention: bool = False,
    cost: CostModel | SegmentCost | None = None,
    documents=None,
    pattern: str | None = None,
) -> list[int]:
    """Segment lengths for one micro-batch: sum ``seq_length``, each a multiple of ``multiple_of``.

    ``"uniform"`` lengths differ by at most ``multiple_of`` (longer ones
    first); ``"balanced"`` lengths give equal estimated forward FLOPs
    (:class:`CostModel` from ``config`` and ``vocab_size``; ``dense_attention``
    for kernels that compute masked scores too; or ``cost``, a
    :class:`CostModel`, without a config; ``pattern``: a HybridModel's layer pattern) and never
    increase. ``"measured"``
    lengths give equal calibrated cost: ``cost`` is a :class:`CostModel`, an
    object with a ``cost_model()`` method (a fitted calibration), or any
    ``cost(length, end)`` that grows with the length (solved numerically).
    ``"documents"`` cuts one micro-batch's packed ``documents``
    (:class:`~megatron_seq1f1b.segments.documents.Documents`) into segments of equal cost
    counting each document's own causal attention, at document ends where that
    keeps the costs close (:func:`split_documents`); lengths in sequence order.
    """
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive integer, got {num_splits!r}")
    if not seq_length >= 1:
        raise ValueError(f"seq_length must be at least 1 token, got {seq_length!r}")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; choose one of {METHODS}")
    if seq_length % multiple_of:
        raise ValueError(
            f"seq_length {seq_length} is not a multiple of {multiple_of}, which every "
            "segment length must be (the tensor-parallel size with sequence parallelism, "
            "times 8 with FP8, and 2 x context_parallel_size chunks with context parallelism)"
        )
    units = seq_length // multiple_of
    if units < num_splits:
        raise ValueError(
            f"cannot cut {seq_length} tokens into {num_splits} segments of at least "
            f"{multiple_of} tokens each; use at most {units} splits"
        )
    if method == "uniform":
        base, extra = divmod(units, num_splits)
        return [(base + (i < extra)) * multiple_of for i in range(num_splits)]
    if method == "documents":
        if documents is None:
            raise ValueError("the documents partition needs the micro-batch's documents "
                             "(documents=...)")
        if config is not None:
            cost = CostModel.from_config(config, vocab_size, dense_attention, pattern)
        if not isinstance(cost, CostModel):
            raise ValueError("the documents partition needs the model's TransformerConfig "
                             "(config=...) or a CostModel (cost=...)")
        return split_documents(documents, num_splits, cost, multiple_of=multiple_of)
    if method == "measured":
        if cost is None:
            raise ValueError("partition 'measured' needs calibrated costs (cost=...)")
        if hasattr(cost, "cost_model"):
            cost = cost.cost_model()
    elif config is not None:
        cost = CostModel.from_config(config, vocab_size, dense_attention, pattern)
    elif not isinstance(cost, CostModel):
        raise ValueError(
            "the balanced partition needs the model's TransformerConfig (config=...) to "
            "estimate attention and linear FLOPs"
        )
    boundaries = _equal_cost_ends(seq_length, num_splits, cost)
    return _round_boundaries(boundaries, units, multiple_of)


def _equal_cost_ends(seq_length: int, num_splits: int,
                     cost: CostModel | SegmentCost) -> list[float]:
    """Continuous segment end positions with equal cost (both balanced splits).

    For a guess of the per-segment cost, segments are solved from the back
    (:meth:`CostModel.length_for`, or bisection on the length for a plain
    callable); bisection adjusts the guess until the first segment costs the
    same as the others. (With causal attention the FLOP costs add up to the
    whole sequence's, so the first guess, total / k, is already right.)
    """
    if isinstance(cost, CostModel):
        segment, length_for = cost.segment, cost.length_for
        grows = cost.per_token > 0 or cost.per_pair > 0 or cost.per_window_pair > 0
    else:
        segment, length_for = cost, _length_by_bisection(cost)
        grows = segment(seq_length, seq_length) > segment(0.0, seq_length)
    if not grows:
        raise ValueError("the partition's cost does not grow with the segment length; "
                         "nothing to balance (use the uniform partition)")

    def ends_for(share: float) -> list[float]:
        ends, end = [float(seq_length)], float(seq_length)
        for _ in range(num_splits - 1):
            end = max(end - length_for(share, end), 0.0)
            ends.append(end)
        return ends

    low, high = 0.0, segment(seq_length, seq_length)
    share = high / num_splits
    for _ in range(200):
        first = ends_for(share)[-1]
        gap = segment(first, first) - share
        if abs(gap) <= 1e-12 * high or high - low <= 1e-13 * high:
            break
        low, high = (share, high) if gap > 0 else (low, share)
        share = (low + high) / 2
    ends = ends_for(share)
    return sorted(ends[1:]) + [float(seq_length)]


def _length_by_bisection(cost: SegmentCost) -> Callable[[float, float], float]:
    """length_for(share, end) of a callable cost that grows with the length."""

    def length_for(share: float, end: float) -> float:
        if cost(end, end) <= share:
            return end
        low, high = 0.0, end
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if cost(mid, end) < share else (low, mid)
        return (low + high) / 2

    return length_for


def _round_boundaries(ends: list[float], units: int, multiple_of: int) -> list[int]:
    """Round ends to whole units, keep every segment >= 1 unit, longest first."""
    k = len(ends)
    rounded = []
    previous = 0
    for i, end in enumerate(ends[:-1]):
        unit_end = round(end / multiple_of)
        low, high = previous + 1, units - (k - 1 - i)
        unit_end = min(max(unit_end, low), high)
        rounded.append(unit_end)
        previous = unit_end
    rounded.append(units)
    lengths = [b - a for a, b in zip([0] + rounded[:-1], rounded)]
    return [n * multiple_of for n in sorted(lengths, reverse=True)]


# A cut moves to a document end when that changes the cost before it by at most this share of
# one segment's cost; the predicted spread (max / min segment cost) must stay within MAX_SPREAD.
DOCUMENT_END_TOLERANCE = 0.05
MAX_SPREAD = 1.10


class DocumentCosts:
    """Cumulative cost ``C(x)`` of tokens ``[0, x)`` of a packed micro-batch (all samples).

    A token costs ``per_token`` plus its attention pairs within its own
    document: ``t - d + 1`` keys for a token at ``t`` of a document starting at
    ``d`` (``min(t - d, w) + 1`` on windowed layers). Costs add up over tokens,
    so a segment ``[a, b)`` costs ``C(b) - C(a)``; ``C`` is evaluated per
    document in closed form (no loop over tokens).
    """

    def __init__(self, documents, cost: CostModel):
        import bisect

        self._bisect = bisect
        self.cost, self.documents = cost, documents
        self.seq_length = documents.seq_length
        self._prefix = []  # per sample: pairs of the documents before each document start
        for sample in range(documents.micro_batch_size):
            bounds = documents.bounds(sample)
            total, sums = 0.0, []
            for start, end in zip(bounds, bounds[1:]):
                sums.append(total)
                total += self._pairs(end - start)
            self._prefix.append(sums)

    def _pairs(self, n: float) -> float:
        """Attention cost of the first ``n`` tokens of a document."""
        cost = self.cost
        total = cost.per_pair * n * (n + 1) / 2
        if cost.per_window_pair:
            w = cost.window if cost.window is not None else n
            full = min(n, w + 1)
            total += cost.per_window_pair * (full * (full + 1) / 2 + (n - full) * (w + 1))
        return total

    def __call__(self, x: int) -> float:
        total = self.cost.per_token * x * self.documents.micro_batch_size
        for sample, sums in enumerate(self._prefix):
            starts = self.documents.starts[sample]
            index = self._bisect.bisect_right(starts, x - 1) - 1 if x > 0 else 0
            if x > 0:
                total += sums[index] + self._pairs(x - starts[index])
        return total

    def position_of(self, target: float) -> int:
        """The smallest ``x`` with ``C(x) >= target``."""
        low, high = 0, self.seq_length
        while low < high:
            mid = (low + high) // 2
            if self(mid) < target:
                low = mid + 1
            else:
                high = mid
        return low


def document_segment_cost(documents, cost: CostModel) -> Callable[[int, int], float]:
    """``cost(a, b)``: forward FLOPs of tokens ``[a, b)`` of a packed micro-batch, as the
    attention backend computes them.

    Flash-style kernels compute each document's own causal pairs
    (:class:`DocumentCosts`); Megatron's local attention (``dense_attention``)
    computes every query against all keys the segment holds, from the start of
    the document crossing into it (``[b - a] x [b - doc(a)]`` per sample).
    """
    costs = DocumentCosts(documents, cost)
    if not cost.dense_attention:
        return lambda a, b: costs(b) - costs(a)
    samples = range(documents.micro_batch_size)

    def dense(a: int, b: int) -> float:
        if b <= a:
            return 0.0
        keys = sum(b - documents.document_start(s, a) for s in samples)
        pairs = (b - a) * keys
        total = cost.per_token * (b - a) * documents.micro_batch_size + cost.per_pair * pairs
        if cost.per_window_pair:
            window = cost.window if cost.window is not None else b
            total += cost.per_window_pair * (b - a) * min(keys, (b - a + window) * len(samples))
        return total

    return dense


def cut_spread(cuts: Sequence[int], segment_cost: Callable[[int, int], float],
               seq_length: int) -> float:
    """max / min of ``segment_cost`` over the segments that ``cuts`` make of ``seq_length``."""
    bounds = [0] + list(cuts) + [seq_length]
    values = [segment_cost(a, b) for a, b in zip(bounds, bounds[1:])]
    return max(values) / max(min(values), 1e-30)


def _balance_neighbours(cuts: list[int], segment_cost: Callable[[int, int], float],
                        seq_length: int, multiple_of: int) -> list[int]:
    """Cuts moved until each pair of neighbouring segments costs about the same.

    Local attention's dense cost (``[b - a] x [b - doc(a)]``) jumps where a segment's first
    document changes, which the continuous equal-cost solve can miss by more than the
    spread allows. ``cost(a, x)`` grows and ``cost(x, c)`` shrinks with ``x``, so each cut's
    best place between its neighbours is found by bisection; a move must lower the larger
    of the two costs (so passes end), and the result is kept only if the spread falls.
    """
    moved = list(cuts)
    for _ in range(2 * len(moved) + 2):
        changed = False
        for j, current in enumerate(moved):
            a = moved[j - 1] if j else 0
            c = moved[j + 1] if j + 1 < len(moved) else seq_length
            low, high = a // multiple_of + 1, c // multiple_of - 1  # in units of multiple_of
            if low > high:
                continue
            while low < high:
                mid = (low + high) // 2
                x = mid * multiple_of
                low, high = (mid + 1, high) if segment_cost(a, x) < segment_cost(x, c) else \
                    (low, mid)
            options = {low * multiple_of, max(low - 1, a // multiple_of + 1) * multiple_of}
            pair = lambda x: max(segment_cost(a, x), segment_cost(x, c))  # noqa: E731
            best = min(sorted(options), key=pair)
            if pair(best) < pair(current):
                moved[j], changed = best, True
        if not changed:
            break
    if cut_spread(moved, segment_cost, seq_length) < cut_spread(cuts, segment_cost, seq_length):
        return moved
    return list(cuts)


def split_documents(documents, num_splits: int, cost: CostModel, *, multiple_of: int = 1,
                    tolerance: float = DOCUMENT_END_TOLERANCE,
                    max_spread: float = MAX_SPREAD) -> list[int]:
    """Segment lengths of one packed micro-batch: equal cost, cut at document ends where close.

    Costs are :func:`document_segment_cost`'s: each document's own attention,
    not the whole sequence's causal triangle ``balanced`` assumes. Cuts start at
    equal-cost positions (rounded to ``multiple_of``); each then moves to the
    nearest document end (common to all samples, a multiple of ``multiple_of``)
    that changes the segment before it by at most ``tolerance`` of a segment's
    cost, so a document is split only where no end is close (a segment then
    starts with a new document and needs no earlier keys). If moved cuts would
    leave a spread (max / min segment cost) above ``max_spread`` (or above the
    equal-cost positions' own), the tolerance halves until they do not (at
    last 0: the equal-cost positions). Lengths come in sequence order. A micro-batch of one
    document per sample gets exactly ``balanced``'s lengths.
    """
    import bisect

    seq_length = documents.seq_length
    units = seq_length // multiple_of
    if seq_length % multiple_of or units < num_splits:
        raise ValueError(f"cannot cut {seq_length} tokens into {num_splits} segments of "
                         f"multiples of {multiple_of}")
    if all(starts == (0,) for starts in documents.starts):  # unpacked: balanced's own cuts
        return _round_boundaries(_equal_cost_ends(seq_length, num_splits, cost), units,
                                 multiple_of)
    segment_cost = document_segment_cost(documents, cost)
    if cost.dense_attention:
        ends = _equal_cost_ends(seq_length, num_splits,
                                lambda length, end: segment_cost(round(end - length), round(end)))
        raw = ends[:-1]
    else:
        costs = DocumentCosts(documents, cost)
        step = costs(seq_length) / num_splits
        raw = [costs.position_of(step * j) for j in range(1, num_splits)]
    positions, previous = [], 0
    for j, x in enumerate(raw):
        below = max((int(x) // multiple_of) * multiple_of, previous + multiple_of)
        above = max(-(-int(x) // multiple_of) * multiple_of, previous + multiple_of)
        limit = seq_length - (num_splits - 1 - j) * multiple_of
        below, above = min(below, limit), min(above, limit)
        pick = below if abs(below - x) <= abs(above - x) else above
        positions.append(pick)
        previous = pick
    if cost.dense_attention:
        positions = _balance_neighbours(positions, segment_cost, seq_length, multiple_of)
    share = segment_cost(0, seq_length) / num_splits
    doc_ends = [e for e in documents.ends() if e % multiple_of == 0 and 0 < e < seq_length]

    def cuts_for(tol: float) -> list[int]:
        cuts, previous = [], 0
        for j, position in enumerate(positions):
            limit = seq_length - (num_splits - 1 - j) * multiple_of
            best, best_gap = position, None
            if tol > 0:
                target = segment_cost(previous, position)
                i = bisect.bisect_left(doc_ends, position)
                for end in doc_ends[max(0, i - 2): i + 2]:
                    if not previous < end <= limit:
                        continue
                    gap = abs(segment_cost(previous, end) - target)
                    if gap <= tol * share and (best_gap is None or gap < best_gap):
                        best, best_gap = end, gap
            best = min(max(best, previous + multiple_of), limit)
            cuts.append(best)
            previous = best
        return cuts

    def spread(cuts: list[int]) -> float:
        return cut_spread(cuts, segment_cost, seq_length)

    tol, allowed = tolerance, max(max_spread, spread(positions))
    cuts = cuts_for(tol)
    while tol > 0 and spread(cuts) > allowed:
        tol = tol / 2 if tol > tolerance / 16 else 0.0
        cuts = cuts_for(tol)
    bounds = [0] + cuts + [seq_length]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def split_documents_by_budget(documents, budget: int, cost: CostModel, *,
                              multiple_of: int = 1, max_splits: int | None = None) -> list[int]:
    """Segment lengths of one packed micro-batch whose runs of documents go backward apart
    (:mod:`megatron_seq1f1b.segments.document_runs`): every cut that can fall where a document
    ends does. Whole documents are packed into segments of at most ``budget`` tokens; a
    document longer than the budget gets ``ceil(length / budget)`` segments of its own, cut
    by cost as a micro-batch of one document. Only ends common to every sample and multiples
    of ``multiple_of`` count as ends. More segments than ``ceil(S / budget)`` may come out: the
    price of cuts a run can end at; more than ``max_splits`` do not (the micro-batch is then
    cut as :func:`split_documents` cuts it into ``min(max_splits, ceil(S / budget))``)."""
    lengths: list[int] = []
    start = closed = 0  # the open segment holds [start, closed)
    seq_length = documents.seq_length
    ends = [e for e in documents.ends() if e % multiple_of == 0 and e < seq_length]
    for end in ends + [seq_length]:
        if end - start > budget and closed > start:  # the open segment ends at the last end
            lengths.append(closed - start)
            start = closed
        if end - start <= budget:
            closed = end
            continue
        length = end - start
        count = max(1, min(math.ceil(length / budget), length // multiple_of))
        # as split_documents cuts a micro-batch of one document: balanced by cost
        lengths += _round_boundaries(_equal_cost_ends(length, count, cost),
                                     length // multiple_of, multiple_of)
        start = closed = end
    if closed > start:
        lengths.append(closed - start)
    if max_splits is not None and len(lengths) > max_splits:
        count = max(1, min(max_splits, math.ceil(seq_length / budget), seq_length // multiple_of))
        return split_documents(documents, count, cost, multiple_of=multiple_of)
    return lengths
