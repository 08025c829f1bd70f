#!/usr/bin/env python
"""Pretrain a GPT with Megatron-Core, with Megatron's schedules or Seq1F1B. No Megatron-LM needed.

Laid out like Megatron-LM's pretrain_gpt.py (model_provider, get_batch,
loss_func, forward_step); the loop lives in megatron_seq1f1b.trainer.

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py --pipeline-model-parallel-size 4 \
        --num-layers 8 --hidden-size 128 --num-attention-heads 4 --seq-length 256 \
        --micro-batch-size 1 --global-batch-size 8 --mock-data --vocab-size 1024 \
        --train-iters 20 --seq1f1b --seq1f1b-splits 4

Runs on CPU with gloo when there is no GPU (one thread per rank), NCCL otherwise.
"""

from __future__ import annotations

from functools import partial

import torch

import megatron_seq1f1b as s1
from megatron_seq1f1b.trainer.arguments import core_attention
from megatron_seq1f1b.trainer.loop import pretrain


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    """A Megatron-Core GPTModel chunk with the local (Transformer-Engine-free) layer spec.

    With --num-experts (and --disable-bias-linear: Megatron-Core's local experts fail on linear
    biases), Megatron's decoder block spec (MoE layers by --moe-layer-freq); with
    --mtp-num-layers, Megatron's MTP block on the last stage. With
    --attention-backend flash, and always with --multi-latent-attention (Megatron's local
    DotProductAttention has one K/V width), the core attention is FlashDotProductAttention.
    With --context-parallel-size > 1, Megatron's DotProductAttention (which asserts CP 1 when
    built) becomes its subclass for Seq1F1B's segments, which gather keys and values over the
    CP group; the flash attention takes CP as it is.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    from megatron_seq1f1b.attention.context_parallel import context_parallel_layer_spec
    from megatron_seq1f1b.attention.flash import flash_layer_spec

    if args.hybrid_layer_pattern is not None:
        return hybrid_model_provider(args, config, pre_process, post_process, vp_stage)
    mla = bool(args.multi_latent_attention)
    spec = get_gpt_layer_local_spec(normalization=args.normalization, multi_latent_attention=mla)
    if config.num_moe_experts:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=args.normalization,
            vp_stage=vp_stage, pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    if core_attention(args) == "flash":
        spec = flash_layer_spec(spec)
    if config.context_parallel_size > 1:
        spec = context_parallel_layer_spec(spec)
    mtp = None
    if config.mtp_num_layers:  # as Megatron-LM's builder: MTP layers like the last decoder layer
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False,
                                     vp_stage=vp_stage,
                                     pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
    )


def hybrid_model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    """A Megatron-Core HybridModel chunk of --hybrid-layer-pattern (*, +, M, G, - and E layers)
    with megatron_seq1f1b's local hybrid spec (Megatron's own modules, no Transformer Engine;
    MLA's core attention is the flash one, as for the GPT; Mamba-2 and gated delta nets are
    Megatron's MambaMixer and GatedDeltaNet, on CPU with megatron_seq1f1b's reference kernels);
    one pipeline rank builds the whole pattern."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_seq1f1b.runtime.hybrid_spec import local_hybrid_stack_spec

    from megatron_seq1f1b.attention.context_parallel import context_parallel_layer_spec

    pattern = args.hybrid_layer_pattern
    if args.pipeline_model_parallel_size == 1:
        pattern = pattern.replace("|", "")
    stack = local_hybrid_stack_spec(
        attention=core_attention(args),
        num_experts=args.num_experts)
    if config.context_parallel_size > 1:
        stack = context_parallel_layer_spec(stack)
    return HybridModel(
        config=config,
        hybrid_stack_spec=stack,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        hybrid_layer_pattern=pattern,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator):
    """The full micro-batch on this rank's device, then this segment's part of it."""
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
    batch.setdefault("attention_mask", None)
    return s1.slice_batch(batch)  # identity outside Seq1F1B segments


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the masked token losses, the token count, and a [sum, tokens] report."""
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def packed_seq_params(batch: dict):
    """Packed documents (THD) as Megatron-LM's forward_step passes them, or None."""
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_seq1f1b.base import compat

    cu_seqlens = cu_seqlens.squeeze(0)  # [1, N] in the batch, 1-D for attention
    longest = int(batch["max_seqlen"].max().item())
    # total_tokens, as pretrain_hybrid.py sets it: Mamba's seq_idx (its documents) follows
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest,
                           **compat.packed_total_tokens(int(cu_seqlens[-1].item())))


def forward_step(data_iterator, model):
    batch = get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], loss_mask=batch["loss_mask"],
                   packed_seq_params=packed_seq_params(batch))
    return output, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    pretrain(forward_step, model_provider)
