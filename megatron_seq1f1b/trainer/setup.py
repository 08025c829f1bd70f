"""Process groups, model chunks, optimizer and LR schedule, as Megatron-LM sets them up."""

from __future__ import annotations

import datetime
import importlib.util
import os
from typing import Callable

import torch
import torch.distributed as dist

from megatron_seq1f1b.planner.model_flags import recurrent_fields


def init_distributed(args) -> torch.device:
    """NCCL on GPUs, gloo on CPUs (with megatron_seq1f1b.runtime.cpu patches); then parallel state."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        # torchrun sets LOCAL_RANK; other launchers (e.g. srun) only RANK.
        local = os.environ.get("LOCAL_RANK")
        if local is None:
            local = int(os.environ.get("RANK", 0)) % torch.cuda.device_count()
        device = torch.device("cuda", int(local))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        from megatron_seq1f1b.runtime import cpu

        cpu.enable()
        torch.set_num_threads(int(os.environ.get("SEQ1F1B_THREADS_PER_RANK", "1")))
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(minutes=float(os.environ.get("SEQ1F1B_TIMEOUT_MINUTES", "10")))
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # `python pretrain_gpt.py`, no launcher: one process
            dist.init_process_group(backend, timeout=timeout, world_size=1, rank=0,
                                    store=dist.HashStore())
        else:
            dist.init_process_group(backend, timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        distributed_timeout_minutes=timeout.total_seconds() / 60,
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(args.seed)
    return device


def shutdown() -> None:
    """Every rank done, then Megatron's groups and the default group destroyed (in order)."""
    from megatron.core import parallel_state

    from megatron_seq1f1b.runtime.p2p import destroy_link_groups

    dist.barrier()
    destroy_link_groups()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def transformer_config(args):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    config_class, mla = TransformerConfig, {}
    if args.multi_latent_attention:
        config_class = MLATransformerConfig
        mla = dict(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                   qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
                   v_head_dim=args.v_head_dim, rope_type=args.rope_type or "yarn",
                   rotary_scaling_factor=args.rotary_scaling_factor,
                   original_max_position_embeddings=args.max_position_embeddings)
    return config_class(
        **mla,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        window_size=args.window_size,
        window_attn_skip_freq=args.window_attn_skip_freq,
        add_bias_linear=not args.disable_bias_linear,
        **_moe_fields(args),
        **_variable_fields(args),
        **recurrent_fields(args),
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        calculate_per_token_loss=args.calculate_per_token_loss,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        use_cpu_initialization=not torch.cuda.is_available(),
        **cuda_fusions(args),
        # Megatron-LM's defaults: interleaving overlaps p2p (unbatched), otherwise batched.
        # (Megatron's interleaved schedule with batched p2p is wrong at pp=2.)
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
        # On gloo, Megatron's overlapped sends can still read an output when it is
        # pseudo-freed; keep outputs there (no effect on results).
        deallocate_pipeline_outputs=not (interleaved and not torch.cuda.is_available()),
    )


def cuda_fusions(args) -> dict:
    """The fusions Megatron-Core has without Transformer Engine or Apex, on for CUDA (both
    schedules alike); all off on a CPU.

    On: bias + activation (GeLU with biases, SwiGLU), bias + dropout + add, and the native
    fused cross entropy (Megatron's own ``jit_fuser``, i.e. ``torch.compile``). Off, as they
    need kernels that are not there: RoPE fusion (TE), gradient-accumulation fusion (Apex),
    the fused masked softmax (Apex's or Megatron-LM's compiled ``scaled_masked_softmax_cuda``,
    used only where it imports). The fused cross entropy only in bf16: Megatron-Core's
    (0.19) casts the logits' gradient to bf16 whatever the dtype.
    """
    cuda = torch.cuda.is_available()
    gelu_with_bias = not args.swiglu and not args.disable_bias_linear
    return dict(
        masked_softmax_fusion=(cuda and importlib.util.find_spec("scaled_masked_softmax_cuda")
                               is not None),
        bias_activation_fusion=cuda and (args.swiglu or gelu_with_bias),
        bias_dropout_fusion=cuda,
        cross_entropy_loss_fusion=cuda and bool(getattr(args, "bf16", False)),
        cross_entropy_fusion_impl="native",
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def _moe_fields(args) -> dict:
    """TransformerConfig fields of the MoE flags (none for a dense model)."""
    if not args.num_experts:
        return {}
    return dict(
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_layer_freq=args.moe_layer_freq,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        expert_model_parallel_size=args.expert_model_parallel_size,
        moe_grouped_gemm=False,
    )


def _variable_fields(args) -> dict:
    """--variable-seq-lengths: Megatron-Core's variable_seq_lengths, which it allows only with
    the alltoall token dispatcher, also in a dense model whose config keeps the allgather
    default (an MoE model's dispatcher is its flag's, checked at start-up)."""
    if getattr(args, "variable_seq_lengths", None) is None:
        return {}
    fields = dict(variable_seq_lengths=True)
    if not args.num_experts:
        fields["moe_token_dispatcher_type"] = "alltoall"
    return fields


def build_model(args, config, model_provider: Callable) -> list:
    """Model chunks of this rank, Seq1F1B-enabled if asked, wrapped in Megatron DDP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunks.append(model_provider(args, config, pre_process=pre, post_process=post,
                                     vp_stage=stage))
    if torch.cuda.is_available():
        chunks = [chunk.cuda() for chunk in chunks]
    if args.seq1f1b:
        import megatron_seq1f1b as s1

        s1.enable(chunks)
    if args.bf16 or args.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    model = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
    no_sync = [m.no_sync for m in model]
    config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
    if args.overlap_grad_reduce:
        sync = [m.start_grad_sync for m in model]
        config.grad_sync_func = sync[0] if len(model) == 1 else sync
    config.finalize_model_grads_func = finalize_model_grads
    return model


def build_optimizer(args, model: list):
    """Megatron-Core's Adam (distributed if asked) and its LR/weight-decay schedule."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, model, use_gloo_process_groups=False)
    if args.fp16:
        # As Megatron-LM's train(): backward_step scales the loss with the dynamic
        # loss scale; without it fp16 gradients underflow and the optimizer's
        # unscaling shrinks every update to nothing. (Other dtypes: scale 1.)
        from megatron.core.utils import get_model_config

        get_model_config(model[0]).grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.train_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
