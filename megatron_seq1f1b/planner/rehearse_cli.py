"""``python -m megatron_seq1f1b.rehearse``: one pipeline stage run alone, and the planner's
prediction for it.

World size 1 (gloo with :mod:`megatron_seq1f1b.runtime.cpu` on a CPU, NCCL on a GPU),
Megatron's parallel state with pipeline size 1. Takes the trainer's model flags (a
GPTModel, or a HybridModel with ``--hybrid-layer-pattern`` and megatron_seq1f1b's local
hybrid spec; MoE with ``--num-experts``; Mamba-2 and gated-delta-net layers sized by
``--mamba-*`` / ``--linear-*``; multi-token prediction with ``--mtp-num-layers`` or the
pattern's ``/`` depths), the pipeline and the Seq1F1B flags; wraps the chunks as the
trainer does (Float16Module for bf16, Megatron DDP with fp32 gradient reduction, Megatron's
optimizer); prints the stage's memory and times and the planner's prediction for that stage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch

from megatron_seq1f1b.base.checks import attention_shape_problems, local_expert_bias_problems
from megatron_seq1f1b.base.flags import (
    ArgumentParser, non_negative_int, output_file, positive_int,
)
from megatron_seq1f1b.planner.model_flags import (
    add_recurrent_arguments, read_hybrid_pattern, recurrent_fields,
)
from megatron_seq1f1b.planner.stage_build import build_stage_chunks
from megatron_seq1f1b.planner.stage_run import Rehearsal, _zero_grads, rehearse_stage
from megatron_seq1f1b.runtime.model_hooks import AttentionKind
from megatron_seq1f1b.schedules.interleaved import ZB_H2_PROBLEM
from megatron_seq1f1b.schedules.partition import split_sequence

__all__ = ["build_parser", "check_args", "prepare", "predicted", "calibrate_stage", "main"]


def build_parser() -> ArgumentParser:
    """The rehearsal's flags; every number is checked as it is read."""
    p = ArgumentParser(
        prog="python -m megatron_seq1f1b.rehearse",
        description="Run one stage of a pipeline alone on this device (stand-in messages): "
                    "its peak memory and compute time, and the planner's prediction for it.")
    model = p.add_argument_group("model (the trainer's flags)")
    model.add_argument("--num-layers", type=positive_int, default=None,
                       help="of the whole model (a GPTModel's; --hybrid-layer-pattern sets it)")
    model.add_argument("--hybrid-layer-pattern", default=None, metavar="PATTERN",
                       help="rehearse Megatron-Core's HybridModel (0.18+) with megatron_seq1f1b's "
                            "local hybrid spec: one symbol per layer, '*' attention, '-' MLP, "
                            "'E' MoE (with --num-experts), 'M' Mamba-2, 'G' gated delta net "
                            "(sized by --mamba-* / --linear-*; with G the activation is SiLU, "
                            "which its convolution takes); '|' between pipeline stages (stages / "
                            "--pipeline-model-parallel-size = model chunks per rank), '/' before "
                            "each multi-token-prediction depth's layers (they set "
                            "--mtp-num-layers). As Megatron-LM's flag")
    model.add_argument("--mtp-num-layers", type=positive_int, default=None, metavar="D",
                       help="multi-token prediction: D depths on the last stage (a GPTModel's "
                            "layers like its last; with --hybrid-layer-pattern its '/' parts)")
    model.add_argument("--num-experts", type=positive_int, default=None,
                       help="MoE experts (every GPTModel layer, or the pattern's E layers)")
    model.add_argument("--moe-router-topk", type=positive_int, default=2,
                       help="experts each token goes to (default 2)")
    model.add_argument("--moe-ffn-hidden-size", type=positive_int, default=None,
                       help="default --ffn-hidden-size")
    model.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"],
                       default="alltoall", help="default alltoall")
    model.add_argument("--disable-bias-linear", action="store_true",
                       help="no biases in linear layers (as MoE models train)")
    model.add_argument("--hidden-size", type=positive_int, required=True, help="model width")
    model.add_argument("--num-attention-heads", type=positive_int, required=True,
                       help="query heads")
    model.add_argument("--ffn-hidden-size", type=positive_int, default=None,
                       help="default 4 * hidden")
    model.add_argument("--num-query-groups", type=positive_int, default=None,
                       help="key/value heads (grouped-query attention; default: one per "
                            "query head)")
    model.add_argument("--seq-length", type=positive_int, required=True,
                       help="tokens per sample of a micro-batch")
    model.add_argument("--vocab-size", type=positive_int, required=True,
                       help="the embedding's and output layer's rows")
    model.add_argument("--swiglu", action="store_true", help="gated SiLU MLP (SwiGLU)")
    model.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                       help="default LayerNorm")
    model.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"],
                       default="rope", help="default rope")
    ties = model.add_mutually_exclusive_group()
    ties.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                      help="separate embedding and output weights (default: shared, as in "
                      "Megatron-LM, the trainer and the planner)")
    ties.add_argument("--tie-embeddings", action="store_true",
                      help="share embedding and output weights (the default; kept for older "
                      "commands)")
    add_recurrent_arguments(model)
    model.add_argument("--bf16", action="store_true",
                       help="bf16 weights and activations (default fp32)")
    model.add_argument("--attention-backend", choices=["local", "flash"], default="local",
                       help="Megatron's local attention (default) or megatron_seq1f1b's flash "
                            "attention on SDPA, as the trainer's flag")
    par = p.add_argument_group("pipeline")
    par.add_argument("--pipeline-model-parallel-size", type=positive_int, required=True,
                     help="stages of the pipeline the rehearsed stage belongs to")
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None,
                     help="interleaving: layers per model chunk (default: one chunk per rank)")
    par.add_argument("--rehearse-stage", type=non_negative_int, required=True,
                     help="which stage to run, 0 to --pipeline-model-parallel-size - 1")
    par.add_argument("--context-parallel-size", type=positive_int, default=1,
                     help="rehearse rank 0 of a context-parallel group of this size (its peers' "
                          "keys and values made up; needs --seq1f1b-splits' segments to divide "
                          "into 2 x this many chunks)")
    par.add_argument("--micro-batch-size", type=positive_int, default=1,
                     help="samples per micro-batch (default 1)")
    par.add_argument("--num-microbatches", type=positive_int, required=True,
                     help="micro-batches per iteration")
    par.add_argument("--seq1f1b-splits", type=positive_int, default=1,
                     help="segments per micro-batch (default 1: Megatron's 1F1B)")
    par.add_argument("--seq1f1b-partition", choices=["uniform", "balanced", "documents"],
                     default="uniform",
                     help="default uniform (Megatron-LM's and the trainer's flag default to "
                          "balanced: give it to rehearse their cut); documents: needs "
                          "--document-length")
    par.add_argument("--document-length", type=positive_int, default=None, metavar="N",
                     help="pack documents of about N tokens (log-normal lengths) into every "
                          "micro-batch, ended by the last vocabulary id; attention keeps them "
                          "apart and the prediction follows them")
    par.add_argument("--seq1f1b-schedule", choices=["1f1b", "zb-h1", "zb-h2"], default="1f1b",
                     help="default 1f1b; zb-h1 / zb-h2: zero bubble (W as separate steps)")
    par.add_argument("--seq1f1b-segment-multiple", type=positive_int, default=None,
                     help="round segment lengths to multiples of N tokens (default: 64 on CUDA "
                          "where the sequence allows, else 1; with --context-parallel-size C: "
                          "2 x C)")
    train = p.add_argument_group("training state")
    train.add_argument("--optimizer", choices=["adam", "none"], default="adam",
                       help="adam (default): Megatron's (its states count in the peak); "
                            "none: weights and gradients only")
    train.add_argument("--use-distributed-optimizer", action="store_true",
                       help="(one rank: shards over a data-parallel size of 1)")
    p.add_argument("--iters", type=positive_int, default=2,
                   help="measured iterations (default 2)")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="iterations before measuring (default 1: the optimizer's states "
                        "appear in the first step)")
    p.add_argument("--count-saved", choices=["auto", "yes", "no"], default="auto",
                   help="count the bytes autograd saves (default: on CPU only)")
    p.add_argument("--save-calibration", metavar="FILE", type=output_file(make_folders=True),
                   help="also time this stage's segments (the start-up measurement's cases) "
                        "and write them as a one-stage planner calibration")
    p.add_argument("--calibration-reps", type=positive_int, default=3,
                   help="with --save-calibration: timings of each segment case (default 3)")
    p.add_argument("--min-segment-length", type=positive_int, default=128,
                   help="shortest segment the calibration times (default 128, the planner's)")
    p.add_argument("--json", metavar="FILE", type=output_file(make_folders=True),
                   help="write the result here (missing folders are made)")
    p.add_argument("--seed", type=non_negative_int, default=1234,
                   help="the random weights' and data's seed (default 1234)")
    return p

