"""What a pipeline stage holds besides its activations: weights, gradients, optimizer states.

The planner predicts memory per pipeline stage as the sum of

* **weights** of the stage's parameters (the embedding on the first virtual stage, the
  final norm and output layer on the last; with tied embeddings and more than one
  virtual stage the last one holds its own copy of the word embeddings, as Megatron does),
* **main gradients**: Megatron DDP's contiguous gradient buffer, fp32 when gradients are
  reduced in fp32 (``grad_reduce_in_fp32``, Megatron-LM's default for bf16), else the
  parameter dtype; every data-parallel rank holds all of it, with or without the
  distributed optimizer (which reduce-scatters into the same full buffer),
* **optimizer states** (Adam): two fp32 moments per parameter, plus an fp32 master copy
  of the weights where they are trained in half precision; the distributed optimizer
  shards exactly these (master weights and moments) over the data-parallel ranks,
* **activations**: the planner's replay of the stage's units times the bytes one token
  leaves for the backward (:func:`activation_bytes_per_token`, or a measured value).

Parameter counts are those of Megatron-Core's ``GPTModel`` with the local layer spec
(checked against built models in ``tests/test_rehearse.py``). Pure: no torch, no Megatron.

With tensor parallelism (``tensor_parallel_size``) everything is per TP rank: the column- and
row-parallel linear layers, the vocabulary-parallel embedding and output layer and the
activations of split heads and MLP columns divide by TP; norms and row-parallel biases stay
whole, and so do the ``[s, b, h]`` activations of the norms and the linear layers' inputs
unless ``sequence_parallel`` splits them along the sequence (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", as Megatron-Core implements it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a GPT that decide its parameters and activations."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    ffn_hidden_size: int | None = None  # default 4 * hidden
    num_query_groups: int | None = None  # default: one per head (no GQA)
    kv_channels: int | None = None  # default hidden / heads
    gated_linear_unit: bool = False  # SwiGLU: fc1 is twice as wide
    normalization: str = "LayerNorm"  # or "RMSNorm" (no bias)
    add_bias_linear: bool = True
    qk_layernorm: bool = False
    tied_embeddings: bool = False
    position_embedding_type: str = "rope"  # or "learned_absolute"
    max_sequence_length: int = 0  # learned positions only

    @classmethod
    def from_config(cls, config, vocab_size: int, *, tied_embeddings: bool = False,
                    position_embedding_type: str = "rope",
                    max_sequence_length: int = 0) -> "ModelShape":
        """From a TransformerConfig (or anything with its field names)."""
        return cls(
            num_layers=config.num_layers, hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads, vocab_size=vocab_size,
            ffn_hidden_size=getattr(config, "ffn_hidden_size", None),
            num_query_groups=getattr(config, "num_query_groups", None),
            kv_channels=getattr(config, "kv_channels", None),
            gated_linear_unit=bool(getattr(config, "gated_linear_unit", False)),
            normalization=getattr(config, "normalization", "LayerNorm"),
            add_bias_linear=bool(getattr(config, "add_bias_linear", True)),
            qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
            tied_embeddings=tied_embeddings, position_embedding_type=position_embedding_type,
            max_sequence_length=max_sequence_length)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return (self.num_query_groups or self.num_attention_heads) * self.head_dim

    def _norm(self, width: int) -> int:
        return 2 * width if self.normalization == "LayerNorm" else width

    def layer_parameters(self, tensor_parallel_size: int = 1) -> int:
        """One transformer layer on one TP rank: two norms, QKV and output projections, the
        MLP (the linear layers' weights and the column-parallel biases split over TP)."""
        h, bias, t = self.hidden_size, int(self.add_bias_linear), tensor_parallel_size
        qkv = self.q_dim + 2 * self.kv_dim
        fc1 = self.ffn * (2 if self.gated_linear_unit else 1)
        count = 2 * self._norm(h)
        count += _per_rank(h * qkv + bias * qkv + self.q_dim * h, t) + bias * h
        count += _per_rank(h * fc1 + bias * fc1 + self.ffn * h, t) + bias * h
        if self.qk_layernorm:
            count += 2 * self._norm(self.head_dim)
        return count

    def embedding_parameters(self, tensor_parallel_size: int = 1) -> int:
        """Word embeddings (vocabulary-parallel: 1/TP per rank) and learned positions."""
        positions = (self.max_sequence_length * self.hidden_size
                     if self.position_embedding_type == "learned_absolute" else 0)
        return _per_rank(self.vocab_size, tensor_parallel_size) * self.hidden_size + positions

    def output_parameters(self, holds_embedding: bool, tensor_parallel_size: int = 1) -> int:
        """Final norm and output layer (no weight of its own where tied on the same chunk)."""
        tied_here = self.tied_embeddings and holds_embedding
        vocab = _per_rank(self.vocab_size, tensor_parallel_size)
        return self._norm(self.hidden_size) + (0 if tied_here else vocab * self.hidden_size)

    def total_parameters(self) -> int:
        return (self.num_layers * self.layer_parameters() + self.embedding_parameters()
                + self.output_parameters(True))


def _per_rank(count: int, tensor_parallel_size: int) -> int:
    """A TP rank's share of ``count`` split parameters (a vocabulary Megatron pads up)."""
    return -(-count // tensor_parallel_size)


def layers_per_virtual_stage(num_layers: int, num_virtual_stages: int) -> int:
    """Megatron's even split (uneven first/last stages are not modelled)."""
    if num_layers % num_virtual_stages:
        raise ValueError(f"{num_layers} layers do not split evenly over {num_virtual_stages} "
                         "virtual pipeline stages")
    return num_layers // num_virtual_stages


def virtual_stage_parameters(shape: ModelShape, num_stages: int, num_model_chunks: int = 1,
                             tensor_parallel_size: int = 1) -> list[int]:
    """Parameters of each virtual stage, in pipeline order (``chunk * num_stages + rank``),
    on one TP rank."""
    count, t = num_stages * num_model_chunks, tensor_parallel_size
    per_layer = shape.layer_parameters(t) * layers_per_virtual_stage(shape.num_layers, count)
    params = [per_layer] * count
    params[0] += shape.embedding_parameters(t)
    params[-1] += shape.output_parameters(holds_embedding=count == 1, tensor_parallel_size=t)
    return params


def stage_parameters(shape: ModelShape, num_stages: int, num_model_chunks: int = 1,
                     tensor_parallel_size: int = 1) -> list[int]:
    """Parameters each pipeline rank holds (all its model chunks; one TP rank's share)."""
    per_virtual = virtual_stage_parameters(shape, num_stages, num_model_chunks,
                                           tensor_parallel_size)
    return [sum(per_virtual[c * num_stages + r] for c in range(num_model_chunks))
            for r in range(num_stages)]


@dataclass(frozen=True)
class Training:
    """How the weights are trained: their dtype, the gradient buffer, the optimizer."""

    dtype: str = "bf16"  # parameters: "bf16", "fp16" or "fp32"
    grad_reduce_in_fp32: bool | None = None  # default: True for bf16/fp16 (Megatron-LM)
    optimizer: str | None = "adam"  # or None: weights and gradients only
    distributed_optimizer: bool = False
    data_parallel_size: int = 1

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.optimizer not in (None, "adam"):
            raise ValueError(f"optimizer must be 'adam' or None, got {self.optimizer!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")

    def bytes_per_parameter(self) -> dict[str, float]:
        """Weights, main gradients and optimizer states per parameter, on one rank."""
        weight = DTYPE_BYTES[self.dtype]
        fp32_grads = (self.grad_reduce_in_fp32 if self.grad_reduce_in_fp32 is not None
                      else self.dtype != "fp32")
        grad = 4 if fp32_grads or self.dtype == "fp32" else weight
        states = 0.0
        if self.optimizer == "adam":
            master = 4 if self.dtype != "fp32" else 0  # fp32 copy of half-precision weights
            states = 8 + master  # exp_avg and exp_avg_sq in fp32
            if self.distributed_optimizer:
                states /= self.data_parallel_size
        return {"weights": float(weight), "gradients": float(grad), "optimizer": states}

    def state_bytes(self, parameters: int) -> dict[str, float]:
        return {k: v * parameters for k, v in self.bytes_per_parameter().items()}


def activation_bytes_per_token(shape: ModelShape, num_layers: int, *, first: bool, last: bool,
                               dtype: str = "bf16", flash: bool = True,
                               micro_batch_size: int = 1, whole_qkv: bool = False,
                               tensor_parallel_size: int = 1,
                               sequence_parallel: bool = False) -> tuple[float, float]:
    """(bytes one token leaves for the backward, the part of it that is keys and values) on a
    chunk of ``num_layers`` layers, per sample of the micro-batch.

    An estimate of what Megatron-Core's local layers save, no dropout, no recomputation:
    per layer the inputs of both norms and of the four linear layers (the output
    projection's is a copy of the attention output in ``[s, b, h]`` order), the query,
    keys and values the attention kernel keeps, the flash kernel's own output and
    log-sum-exp, the MLP's activation input and output, the cosines and sines Megatron's
    unfused RoPE makes for queries and keys; the first chunk adds the token ids, the last
    its final norm, output-layer input and the fp32 softmax of the cross entropy over the
    vocabulary. Without a flash kernel (``flash=False``: Megatron's unfused attention)
    the ``len x end`` probabilities it keeps are not included: use a measured
    ``bytes_per_token`` there. Keys and values are returned apart because Seq1F1B keeps a
    micro-batch's keys and values in one buffer of the whole sequence from its first
    segment's forward to that segment's backward (:mod:`megatron_seq1f1b.segments.kv_cache`).

    ``whole_qkv``: the unit is a whole micro-batch (Megatron's schedule, Seq1F1B with
    one segment), whose attention gets the values as a view of the QKV projection's
    output: the saved values then keep all of that output alive, its query and key parts
    too (RoPE's rotated copies are what the kernel saves). Segments get their keys and
    values copied into the buffer instead, and the projection's output is freed.

    Per TP rank with ``tensor_parallel_size``: heads, keys and values, the MLP's columns and
    the vocabulary's softmax divide by TP; the ``[s, b, h]`` inputs of the norms, of QKV,
    of the first MLP layer and of the output layer only with ``sequence_parallel``.
    """
    e, h, t = DTYPE_BYTES[dtype], shape.hidden_size, tensor_parallel_size
    whole = t if sequence_parallel else 1  # what Megatron keeps whole on every TP rank
    fc1 = shape.ffn * (2 if shape.gated_linear_unit else 1)
    kv = 2 * shape.kv_dim * e / t
    split = e * (2 * shape.q_dim + fc1 + shape.ffn)
    if flash:  # SDPA's output and its fp32 log-sum-exp per head, kept for its backward
        split += e * shape.q_dim + 4 * shape.num_attention_heads
    if whole_qkv and shape.position_embedding_type == "rope":
        split += e * (shape.q_dim + shape.kv_dim)  # the rest of the viewed QKV output
    per_layer = e * 4 * h / whole + split / t + kv
    if shape.position_embedding_type == "rope":  # unfused RoPE: cos and sin for q and for k
        per_layer += 4 * shape.head_dim * e
    total = num_layers * per_layer
    if first:
        total += 8  # token ids (int64)
    if last:  # norm and output inputs, fp32 softmax
        total += 2 * e * h / whole + 4 * shape.vocab_size / t + 8
    return float(total), float(num_layers * kv)


def attention_pair_bytes(shape: ModelShape, num_layers: int, *, dtype: str = "bf16",
                         flash: bool = True, tensor_parallel_size: int = 1) -> float:
    """Bytes per query-key pair (one sample) that attention keeps for its backward on a chunk.

    Flash kernels keep none. Megatron's unfused attention keeps its probabilities
    for every pair it computes (masked ones too): the softmax's output, in fp32
    (``attention_softmax_in_fp32``), and in half precision the copy cast back for
    the product with the values, per head and layer (a TP rank's heads: 1/TP of them).
    """
    if flash:
        return 0.0
    per_head = 4 + (DTYPE_BYTES[dtype] if DTYPE_BYTES[dtype] < 4 else 0)
    return float(num_layers * shape.num_attention_heads * per_head / tensor_parallel_size)


@dataclass(frozen=True)
class UnitBytes:
    """What one unit (a segment of a micro-batch) holds, in tokens and pairs of one sample:
    ``tokens`` (their activations besides keys and values), ``kv_rows`` (keys and values
    saved with the unit itself: its own, or the flash path's packed copies of the keys its
    document pieces see), ``pairs`` (query-key pairs its attention computes), and
    ``buffer_rows`` (a K/V buffer of a chain this segment heads, held until its backward)."""

    tokens: int
    kv_rows: int
    pairs: int
    buffer_rows: int


def unit_bytes(lengths: Sequence[int], documents=None, dense: bool = False,
               context_parallel_size: int = 1) -> list[UnitBytes]:
    """Per segment of a micro-batch: what its unit holds (:class:`UnitBytes`).

    The K/V buffers are :mod:`megatron_seq1f1b.segments.kv_cache`'s: a chain of segments
    linked by a crossing document (without documents all of them) keeps its rows
    in one buffer from its head's forward to the head's backward; a segment alone
    keeps its own keys and values with the unit. ``pairs`` count what the attention computes: for the
    unfused kernel (``dense``) every query against every key the segment holds,
    else (flash) only the causal pairs of each document, which keep nothing.
    With ``documents`` (:class:`~megatron_seq1f1b.segments.documents.Documents`), per
    sample, summed over the micro-batch's samples. With context parallelism a
    rank holds ``1 / cp`` of every segment's tokens and queries, but the whole
    segment's keys and values (gathered over the CP group) in the K/V buffers,
    or with a segment alone.
    """
    from megatron_seq1f1b.segments.documents import HEAD, MEMBER, chains, rank_ranges, roles, views_of

    cp = context_parallel_size
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    samples = 1 if documents is None else documents.micro_batch_size
    if len(lengths) == 1 and documents is None:  # one segment: nothing is cached
        n = lengths[0]
        return [UnitBytes(n // cp, n, (n // cp) * n if dense else 0, 0)]
    views = views_of(starts, lengths, documents, None)
    mine = views if cp == 1 else views_of(  # CP rank 0's queries (every rank's as many)
        starts, lengths, documents, None, lambda start, end: rank_ranges(start, end, cp, 0))
    linked = chains(views)
    units = []
    for index, (view, (role, number)) in enumerate(zip(views, roles(views, linked))):
        own, buffer = view.length * samples, 0
        if role == MEMBER:
            own = 0
        elif role == HEAD:
            chain = linked[number]
            own, buffer = 0, (chain.end - chain.base) * samples
        pairs = view.length // cp * view.num_keys * samples if dense else 0
        pieces = mine[index].pieces
        if not dense and documents is not None and pieces is not None and (samples > 1 or cp > 1):
            # the flash path packs these documents' pieces as THD: its attention keeps a copy
            # of the keys they see (not the segment's own keys and values)
            own = sum(piece.keys for sample in pieces for piece in sample)
        units.append(UnitBytes(view.length // cp * samples, own, pairs, buffer))
    return units


def stage_activation_bytes(schedule: Sequence[Sequence], lengths: Sequence[int],
                           bytes_per_token: Sequence[Sequence[tuple[float, float]]],
                           micro_batch_size: int = 1, *,
                           pair_bytes: Sequence[Sequence[float]] | None = None,
                           microbatches: Sequence[Sequence[UnitBytes]] | None = None,
                           dense: bool = False, context_parallel_size: int = 1) -> list[float]:
    """Peak activation bytes per rank of a schedule (lists of actions per rank).

    ``bytes_per_token[rank][chunk]``: (all, keys and values) bytes one token of
    one sample leaves on that chunk; ``pair_bytes[rank][chunk]``: bytes per
    query-key pair the unfused attention keeps (:func:`attention_pair_bytes`).
    A unit holds its tokens' activations (keys and values apart), its own keys
    and values and its attention's pairs from its forward until its backward,
    or its ``W`` where W is split off; a chain's K/V buffer lives from its head's
    forward to the head's backward (:func:`unit_bytes`). ``microbatches``: each
    micro-batch's :func:`unit_bytes` (packed documents: their own lengths and
    chains), cycled; default: ``lengths`` for every micro-batch, without documents.
    """
    default = unit_bytes(lengths, dense=dense, context_parallel_size=context_parallel_size)
    peaks = []
    for rank, actions in enumerate(schedule):
        release = "W" if any(a.is_weight for a in actions) else "B"
        live, peak = 0.0, 0.0
        held = {}
        for action in actions:
            all_bytes, kv_bytes = bytes_per_token[rank][action.chunk]
            pair = pair_bytes[rank][action.chunk] if pair_bytes is not None else 0.0
            units = (microbatches[action.microbatch % len(microbatches)] if microbatches
                     else default)
            unit = units[action.segment]
            scale = micro_batch_size if not microbatches else 1
            if action.is_forward:
                own = (unit.tokens * (all_bytes - kv_bytes) + unit.kv_rows * kv_bytes
                       + unit.pairs * pair) * scale
                held[action.unit] = (own, unit.buffer_rows * kv_bytes * scale)
                live += sum(held[action.unit])
                peak = max(peak, live)
            else:
                if action.kind == release:
                    live -= held[action.unit][0]
                if action.kind == "B":
                    live -= held[action.unit][1]
        peaks.append(peak)
    return peaks
