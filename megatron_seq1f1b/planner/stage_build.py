"""A pipeline stage's own model chunks, built on one rank for a rehearsal.

Megatron's parallel state has pipeline size 1 (the stage runs alone); each chunk is its
virtual stage of the whole model: a ``GPTModel`` of that stage's share of the layers
(numbered from 1), or a ``HybridModel`` of that stage's ``|`` part of the pattern (with
megatron_seq1f1b's local hybrid spec unless another is given). The first virtual stage
has the embedding, the last the final norm, output layer, loss and the multi-token
prediction block (with its copy of the embedding). Weights are random: only shapes and
work matter.
"""

from __future__ import annotations

import dataclasses

from megatron_seq1f1b.planner.footprint import hybrid_stage_patterns, layers_per_virtual_stage
from megatron_seq1f1b.runtime.model_hooks import MODEL_LAYERS

__all__ = ["stage_layer_problems", "build_stage_chunks", "hybrid_stage_patterns"]


def stage_layer_problems(config, hybrid_layer_pattern: str | None = None) -> list[str]:
    """What a stage built with its own layer numbering would get wrong (a HybridModel's
    layers are its pattern's: no numbering rule to lose)."""
    problems = []
    freq = getattr(config, "moe_layer_freq", 1)
    if getattr(config, "num_moe_experts", None) and freq != 1 and hybrid_layer_pattern is None:
        problems.append(f"moe_layer_freq={freq!r}: which layers are MoE depends on their global "
                        "numbers, which a rehearsed stage does not keep")
    if getattr(config, "window_attn_skip_freq", None) is not None:
        problems.append("window_attn_skip_freq: which layers are windowed depends on their "
                        "global numbers, which a rehearsed stage does not keep")
    for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                 "pipeline_model_parallel_layout"):
        if getattr(config, name, None) is not None:
            problems.append(f"{name}: uneven pipeline stages are not rehearsed (even splits "
                            "only; a hybrid pattern's '|' stages may differ)")
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(config, name, False):
            problems.append(f"{name}: not rehearsed (even splits of the layers only)")
    return problems


def build_stage_chunks(config, num_stages: int, stage: int, *, vocab_size: int,
                       max_sequence_length: int, num_model_chunks: int = 1,
                       layer_spec=None, tied_embeddings: bool = False,
                       position_embedding_type: str = "rope",
                       hybrid_layer_pattern: str | None = None,
                       hybrid_stack_spec=None) -> list:
    """The model chunk(s) pipeline rank ``stage`` of ``num_stages`` holds, built on one rank
    (Megatron's parallel state must have pipeline size 1).

    ``config``: the whole model's TransformerConfig (``num_layers`` of all stages); every
    chunk gets a copy with pipeline size 1 (one config object shared by the chunks, as
    Megatron-LM does). Virtual stage ``chunk * num_stages + stage`` has the embedding if it
    is the first, the final norm, output layer, loss and the MTP block
    (``config.mtp_num_layers``) if it is the last.

    GPTModel (default): each chunk holds ``num_layers / (P * v)`` layers; ``layer_spec``:
    default Megatron's local spec (MTP layers are built like it, as Megatron-LM does).
    HybridModel (``hybrid_layer_pattern``, the whole model's, ``|`` and ``/`` included):
    each chunk holds its virtual stage's part (:func:`hybrid_stage_patterns`) with
    ``hybrid_stack_spec`` (default: :func:`~megatron_seq1f1b.runtime.hybrid_spec.
    local_hybrid_stack_spec` with Megatron's local attention); the chunk's
    ``hybrid_layer_pattern`` is then set to the whole pattern, as every real stage has
    it, so the partitions cost it alike.
    """
    from megatron.core import parallel_state

    from megatron_seq1f1b.base.checks import raise_if

    problems = stage_layer_problems(config, hybrid_layer_pattern)
    if not 0 <= stage < num_stages:
        problems.append(f"stage must be in [0, {num_stages}), got {stage}")
    if num_model_chunks > 1 and num_stages < 2:
        problems.append("several model chunks per rank (interleaving) need num_stages >= 2")
    if parallel_state.model_parallel_is_initialized() \
            and parallel_state.get_pipeline_model_parallel_world_size() != 1:
        problems.append("initialize Megatron's parallel state with pipeline size 1: a "
                        "rehearsed stage runs alone")
    virtual = num_stages * num_model_chunks
    layers = patterns = None
    try:
        if hybrid_layer_pattern is None:
            layers = layers_per_virtual_stage(config.num_layers, virtual)
        else:
            patterns = hybrid_stage_patterns(hybrid_layer_pattern, virtual,
                                             mtp=bool(getattr(config, "mtp_num_layers", None)))
    except ValueError as exc:
        problems.append(str(exc))
    raise_if(problems)
    chunk_config = dataclasses.replace(
        config, num_layers=layers or config.num_layers, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        pipeline_dtype=config.pipeline_dtype or config.params_dtype)
    chunks = []
    for chunk in range(num_model_chunks):
        vs = chunk * num_stages + stage
        edges = dict(pre_process=vs == 0, post_process=vs == virtual - 1,
                     share_embeddings_and_output_weights=tied_embeddings,
                     position_embedding_type=position_embedding_type, vocab_size=vocab_size,
                     max_sequence_length=max_sequence_length)
        if patterns is not None:
            chunks.append(_hybrid_chunk(chunk_config, patterns[vs], hybrid_layer_pattern,
                                        hybrid_stack_spec, edges))
        else:
            chunk_model = _gpt_chunk(chunk_config, layer_spec, edges)
            # its config numbers only this stage's layers: the cut and W placement weigh all
            setattr(chunk_model, MODEL_LAYERS, config.num_layers)
            chunks.append(chunk_model)
    return chunks


def _gpt_chunk(config, layer_spec, edges: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = layer_spec or get_gpt_layer_local_spec(normalization=config.normalization)
    mtp = None
    if edges["post_process"] and getattr(config, "mtp_num_layers", None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False,
                                     vp_stage=None, pp_rank=0)
    model = GPTModel(config=config, transformer_layer_spec=spec, mtp_block_spec=mtp, **edges)
    if getattr(config, "mtp_num_layers", None) and not edges["post_process"]:
        # with MTP Megatron puts the final norm on the stage of the decoder's last layer (by
        # its global number); every stage built alone numbers its layers up to num_layers
        model.decoder.final_layernorm = None
    return model


def _hybrid_chunk(config, pattern: str, whole_pattern: str, stack_spec, edges: dict):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_seq1f1b.runtime.hybrid_spec import local_hybrid_stack_spec

    stack = stack_spec or local_hybrid_stack_spec(
        num_experts=getattr(config, "num_moe_experts", None))
    model = HybridModel(config=config, hybrid_stack_spec=stack, hybrid_layer_pattern=pattern,
                        **edges)
    model.hybrid_layer_pattern = whole_pattern  # what every real stage has (the partitions)
    return model