def check_args(parser: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """What needs several flags, before anything is built: one line and status 2 if it fails."""
    pp = args.pipeline_model_parallel_size
    if args.rehearse_stage >= pp:
        parser.error(f"--rehearse-stage {args.rehearse_stage}: a {pp}-stage pipeline "
                     f"(--pipeline-model-parallel-size) has stages 0 to {pp - 1}")
    if args.hybrid_layer_pattern is not None:
        _check_pattern(parser, args)
        return _check_rest(parser, args)
    layers = args.num_layers
    if layers is None:
        parser.error("give --num-layers (a GPTModel) or --hybrid-layer-pattern (a HybridModel)")
    if layers % pp:
        parser.error(f"--num-layers {layers} must divide by --pipeline-model-parallel-size {pp}")
    vpp_layers = args.num_layers_per_virtual_pipeline_stage
    if vpp_layers is not None:
        if pp < 2:
            parser.error("--num-layers-per-virtual-pipeline-stage needs "
                         "--pipeline-model-parallel-size >= 2")
        if (layers // pp) % vpp_layers:
            parser.error(f"--num-layers-per-virtual-pipeline-stage {vpp_layers} does not divide "
                         f"the {layers // pp} layers of a pipeline rank")
        if args.seq1f1b_schedule == "zb-h2":
            parser.error(f"--seq1f1b-schedule zb-h2 with virtual pipelining: {ZB_H2_PROBLEM}")
    return _check_rest(parser, args)


def _check_pattern(parser: ArgumentParser, args: argparse.Namespace) -> None:
    """The pattern (:func:`~megatron_seq1f1b.planner.model_flags.read_hybrid_pattern`), its '|'
    stages over the pipeline ranks, and what the rehearsal builds."""
    pp = args.pipeline_model_parallel_size
    pattern, main = read_hybrid_pattern(parser, args, pp, "the rehearsal builds")
    layers = args.num_layers
    if args.num_layers_per_virtual_pipeline_stage is not None:
        parser.error("--hybrid-layer-pattern sets the virtual stages by its '|' parts; drop "
                     "--num-layers-per-virtual-pipeline-stage")
    stages = main.split("|")
    if len(stages) > 1 and len(stages) % pp:
        parser.error(f"--hybrid-layer-pattern {pattern!r}: its {len(stages)} '|' stages must "
                     f"divide by --pipeline-model-parallel-size {pp}")
    if len(stages) == 1 and layers % pp:
        parser.error(f"--hybrid-layer-pattern {pattern!r} without '|': its {layers} layers must "
                     f"divide by --pipeline-model-parallel-size {pp}")
    if len(stages) > pp and args.seq1f1b_schedule == "zb-h2":
        parser.error(f"--seq1f1b-schedule zb-h2 with virtual pipelining: {ZB_H2_PROBLEM}")
    if args.context_parallel_size > 1:
        parser.error("--hybrid-layer-pattern with --context-parallel-size > 1 is not rehearsed")


def _check_rest(parser: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.mtp_num_layers and args.context_parallel_size > 1:
        parser.error("--mtp-num-layers with --context-parallel-size > 1: Seq1F1B refuses MTP "
                     "with context parallelism")
    for problem in attention_shape_problems(args.hidden_size, args.num_attention_heads,
                                            args.num_query_groups) + \
            local_expert_bias_problems(args.num_experts, args.disable_bias_linear):
        parser.error(problem)
    try:
        split_sequence(args.seq_length, args.seq1f1b_splits,
                       multiple_of=args.seq1f1b_segment_multiple or 2 * args.context_parallel_size
                       if args.context_parallel_size > 1 else args.seq1f1b_segment_multiple or 1)
    except ValueError as exc:
        parser.error(f"--seq-length / --seq1f1b-splits / --seq1f1b-segment-multiple / "
                     f"--context-parallel-size: {exc}")
    if args.seq1f1b_partition == "documents" and args.document_length is None:
        parser.error("--seq1f1b-partition documents cuts by documents: add --document-length N")
    return args


def _init(seed: int) -> torch.device:
    """World size 1 (gloo on CPU with megatron_seq1f1b.runtime.cpu, NCCL on a GPU), pipeline size 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        from megatron_seq1f1b.runtime import cpu

        cpu.enable()
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(seed)
    return device


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(args):
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    cuda = torch.cuda.is_available()
    chunks = _chunks_count(args)
    bias = not args.disable_bias_linear
    moe = {} if not args.num_experts else dict(
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_grouped_gemm=False)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups, normalization=args.normalization,
        gated_linear_unit=args.swiglu, add_bias_linear=bias, **moe,
        mtp_num_layers=args.mtp_num_layers, **recurrent_fields(args),
        activation_func=torch.nn.functional.silu if args.swiglu or _has_gdn(args)
        else torch.nn.functional.gelu,
        hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
        pipeline_dtype=dtype, params_dtype=dtype,
        bf16=args.bf16, use_cpu_initialization=not cuda,
        masked_softmax_fusion=False, bias_activation_fusion=cuda and (args.swiglu or bias),
        bias_dropout_fusion=cuda, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True, context_parallel_size=args.context_parallel_size)


def _has_gdn(args) -> bool:
    """Gated delta nets (G) convolve with Megatron's activation function, which must be SiLU
    (Megatron-LM gets it from --swiglu; here an MLP stays ungated without it)."""
    return "G" in (args.hybrid_layer_pattern or "")


def _chunks_count(args) -> int:
    """Model chunks per pipeline rank: a pattern's '|' stages over the ranks, or the GPT
    layers of a rank over --num-layers-per-virtual-pipeline-stage."""
    pp = args.pipeline_model_parallel_size
    if args.hybrid_layer_pattern is not None:
        return max(len(args.hybrid_layer_pattern.split("/")[0].split("|")) // pp, 1)
    layers = args.num_layers_per_virtual_pipeline_stage
    if not layers:
        return 1
    per_rank = args.num_layers // pp
    if per_rank % layers:
        raise SystemExit(f"--num-layers-per-virtual-pipeline-stage {layers} does not divide the "
                         f"{per_rank} layers of a pipeline rank")
    return per_rank // layers


def _forward_step(data_iterator, model):
    """Megatron-LM's GPT step on the segment of the batch (:func:`slice_batch`)."""
    from megatron_seq1f1b.segments.run import slice_batch

    batch = slice_batch(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, partial(_loss, batch["loss_mask"])


def _loss(loss_mask, output):
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1).float()])}


