"""``enable(model)``: make a Megatron-Core GPTModel or HybridModel run sequence segments.

It finds every self-attention layer and the rotary embedding of each model
chunk and installs the segment-aware forwards of
:mod:`megatron_seq1f1b.attention.segmented` as instance attributes, so parameters,
buffers and ``state_dict()`` keys stay exactly as they were; a forward
pre-hook checks that a segment's inputs are the segment's
(:func:`check_segment_inputs`). Without an active segment the model behaves as
before. Configurations that would be silently wrong are rejected here, with the
option to change.
"""

from __future__ import annotations

import enum
from typing import Any

from megatron_seq1f1b.attention import segmented as attention

from megatron_seq1f1b.base.checks import SUPPORTED_POSITIONS, model_config_problems, raise_if
from megatron_seq1f1b.runtime import recurrent_hooks
from megatron_seq1f1b.segments import moe, mtp
from megatron_seq1f1b.segments.active import active

_ENABLED = "_seq1f1b_enabled"
# GPTModel.forward and HybridModel.forward: (input_ids, position_ids, attention_mask,
# decoder_input, labels, ...), on every supported Megatron-Core
_SEQUENCE_INPUTS = (("input_ids", 0), ("position_ids", 1), ("labels", 4))


def unwrap(module) -> Any:
    """The GPTModel or HybridModel inside DDP / Float16Module / other ``.module`` wrappers."""
    from megatron_seq1f1b.base.compat import language_models

    classes = language_models()
    inner = module
    while not isinstance(inner, classes):
        if not hasattr(inner, "module"):
            names = " or ".join(cls.__name__ for cls in classes)
            raise TypeError(
                f"megatron_seq1f1b.enable() supports Megatron-Core {names} (possibly wrapped "
                f"in DDP or Float16Module); got {type(module).__name__}"
            )
        inner = inner.module
    return inner


def chunks_of(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def is_enabled(model) -> bool:
    return all(getattr(unwrap(chunk), _ENABLED, False) for chunk in chunks_of(model))


def is_prepared(model) -> bool:
    """Whether :func:`enable` prepared every chunk; False (not an error) for any other model,
    e.g. one :func:`enable` does not take."""
    for chunk in chunks_of(model):
        inner = chunk
        while not getattr(inner, _ENABLED, False):
            inner = getattr(inner, "module", None)
            if inner is None:
                return False
    return True


class AttentionKind(enum.IntEnum):
    """What a stage's core attention computes: the balanced partition weighs attention by it."""

    NONE = 0  # no attention layer: an embedding- or loss-only stage of a pipeline layout
    CAUSAL = 1  # skips masked blocks: Transformer Engine's, megatron_seq1f1b.attention.flash
    DENSE = 2  # Megatron's local DotProductAttention computes the masked scores too

    def describe(self) -> str:
        return {AttentionKind.NONE: "no attention layer",
                AttentionKind.CAUSAL: "flash or Transformer Engine attention, which skips "
                                      "masked blocks",
                AttentionKind.DENSE: "Megatron's local DotProductAttention, which computes "
                                     "masked scores too"}[self]

    @classmethod
    def of_backend(cls, backend: str) -> "AttentionKind":
        """The kind a backend's layers have ("local": Megatron's unfused attention; "flash",
        "te" skip masked blocks): what a rank that builds its stage by name cuts with, when
        that stage may hold no attention layer of its own."""
        if backend not in ("local", "flash", "te"):
            raise ValueError(f"unknown attention backend {backend!r}; one of local, flash, te")
        return cls.DENSE if backend == "local" else cls.CAUSAL


def attention_kind(model) -> AttentionKind:
    """The attention of these chunks: DENSE if any layer uses Megatron's local attention."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    kind = AttentionKind.NONE
    for chunk in chunks_of(model):
        for module in unwrap(chunk).modules():
            if isinstance(module, DotProductAttention):
                return AttentionKind.DENSE
            if isinstance(module, Attention):
                kind = AttentionKind.CAUSAL
    return kind


def layer_pattern(model) -> str | None:
    """A HybridModel's ``hybrid_layer_pattern`` (the whole model's, on every stage: what its
    FLOPs are counted by), or None for a GPTModel."""
    for chunk in chunks_of(model):
        pattern = getattr(unwrap(chunk), "hybrid_layer_pattern", None)
        if pattern is not None:
            return pattern
    return None


#: Set by :func:`~megatron_seq1f1b.planner.stage_build.build_stage_chunks` on a GPTModel stage
#: built alone: its config numbers only the stage's layers, a real stage's all of them.
MODEL_LAYERS = "seq1f1b_model_num_layers"


def model_num_layers(model) -> int | None:
    """The whole model's decoder layers where a stage built alone says them (a rehearsal), else
    None: the config's ``num_layers`` is the whole model's."""
    for chunk in chunks_of(model):
        count = getattr(unwrap(chunk), MODEL_LAYERS, None)
        if count is not None:
            return count
    return None


def dense_attention(model) -> bool:
    """True if a chunk uses Megatron's local attention, which computes masked scores too.

    (Transformer Engine's flash attention and megatron_seq1f1b.attention.flash
    skip masked blocks; the balanced partition weighs attention cost accordingly.)
    """
    return attention_kind(model) == AttentionKind.DENSE


def _check(gpt) -> list[str]:
    problems = model_config_problems(gpt.config) + mtp.problems(gpt.config, gpt)
    position = getattr(gpt, "position_embedding_type", "learned_absolute")
    if position not in SUPPORTED_POSITIONS:
        problems.append(
            f"position_embedding_type={position!r} is not supported; use one of "
            f"{SUPPORTED_POSITIONS}"
        )
    return problems


def _recurrent_mixers(gpt) -> tuple[list, list[str]]:
    """The recurrent mixers (Mamba-2, gated delta net) whose state Seq1F1B carries across
    cuts, and why some cannot."""
    found, problems = [], []
    for name, module in gpt.named_modules():
        if type(module).__name__ in recurrent_hooks.RECURRENT:
            problems += recurrent_hooks.problems(module, name)
            found.append(module)
    return found, problems


def _is_mla(module) -> bool:
    """Megatron's unfused MLASelfAttention (its fused subclass applies RoPE inside TE)."""
    names = [cls.__name__ for cls in type(module).__mro__]
    return "MLASelfAttention" in names and "FusedMLASelfAttention" not in names


