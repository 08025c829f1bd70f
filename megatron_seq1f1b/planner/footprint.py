"""What a pipeline stage holds besides its activations: weights, gradients, optimizer states.

The planner predicts memory per pipeline stage as the sum of

* **weights** of the stage's parameters (its layers; the embedding on the first virtual
  stage, the final norm and output layer on the last; with tied embeddings and more than
  one virtual stage the last one holds its own copy of the word embeddings, as Megatron
  does; the multi-token-prediction block and its copy of the embedding on the last),
* **main gradients**: Megatron DDP's contiguous gradient buffer, fp32 when gradients are
  reduced in fp32 (``grad_reduce_in_fp32``, Megatron-LM's default for bf16), else the
  parameter dtype; every data-parallel rank holds all of it, with or without the
  distributed optimizer (which reduce-scatters into the same full buffer),
* **optimizer states** (Adam): two fp32 moments per parameter, plus an fp32 master copy
  of the weights where they are trained in half precision; the distributed optimizer
  shards exactly these (master weights and moments) over the data-parallel ranks,
* **activations**: the planner's replay of the stage's units times the bytes one token
  leaves for the backward (:func:`chunk_activation_bytes`, or a measured value).

Both are counted per layer kind (:meth:`ModelShape.stage_layers`): a GPTModel layer is
attention and an MLP (or a mixture of experts); a HybridModel's pattern gives each layer one
kind, ``*`` attention, ``-`` MLP, ``E`` MoE, ``M`` Mamba-2, ``G`` gated delta net (the
recurrent kinds: :mod:`~megatron_seq1f1b.planner.recurrent`), its ``|`` stages which layers
each virtual stage holds and its ``/`` parts the MTP depths. Parameter counts are those of
Megatron-Core's ``GPTModel`` with the local layer spec and of ``HybridModel`` with
:func:`~megatron_seq1f1b.runtime.hybrid_spec.local_hybrid_stack_spec` (checked against
built stages in ``tests/test_rehearse.py`` and ``tests/test_planner_hybrid.py``). Pure: no
torch, no Megatron.

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

from megatron_seq1f1b.planner.recurrent import (
    RECURRENT_KINDS, RecurrentUnits, gdn_sizes, mamba_sizes, recurrent_parameters,
    recurrent_token_bytes,
)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


#: What one layer holds, by kind (as :func:`~megatron_seq1f1b.schedules.partition.layer_kinds`
#: names them): a GPTModel layer is ``("attention", "mlp")`` (or ``"moe"``), a HybridModel
#: pattern's symbol one kind, ``*`` ``("attention",)``, ``-`` ``("mlp",)``, ``E`` ``("moe",)``,
#: ``M`` ``("mamba",)``, ``G`` ``("gdn",)``.
Layer = tuple
GPT_LAYER: Layer = ("attention", "mlp")
#: The symbols of a HybridModel pattern this memory model counts (Megatron-Core's
#: ``hybrid_layer_allocation.Symbols``); ``|`` separates pipeline stages, ``/`` MTP depths.
PATTERN_KINDS = {"*": "attention", "-": "mlp", "E": "moe", "M": "mamba", "G": "gdn"}
#: Megatron's ``TransformerConfig`` fields that size the recurrent layers (:class:`ModelShape`'s
#: fields of the same names).
RECURRENT_FIELDS = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
                    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_num_key_heads", "linear_num_value_heads")


def parse_pattern(pattern: str) -> tuple[list[str], list[str]]:
    """(the main pattern's ``|`` stages, the MTP depths' patterns) of a HybridModel's
    ``hybrid_layer_pattern``; ValueError for a symbol this model does not count."""
    main, *depths = pattern.split("/")
    unknown = sorted(set(pattern) - set(PATTERN_KINDS) - set("|/"))
    if unknown:
        raise ValueError(f"hybrid layer pattern {pattern!r}: the memory model counts attention "
                         f"(*), MLP (-), MoE (E), Mamba-2 (M) and gated delta net (G) layers; "
                         f"not {' '.join(unknown)}")
    return main.split("|"), depths


def hybrid_stage_patterns(pattern: str, num_virtual_stages: int,
                          mtp: bool = True) -> list[str]:
    """Each virtual stage's own HybridModel pattern, in pipeline order: its ``|`` part of the
    main pattern (Megatron's ``select_pipeline_segment``: stage ``vp * pp + rank``; a pattern
    without ``|`` split evenly), the last one followed by the MTP depths (``/`` parts) where
    ``mtp``. ValueError where the pattern does not fit the virtual stages."""
    main, *depths = pattern.split("/")
    stages = main.split("|")
    if len(stages) == 1 and num_virtual_stages > 1:
        layers = stages[0]
        per = layers_per_virtual_stage(len(layers), num_virtual_stages)
        stages = [layers[i * per:(i + 1) * per] for i in range(num_virtual_stages)]
    elif len(stages) != num_virtual_stages:
        raise ValueError(f"hybrid layer pattern {pattern!r} has {len(stages)} '|' stages for "
                         f"{num_virtual_stages} virtual pipeline stages (pipeline stages x "
                         "model chunks)")
    if mtp and depths:
        stages[-1] = "/".join([stages[-1], *depths])
    return stages


def _kinds(symbols: str) -> list[Layer]:
    return [(PATTERN_KINDS[c],) for c in symbols]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a GPTModel or a HybridModel that decide its parameters and activations.

    ``hybrid_layer_pattern``: a HybridModel's pattern (one symbol per layer, ``*`` attention,
    ``-`` MLP, ``E`` MoE, ``M`` Mamba-2, ``G`` gated delta net; ``|`` between pipeline stages,
    ``/`` before each MTP depth's layers); ``num_layers`` is then the main pattern's. The
    ``mamba_*`` and ``linear_*`` sizes are Megatron's ``TransformerConfig`` fields (and
    defaults) of the recurrent layers. Without it every layer is a GPTModel
    layer, attention and an MLP (a mixture of experts on ``moe_layer_freq``'s layers where
    ``num_moe_experts`` is set). ``mtp_num_layers``: multi-token prediction depths on the
    last virtual stage (a GPTModel's: one layer like its last each; a pattern's ``/`` parts:
    None takes them all, as Megatron-LM sets ``--mtp-num-layers`` from the pattern, 0 none).
    """

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
    hybrid_layer_pattern: str | None = None
    mtp_num_layers: int | None = None  # GPTModel: None = 0; a pattern: None = its '/' depths
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # default ffn_hidden_size
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | tuple = 1  # GPTModel: every N-th layer MoE, or one flag per layer
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None  # default 2 * hidden / mamba_head_dim
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    def __post_init__(self):
        if self.hybrid_layer_pattern is None:
            return
        stages, depths = parse_pattern(self.hybrid_layer_pattern)
        layers = sum(len(stage) for stage in stages)
        if layers != self.num_layers:
            raise ValueError(f"hybrid layer pattern {self.hybrid_layer_pattern!r} has {layers} "
                             f"layers, num_layers is {self.num_layers}")
        if self.mtp_num_layers and self.mtp_num_layers != len(depths):
            raise ValueError(f"mtp_num_layers={self.mtp_num_layers} with a pattern of "
                             f"{len(depths)} MTP depths ('/' parts)")
        if "E" in self.hybrid_layer_pattern and not self.num_moe_experts:
            raise ValueError("a hybrid layer pattern with MoE layers (E) needs num_moe_experts")
        if "M" in self.hybrid_layer_pattern:
            mamba_sizes(self)  # ValueError for sizes Megatron refuses
        if "G" in self.hybrid_layer_pattern:
            gdn_sizes(self)

    @classmethod
    def from_config(cls, config, vocab_size: int, *, tied_embeddings: bool = False,
                    position_embedding_type: str = "rope",
                    max_sequence_length: int = 0, pattern: str | None = None) -> "ModelShape":
        """From a TransformerConfig (or anything with its field names); ``pattern``: a
        HybridModel's ``hybrid_layer_pattern`` (its MTP depths count where the config's
        ``mtp_num_layers`` is set, as Megatron builds them)."""
        freq = getattr(config, "moe_layer_freq", 1)
        recurrent = {name: getattr(config, name) for name in RECURRENT_FIELDS
                     if getattr(config, name, None) is not None}
        return cls(**recurrent,
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
            max_sequence_length=max_sequence_length, hybrid_layer_pattern=pattern,
            mtp_num_layers=getattr(config, "mtp_num_layers", None) or 0,
            num_moe_experts=getattr(config, "num_moe_experts", None),
            moe_ffn_hidden_size=getattr(config, "moe_ffn_hidden_size", None),
            moe_router_topk=getattr(config, "moe_router_topk", 2) or 2,
            moe_shared_expert_intermediate_size=getattr(
                config, "moe_shared_expert_intermediate_size", None),
            moe_layer_freq=freq if isinstance(freq, int) else tuple(freq))

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

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

    # ------------------------------------------------------------ which layers

    def _gpt_layers(self) -> list[Layer]:
        if not self.num_moe_experts:
            return [GPT_LAYER] * self.num_layers
        freq = self.moe_layer_freq
        moe = ([i % freq == 0 for i in range(self.num_layers)] if isinstance(freq, int)
               else [bool(x) for x in freq])
        return [("attention", "moe" if m else "mlp") for m in moe]

    def stage_layers(self, num_virtual_stages: int) -> list[list[Layer]]:
        """Each virtual stage's decoder layers, in pipeline order: a pattern's ``|`` stages
        (as many as virtual stages), else Megatron's even split of the layers."""
        v = num_virtual_stages
        if self.hybrid_layer_pattern is not None:
            return [_kinds(stage) for stage in
                    hybrid_stage_patterns(self.hybrid_layer_pattern, v, mtp=False)]
        layers = self._gpt_layers()
        per = layers_per_virtual_stage(len(layers), v)
        return [layers[i * per:(i + 1) * per] for i in range(v)]

    def mtp_layers(self) -> list[list[Layer]]:
        """Each multi-token-prediction depth's layers (empty without MTP)."""
        if self.hybrid_layer_pattern is not None:
            _, depths = parse_pattern(self.hybrid_layer_pattern)
            return [] if self.mtp_num_layers == 0 else [_kinds(depth) for depth in depths]
        return [self._gpt_layers()[-1:]] * (self.mtp_num_layers or 0)

    # ------------------------------------------------------------ parameters

    def kind_parameters(self, kind: str, tensor_parallel_size: int = 1) -> int:
        """One layer kind's parameters on one TP rank: ``attention`` its norm, QKV and
        output projections; ``mlp`` its norm and MLP; ``moe`` its norm, the router, every
        expert (Megatron's local experts, each an MLP ``moe_ffn_hidden_size`` wide) and the
        shared expert (no expert parallelism: a rank holds every expert); ``mamba`` and
        ``gdn``: :func:`~megatron_seq1f1b.planner.recurrent.recurrent_parameters`."""
        if kind in RECURRENT_KINDS:
            return recurrent_parameters(self, kind, tensor_parallel_size)
        h, bias, t = self.hidden_size, int(self.add_bias_linear), tensor_parallel_size
        gated = 2 if self.gated_linear_unit else 1

        def mlp(width: int) -> int:
            return _per_rank(h * width * gated + bias * width * gated + width * h, t) + bias * h

        if kind == "attention":
            qkv = self.q_dim + 2 * self.kv_dim
            count = self._norm(h) + _per_rank(h * qkv + bias * qkv + self.q_dim * h, t) + bias * h
            return count + (2 * self._norm(self.head_dim) if self.qk_layernorm else 0)
        if kind == "mlp":
            return self._norm(h) + mlp(self.ffn)
        if kind == "moe":
            if not self.num_moe_experts:
                raise ValueError("MoE layers need num_moe_experts")
            experts = self.num_moe_experts
            shared = self.moe_shared_expert_intermediate_size
            return (self._norm(h) + experts * (h + bias) + experts * mlp(self.moe_ffn)
                    + (mlp(shared) if shared else 0))
        raise ValueError(f"no parameter count for layer kind {kind!r}")

    def layer_parameters(self, tensor_parallel_size: int = 1, layer: Layer = GPT_LAYER) -> int:
        """One layer on one TP rank (a GPTModel layer by default: two norms, QKV and output
        projections, the MLP; the linear layers' weights and the column-parallel biases
        split over TP)."""
        return sum(self.kind_parameters(kind, tensor_parallel_size) for kind in layer)

    def layers_parameters(self, layers, tensor_parallel_size: int = 1) -> int:
        return sum(self.layer_parameters(tensor_parallel_size, layer) for layer in layers)

    def mtp_parameters(self, tensor_parallel_size: int = 1) -> int:
        """The MTP block: per depth the norms of the embedding, the hidden state and the
        output (three), the projection of both ``[2h -> h]`` (no bias) and its layers."""
        h, t = self.hidden_size, tensor_parallel_size
        return sum(3 * self._norm(h) + _per_rank(2 * h * h, t)
                   + self.layers_parameters(depth, t) for depth in self.mtp_layers())

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
        """The whole model on one rank (one chunk: the embedding shared with MTP)."""
        layers = [layer for stage in self.stage_layers(1) for layer in stage]
        return (self.layers_parameters(layers) + self.embedding_parameters()
                + self.output_parameters(True) + self.mtp_parameters())


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
    on one TP rank: its layers; the embedding on the first; the final norm and output layer
    on the last, with the MTP block and, unless it is also the first, the MTP block's copy
    of the embedding."""
    count, t = num_stages * num_model_chunks, tensor_parallel_size
    params = [shape.layers_parameters(layers, t) for layers in shape.stage_layers(count)]
    params[0] += shape.embedding_parameters(t)
    params[-1] += shape.output_parameters(holds_embedding=count == 1, tensor_parallel_size=t)
    if shape.mtp_layers():
        params[-1] += shape.mtp_parameters(t) + (shape.embedding_parameters(t) if count > 1
                                                 else 0)
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
    chunk of ``num_layers`` GPTModel layers (attention and an MLP each), per sample of the
    micro-batch; :func:`chunk_activation_bytes` for any layers.

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
    return chunk_activation_bytes(
        shape, [GPT_LAYER] * num_layers, first=first, last=last, dtype=dtype, flash=flash,
        whole_qkv=whole_qkv, tensor_parallel_size=tensor_parallel_size,
        sequence_parallel=sequence_parallel)


def kind_activation_bytes(shape: ModelShape, kind: str, *, dtype: str = "bf16",
                          flash: bool = True, whole_qkv: bool = False,
                          tensor_parallel_size: int = 1, sequence_parallel: bool = False,
                          recurrent_kernels: str = "cuda") -> tuple[float, float]:
    """(bytes one token of one sample leaves for the backward, of which keys and values) in
    one layer kind (:func:`activation_bytes_per_token` says what is counted):

    * ``attention``: the norm's and QKV's inputs (``[s, b, h]``), the query, keys and values,
      the output projection's input, the flash kernel's output and log-sum-exp, unfused
      RoPE's cosines and sines for queries and keys (``whole_qkv``: the rest of the viewed
      QKV output);
    * ``mlp``: the norm's and the first linear layer's inputs, the activation's input and
      output;
    * ``moe`` (Megatron's local experts): the norm's and the router's inputs, and per routed
      copy of the token (``moe_router_topk``) the permuted input, the experts' activation
      input and output and that output weighted by the router's probability (the second
      linear layer's input), the routing's indices, probabilities and permutation maps; a
      shared expert as an MLP on the same input;
    * ``mamba``, ``gdn``: the part that grows with the tokens
      (:func:`~megatron_seq1f1b.planner.recurrent.recurrent_token_bytes`, by
      ``recurrent_kernels``; ``whole_qkv`` there means a whole micro-batch); what they keep
      per scan chunk and per segment is :func:`~megatron_seq1f1b.planner.recurrent.
      chunk_recurrent_units`'s.
    """
    if kind in RECURRENT_KINDS:
        return recurrent_token_bytes(shape, kind, dtype=dtype, kernels=recurrent_kernels,
                                     whole=whole_qkv, tensor_parallel_size=tensor_parallel_size,
                                     sequence_parallel=sequence_parallel), 0.0
    e, h, t = DTYPE_BYTES[dtype], shape.hidden_size, tensor_parallel_size
    whole = t if sequence_parallel else 1  # what Megatron keeps whole on every TP rank
    gated = 2 if shape.gated_linear_unit else 1
    if kind == "attention":
        kv = 2 * shape.kv_dim * e / t
        split = e * 2 * shape.q_dim
        if flash:  # SDPA's output and its fp32 log-sum-exp per head, kept for its backward
            split += e * shape.q_dim + 4 * shape.num_attention_heads
        if whole_qkv and shape.position_embedding_type == "rope":
            split += e * (shape.q_dim + shape.kv_dim)  # the rest of the viewed QKV output
        total = e * 2 * h / whole + split / t + kv
        if shape.position_embedding_type == "rope":  # unfused RoPE: cos and sin for q and k
            total += 4 * shape.head_dim * e
        return float(total), float(kv)
    if kind == "mlp":
        return float(e * 2 * h / whole + e * (shape.ffn * gated + shape.ffn) / t), 0.0
    if kind == "moe":
        k, width = shape.moe_router_topk, shape.moe_ffn
        total = e * 2 * h / whole  # the norm's input, the router's and experts' input
        # per routed copy: the permuted input, the experts' activation input and output, the
        # output weighted by the router's probability (the next linear layer's input); the
        # top-k indices, probabilities and permutation maps (int64, fp32)
        total += k * (e * h + e * (width * gated + 2 * width) / t + 40)
        shared = shape.moe_shared_expert_intermediate_size
        if shared:
            total += e * (shared * gated + shared) / t
        return float(total), 0.0
    raise ValueError(f"no activation estimate for layer kind {kind!r}")


def chunk_activation_bytes(shape: ModelShape, layers, *, first: bool, last: bool,
                           mtp: bool | None = None, dtype: str = "bf16", flash: bool = True,
                           whole_qkv: bool = False, tensor_parallel_size: int = 1,
                           sequence_parallel: bool = False,
                           recurrent_kernels: str = "cuda") -> tuple[float, float]:
    """(bytes per token, of which keys and values) of a chunk holding ``layers`` (layer-kind
    tuples, :meth:`ModelShape.stage_layers`), per sample: :func:`kind_activation_bytes` per
    layer; the first chunk adds the token ids, the last the final norm's and output layer's
    inputs, the fp32 softmax over the vocabulary and the labels; with ``mtp`` (default: the
    last chunk of a model with MTP depths) every depth adds its embedding's input and output,
    the norms' and projection's inputs, its layers, its own output-layer input, softmax and
    labels (:func:`mtp_activation_bytes`)."""
    e, h, t = DTYPE_BYTES[dtype], shape.hidden_size, tensor_parallel_size
    whole = t if sequence_parallel else 1
    options = dict(dtype=dtype, flash=flash, whole_qkv=whole_qkv, tensor_parallel_size=t,
                   sequence_parallel=sequence_parallel, recurrent_kernels=recurrent_kernels)
    total = kv = 0.0
    for layer in layers:
        for kind in layer:
            all_bytes, kv_bytes = kind_activation_bytes(shape, kind, **options)
            total, kv = total + all_bytes, kv + kv_bytes
    if first:
        total += 8  # token ids (int64)
    if last:  # norm and output inputs, fp32 softmax, labels
        total += 2 * e * h / whole + 4 * shape.vocab_size / t + 8
    if mtp if mtp is not None else last:
        all_bytes, kv_bytes = mtp_activation_bytes(shape, **options)
        total, kv = total + all_bytes, kv + kv_bytes
    return float(total), float(kv)


def mtp_activation_bytes(shape: ModelShape, *, dtype: str = "bf16", flash: bool = True,
                         whole_qkv: bool = False, tensor_parallel_size: int = 1,
                         sequence_parallel: bool = False,
                         recurrent_kernels: str = "cuda") -> tuple[float, float]:
    """(bytes per token, of which keys and values) the MTP block leaves, per sample: per depth
    the rolled token ids, the embedding's output (the ``enorm``'s input), the ``hnorm``'s
    input, the projection's ``[2h]`` input, its layers, the final norm's and the output
    layer's inputs, the fp32 softmax over the vocabulary, the rolled labels and loss mask and
    the per-token losses."""
    e, h, t = DTYPE_BYTES[dtype], shape.hidden_size, tensor_parallel_size
    whole = t if sequence_parallel else 1
    options = dict(dtype=dtype, flash=flash, whole_qkv=whole_qkv, tensor_parallel_size=t,
                   sequence_parallel=sequence_parallel, recurrent_kernels=recurrent_kernels)
    total = kv = 0.0
    for depth in shape.mtp_layers():
        total += 8 + e * 4 * h / whole + e * 2 * h / whole + 4 * shape.vocab_size / t + 8
        total += 8  # the rolled loss mask and the depth's per-token losses (fp32)
        for layer in depth:
            for kind in layer:
                all_bytes, kv_bytes = kind_activation_bytes(shape, kind, **options)
                total, kv = total + all_bytes, kv + kv_bytes
    return float(total), float(kv)


def stage_attention_layers(shape: ModelShape, num_virtual_stages: int) -> list[int]:
    """Attention layers of each virtual stage (the last one's MTP depths' included)."""
    counts = [sum("attention" in layer for layer in layers)
              for layers in shape.stage_layers(num_virtual_stages)]
    counts[-1] += sum("attention" in layer for depth in shape.mtp_layers() for layer in depth)
    return counts


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
                           dense: bool = False, context_parallel_size: int = 1,
                           recurrent: Sequence[Sequence[RecurrentUnits]] | None = None
                           ) -> list[float]:
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
    ``recurrent[rank][chunk]``: what its recurrent layers hold per unit beyond their
    per-token bytes (:class:`~megatron_seq1f1b.planner.recurrent.RecurrentUnits`: scan chunks
    padded, the state a later segment starts from), held as the unit's own.
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
                if recurrent is not None and recurrent[rank][action.chunk]:
                    length = unit.tokens if microbatches else lengths[action.segment]
                    own += recurrent[rank][action.chunk].bytes(
                        length, action.segment > 0) * scale
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