def _documents(args):
    """The rehearsal's packed documents (``--document-length``), or None."""
    if args.document_length is None:
        return None
    from megatron_seq1f1b.segments.documents import long_tailed

    return long_tailed(args.seq_length, args.document_length, args.seed, args.micro_batch_size)


def _batch(args, device) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    b, s = args.micro_batch_size, args.seq_length
    documents = _documents(args)
    eod = args.vocab_size - 1
    tokens = torch.randint(0, eod if documents else args.vocab_size, (b, s), generator=gen)
    for sample in range(b if documents else 0):
        for start in documents.starts[sample][1:]:
            tokens[sample, start - 1] = eod
    return {k: v.to(device) for k, v in dict(
        tokens=tokens, labels=torch.roll(tokens, -1, dims=1),
        loss_mask=torch.ones(b, s), position_ids=torch.arange(s).expand(b, s).contiguous(),
    ).items()}


def _repeat(batch: dict) -> Iterator[dict]:
    while True:
        yield batch


def prepare(args) -> tuple[list, Any, Any]:
    """This stage's chunks (enabled, Float16Module for bf16, Megatron DDP) and optimizer."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from megatron_seq1f1b.attention.flash import flash_layer_spec
    from megatron_seq1f1b.runtime.model_hooks import enable

    _forget_tracked_losses()
    config = _config(args)
    spec = get_gpt_layer_local_spec(normalization=args.normalization,
                                    **({"num_experts": args.num_experts, "moe_grouped_gemm": False}
                                       if args.num_experts else {}))
    if args.attention_backend == "flash":
        spec = flash_layer_spec(spec)
    if args.context_parallel_size > 1:  # rank 0 of the CP group, its peers made up
        from megatron_seq1f1b.attention.context_parallel import context_parallel_layer_spec

        spec = context_parallel_layer_spec(spec)
    chunks = build_stage_chunks(
        config, args.pipeline_model_parallel_size, args.rehearse_stage,
        vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
        num_model_chunks=_chunks_count(args), layer_spec=spec,
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        hybrid_stack_spec=_hybrid_stack_spec(args))
    config = chunks[0].config
    if torch.cuda.is_available():
        chunks = [chunk.cuda() for chunk in chunks]
    if args.seq1f1b_splits > 1 or args.save_calibration:  # the calibration times segments
        enable(chunks)
    if args.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16, use_distributed_optimizer=args.use_distributed_optimizer)
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = None
    if args.optimizer == "adam":
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-5, bf16=args.bf16,
                            params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                            use_distributed_optimizer=args.use_distributed_optimizer),
            model, use_gloo_process_groups=False)
    return model, config, optimizer


def _forget_tracked_losses() -> None:
    """Megatron's MoE and MTP loss trackers are sized by the first model that logs into them:
    a rehearsal in a process that ran another model starts them afresh."""
    from megatron_seq1f1b.base.compat import moe_losses

    moe_losses(reset=True)
    try:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    except ImportError:
        return
    MTPLossLoggingHelper.tracker.clear()


def _hybrid_stack_spec(args):
    """megatron_seq1f1b's local hybrid spec for --hybrid-layer-pattern (None without one)."""
    if args.hybrid_layer_pattern is None:
        return None
    from megatron_seq1f1b.runtime.hybrid_spec import local_hybrid_stack_spec

    return local_hybrid_stack_spec(attention=args.attention_backend,
                                   num_experts=args.num_experts)