def _attention_modules(gpt):
    """(core attention, its segment forward) per attention layer, plus MLA's own rotary modules.

    Multi-latent attention caches the *up-projected*, post-RoPE keys and values at
    its core attention, like standard attention: exactly the tensors the full
    sequence's attention saves for its backward, so the cache costs nothing
    extra. Caching the compressed latent instead would be smaller but would
    re-run the up-projection of the whole prefix for every segment (and its
    backward), k times the work for memory that attention keeps anyway.
    """
    from megatron.core.transformer.attention import Attention, SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    found, problems = [], []
    for name, module in gpt.named_modules():
        if not isinstance(module, Attention):
            continue
        if _is_mla(module):
            found.append((module.rotary_pos_emb, attention.rotary_forward))
        elif type(module).__name__ == "FusedMLASelfAttention":
            problems.append(f"{name}: FusedMLASelfAttention applies RoPE inside a fused kernel "
                            "without a position offset; build MLA with MLASelfAttention")
            continue
        elif not isinstance(module, SelfAttention):
            problems.append(f"{name}: {type(module).__name__} (only self-attention is supported; "
                            "build with a self-attention transformer_layer_spec)")
            continue
        core = module.core_attention
        cp = getattr(gpt.config, "context_parallel_size", 1) or 1
        if isinstance(core, DotProductAttention):
            if cp > 1 and not getattr(core, "seq1f1b_context_parallel", False):
                problems.append(
                    f"{name}.core_attention: Megatron's DotProductAttention cannot be built "
                    f"with context parallelism (context_parallel_size={cp}); build the layer "
                    "spec with megatron_seq1f1b.attention.context_parallel.context_parallel_layer_spec(spec)")
            found.append((core, attention.local_attention_forward))
        elif attention.is_te_attention(core):
            if cp > 1 and not getattr(type(core), "bottom_right_causal", False):
                problems.append(
                    f"{name}.core_attention: Transformer Engine's attention does its own context-"
                    f"parallel exchange (context_parallel_size={cp}), which Seq1F1B's segments "
                    "do not drive yet; use "
                    "Megatron's local attention or megatron_seq1f1b's flash attention "
                    "(--transformer-impl local) with context parallelism")
            found.append((core, attention.te_attention_forward))
        else:
            problems.append(
                f"{name}.core_attention: {type(core).__name__} is neither Megatron's "
                "DotProductAttention nor Transformer Engine's TEDotProductAttention; build with a "
                "transformer_layer_spec that uses one of them (or megatron_seq1f1b."
                "flash_attention.flash_layer_spec for PyTorch SDPA)"
            )
    return found, problems


def check_segment_inputs(module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of an enabled model: inside a segment, its ``[b, s]`` inputs must be
    the segment's, not the whole micro-batch's (a ``forward_step_func`` without
    :func:`~megatron_seq1f1b.slice_batch` fails later, deep in RoPE or attention, or not at
    all). Shapes only: no synchronization; before the embedding's tensor-parallel reduce."""
    unit = active()
    if unit is None:
        return
    info, run = unit.info, unit.run
    expected = info.length // run.cp_size
    for name, position in _SEQUENCE_INPUTS:
        value = kwargs.get(name, args[position] if len(args) > position else None)
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) == 2 and shape[-1] != expected:
            whole = " (the whole micro-batch)" if shape[-1] == sum(info.lengths) else ""
            raise ValueError(
                f"Seq1F1B: segment {info.index} of micro-batch {info.microbatch} has "
                f"{expected} tokens{' on this context-parallel rank' if run.cp_size > 1 else ''}"
                f", but the model got {name} of {shape[-1]}{whole}: cut each segment's batch "
                "with megatron_seq1f1b.slice_batch(batch) in forward_step_func")


def enable(model):
    """Prepare a GPTModel or HybridModel chunk (or list of chunks, possibly wrapped) for
    segments.

    Idempotent; returns `model`. Raises :class:`~megatron_seq1f1b.ConfigError`
    for unsupported models or options.
    """
    plans = []
    problems: list[str] = []
    for chunk in chunks_of(model):
        gpt = unwrap(chunk)
        problems += _check(gpt)
        cores, core_problems = _attention_modules(gpt)
        mixers, mixer_problems = _recurrent_mixers(gpt)
        problems += core_problems + mixer_problems
        plans.append((gpt, cores, mixers))
    raise_if(sorted(set(problems), key=problems.index))
    for gpt, cores, mixers in plans:
        for core, make_forward in cores:
            attention.install_forward(core, make_forward)
        for mixer in mixers:
            recurrent_hooks.prepare(mixer)
        for router in moe.routers(gpt):
            moe.install(router)
        mtp.install(gpt)
        if not getattr(gpt, _ENABLED, False):
            gpt.register_forward_pre_hook(check_segment_inputs, with_kwargs=True)
        rotary = getattr(gpt, "rotary_pos_emb", None)
        if getattr(gpt, "position_embedding_type", None) == "rope" and rotary is not None:
            attention.install_forward(rotary, attention.rotary_forward)
        setattr(gpt, _ENABLED, True)
    return model