def predicted(args, rehearsal: Rehearsal, costs=None) -> dict:
    """The planner's memory prediction for this stage, with the rehearsal's own layout
    (one rank: data-parallel size 1), its segment lengths and, for zero bubble, the
    per-segment costs that placed its W actions (``costs``); recurrent layers as the kernels
    that ran them save (CUDA's, or on CPU the package's references)."""
    from megatron_seq1f1b.planner.footprint import ModelShape, Training
    from megatron_seq1f1b.planner.memory_model import stage_memory
    from megatron_seq1f1b.schedules.schedule import build_schedule

    shape = ModelShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
        ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups,
        gated_linear_unit=args.swiglu, normalization=args.normalization,
        add_bias_linear=not args.disable_bias_linear,
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        max_sequence_length=args.seq_length, hybrid_layer_pattern=args.hybrid_layer_pattern,
        mtp_num_layers=args.mtp_num_layers or 0, num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_router_topk=args.moe_router_topk,
        **recurrent_fields(args))
    training = Training(dtype="bf16" if args.bf16 else "fp32",
                        optimizer=None if args.optimizer == "none" else "adam",
                        distributed_optimizer=args.use_distributed_optimizer)
    schedule = build_schedule(args.pipeline_model_parallel_size, args.num_microbatches,
                              len(rehearsal.lengths), rehearsal.num_model_chunks,
                              schedule=args.seq1f1b_schedule, costs=costs)
    memory = stage_memory(shape, training, args.pipeline_model_parallel_size,
                          args.num_microbatches, rehearsal.lengths,
                          num_model_chunks=rehearsal.num_model_chunks, schedule=schedule,
                          micro_batch_size=args.micro_batch_size,
                          flash=args.attention_backend == "flash",
                          documents=None if args.document_length is None else [_documents(args)],
                          context_parallel_size=args.context_parallel_size,
                          recurrent_kernels="cuda" if torch.cuda.is_available() else "reference")
    mine = [str(a) for a in schedule[args.rehearse_stage]]
    return dict(memory[args.rehearse_stage], same_actions=mine == rehearsal.actions)


def calibrate_stage(model, config, data, args):
    """This stage's per-segment costs as a one-stage :class:`~megatron_seq1f1b.planner.
    Calibration`: the start-up measurement's cases and timing
    (:func:`~megatron_seq1f1b.planner.measure.time_cases`, W apart where it can be deferred),
    fitted with the causal pairs for flash attention and the score rectangle for
    Megatron's local one; on CUDA the host dispatch times are the fits' floors."""
    from megatron_seq1f1b.base.checks import segment_multiple
    from megatron_seq1f1b.planner.costs import Calibration
    from megatron_seq1f1b.planner.measure import calibration_cases, host_floor, time_cases
    from megatron_seq1f1b.runtime import wgrad
    from megatron_seq1f1b.runtime.model_hooks import chunks_of, is_enabled, unwrap

    chunks = chunks_of(model)
    if not is_enabled(chunks):
        raise ValueError("the calibration times segments: enable the model first "
                         "(megatron_seq1f1b.enable)")
    multiple = args.seq1f1b_segment_multiple or segment_multiple(config)
    if torch.cuda.is_available() and args.seq1f1b_segment_multiple is None:
        multiple = max(multiple, 64)
    cases = calibration_cases(args.seq_length, multiple, args.min_segment_length)
    split = not wgrad.deferral_problems(chunks)
    if split:
        wgrad.install()
    samples, floors, held = {}, {}, 0
    iterators = data if isinstance(data, list) else [data]
    for index, chunk in enumerate(chunks):
        gpt = unwrap(chunk)
        host: list = []
        rows, chunk_held = time_cases(chunk, index, cases, iterators[index], _forward_step,
                                      config, args.micro_batch_size, gpt.pre_process,
                                      gpt.post_process, args.calibration_reps, split, host)
        samples[(0, index)] = rows
        if torch.cuda.is_available():
            floors[(0, index)] = host_floor(host)
        held += chunk_held or 0
    _zero_grads(chunks)
    quadratic = "causal_pairs" if args.attention_backend == "flash" else "rectangle"
    return Calibration.from_samples(
        samples, quadratic=quadratic,
        source=f"stage {args.rehearse_stage} of {args.pipeline_model_parallel_size} rehearsed "
               f"alone ({args.num_layers} layers, hidden {args.hidden_size}, "
               f"{args.attention_backend} attention{', bf16' if args.bf16 else ''}), "
               f"cases {cases}" + (", W timed apart" if split else ""),
        bytes_per_token=held / (args.seq_length * args.micro_batch_size) or None,
        floors=floors or None)


def main(argv=None) -> int:
    parser = build_parser()
    args = check_args(parser, parser.parse_args(argv))
    device = _init(args.seed)
    model, config, optimizer = prepare(args)
    batch = _batch(args, device)
    data = [_repeat(batch) for _ in model] if len(model) > 1 else _repeat(batch)
    count = {"auto": None, "yes": True, "no": False}[args.count_saved]
    # every stage of the pipeline is built with this backend: a stage without attention
    # layers cuts as those with them would
    attention = AttentionKind.of_backend(args.attention_backend)
    rehearsal = rehearse_stage(
        model if len(model) > 1 else model[0], _forward_step, data,
        num_stages=args.pipeline_model_parallel_size, stage=args.rehearse_stage,
        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, num_splits=args.seq1f1b_splits,
        partition=args.seq1f1b_partition, schedule=args.seq1f1b_schedule,
        segment_multiple=args.seq1f1b_segment_multiple, iters=args.iters, warmup=args.warmup,
        optimizer=optimizer, count_saved=count,
        documents=args.vocab_size - 1 if args.document_length else None, attention=attention)
    costs = None
    if args.seq1f1b_schedule != "1f1b":
        from megatron_seq1f1b.runtime.executor import zero_bubble_costs

        costs = zero_bubble_costs(rehearsal.lengths, model, config, args.vocab_size, attention)
    prediction = predicted(args, rehearsal, costs)
    result = {"arguments": vars(args), "rehearsal": rehearsal.to_dict(), "predicted": prediction,
              "torch": torch.__version__}
    if args.save_calibration:
        from megatron_seq1f1b.planner.costs import save_calibration

        calibration = calibrate_stage(model if len(model) > 1 else model[0], config, data, args)
        Path(args.save_calibration).parent.mkdir(parents=True, exist_ok=True)
        save_calibration(calibration, args.save_calibration)
        result["calibration"] = args.save_calibration
    _print(args, rehearsal, prediction)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _print(args, r: Rehearsal, prediction: dict) -> None:
    from megatron_seq1f1b.planner.memory_model import bytes_text

    def gib(count: float | None) -> str:
        return "-" if count is None else bytes_text(count)

    print(f"stage {r.stage} of {r.num_stages} ({r.num_model_chunks} chunk(s)), "
          f"m={r.num_microbatches}, k={len(r.lengths)} {args.seq1f1b_partition} "
          f"{r.schedule}, lengths {r.lengths}, on {r.device}")
    print(f"  actions: {len(r.actions)} ({' '.join(r.actions[:8])}{' ...' if len(r.actions) > 8 else ''})")
    print(f"  compute: {r.compute_s * 1e3:.1f} ms per iteration (no waits); iteration wall "
          f"{statistics.median(r.iteration_s) * 1e3:.1f} ms (median of {len(r.iteration_s)})")
    print(f"  parameters: {r.parameters:,} ({gib(r.parameter_bytes)})")
    print(f"  peak above the start: {gib(r.peak_bytes)}; CUDA peak total: "
          f"{gib(r.peak_total_bytes)} (reserved {gib(r.peak_reserved_bytes)}); saved for "
          f"backward: {gib(r.activation_bytes)}")
    print(f"  planner: weights {gib(prediction['weights'])}, gradients "
          f"{gib(prediction['gradients'])}, optimizer {gib(prediction['optimizer'])}, "
          f"activations {gib(prediction['activations'])}, total {gib(prediction['total'])}")
    if r.warning:
        print(f"  note: {r.warning}")


if __name__ == "__main__":
    raise SystemExit(main())
