"""Stage rehearsal: one stage of a P-stage pipeline, run alone on one device.

One GPU cannot run a multi-stage pipeline (NCCL refuses two ranks on one
device), yet whether a configuration fits and how long each stage computes is
decided stage by stage. A schedule is data, so one stage can be run by
itself: :func:`rehearse_stage` runs exactly that stage's steps of the
``num_stages`` pipeline (the executor's ``rehearse=(num_stages, stage)``):
every receive is a made-up tensor of the message's shape and dtype, every send
is dropped, there is no stage agreement. With that stage's own model chunks
(:func:`build_stage_chunks`: the first stage has the embedding, the last the
output layer and the loss, interleaved ranks their virtual stages) the stage's
real peak memory and its compute time without waits are measured for a
pipeline that does not fit the machine. What a stage never sees alone: the
time it would wait for its neighbours (the planner's replay adds it).

Megatron's parallel state is initialized with pipeline size 1 (one rank); each
chunk is a ``GPTModel`` of its virtual stage's layers, numbered from 1 (layer
numbers decide nothing in the dense models supported here: layer patterns such
as ``moe_layer_freq`` or ``window_attn_skip_freq`` are refused). Weights are
random: only shapes and work matter.

Command line (world size 1; gloo on CPU, NCCL on a GPU)::

    python -m megatron_seq1f1b.rehearse --num-layers 24 --hidden-size 2048 \\
        --num-attention-heads 16 --ffn-hidden-size 8192 --vocab-size 50257 \\
        --seq-length 32768 --bf16 --attention-backend flash \\
        --pipeline-model-parallel-size 4 --rehearse-stage 0 --num-microbatches 4 \\
        --seq1f1b-splits 4 --seq1f1b-partition balanced --json stage0.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from megatron_seq1f1b.base.flags import ArgumentParser, non_negative_int, positive_int
from megatron_seq1f1b.planner.footprint import layers_per_virtual_stage
from megatron_seq1f1b.schedules.interleaved import ZB_H2_PROBLEM
from megatron_seq1f1b.schedules.partition import split_sequence

GIB = 2.0 ** 30

__all__ = ["Rehearsal", "build_stage_chunks", "rehearse_stage", "stage_layer_problems", "main"]


# ------------------------------------------------------------------ the stage's model


def stage_layer_problems(config) -> list[str]:
    """What a stage built with its own layer numbering would get wrong."""
    problems = []
    freq = getattr(config, "moe_layer_freq", 1)
    if getattr(config, "num_moe_experts", None) and freq != 1:
        problems.append(f"moe_layer_freq={freq!r}: which layers are MoE depends on their global "
                        "numbers, which a rehearsed stage does not keep")
    if getattr(config, "window_attn_skip_freq", None) is not None:
        problems.append("window_attn_skip_freq: which layers are windowed depends on their "
                        "global numbers, which a rehearsed stage does not keep")
    for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                 "pipeline_model_parallel_layout"):
        if getattr(config, name, None) is not None:
            problems.append(f"{name}: uneven pipeline stages are not rehearsed (even splits only)")
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(config, name, False):
            problems.append(f"{name}: not rehearsed (even splits of the layers only)")
    return problems


def build_stage_chunks(config, num_stages: int, stage: int, *, vocab_size: int,
                       max_sequence_length: int, num_model_chunks: int = 1,
                       layer_spec=None, tied_embeddings: bool = False,
                       position_embedding_type: str = "rope") -> list:
    """The ``GPTModel`` chunk(s) pipeline rank ``stage`` of ``num_stages`` holds, built on
    one rank (Megatron's parallel state must have pipeline size 1).

    ``config``: the whole model's TransformerConfig (``num_layers`` of all stages); every
    chunk gets a copy with its virtual stage's layers and pipeline size 1 (one config
    object shared by the chunks, as Megatron-LM does). Virtual stage ``chunk *
    num_stages + stage`` has the embedding if it is the first, the final norm, output
    layer and loss if it is the last. ``layer_spec``: default Megatron's local spec.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_seq1f1b.base.checks import raise_if

    problems = stage_layer_problems(config)
    if not 0 <= stage < num_stages:
        problems.append(f"stage must be in [0, {num_stages}), got {stage}")
    if num_model_chunks > 1 and num_stages < 2:
        problems.append("several model chunks per rank (interleaving) need num_stages >= 2")
    if parallel_state.model_parallel_is_initialized() \
            and parallel_state.get_pipeline_model_parallel_world_size() != 1:
        problems.append("initialize Megatron's parallel state with pipeline size 1: a "
                        "rehearsed stage runs alone")
    virtual = num_stages * num_model_chunks
    try:
        layers = layers_per_virtual_stage(config.num_layers, virtual)
    except ValueError as exc:
        problems.append(str(exc))
    raise_if(problems)
    chunk_config = dataclasses.replace(
        config, num_layers=layers, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        pipeline_dtype=config.pipeline_dtype or config.params_dtype)
    spec = layer_spec or get_gpt_layer_local_spec(normalization=config.normalization)
    chunks = []
    for chunk in range(num_model_chunks):
        vs = chunk * num_stages + stage
        chunks.append(GPTModel(
            config=chunk_config, transformer_layer_spec=spec, vocab_size=vocab_size,
            max_sequence_length=max_sequence_length, pre_process=vs == 0,
            post_process=vs == virtual - 1, share_embeddings_and_output_weights=tied_embeddings,
            position_embedding_type=position_embedding_type))
    return chunks


# ------------------------------------------------------------------ the rehearsal


@dataclasses.dataclass
class Rehearsal:
    """What one stage did alone: its actions, their times, its memory.

    Times are the last iteration's (``action_s`` per action, ``compute_s`` their sum) and
    every measured iteration's wall time. Memory of the measured iterations, in bytes:
    ``peak_bytes`` the most real allocations above the start of an iteration (CUDA
    allocator; CPU resident set, see :class:`~megatron_seq1f1b.planner.peak_memory.PeakMemory`),
    ``peak_total_bytes`` the CUDA allocator's peak including weights, gradients and
    optimizer states (None on CPU), ``activation_bytes`` the most bytes autograd held
    for backward (:class:`~megatron_seq1f1b.planner.peak_memory.SavedActivations`; None unless counted).
    """

    num_stages: int
    stage: int
    num_model_chunks: int
    num_microbatches: int
    lengths: list[int]
    schedule: str
    actions: list[str]
    action_s: list[float]
    compute_s: float
    iteration_s: list[float]
    peak_bytes: int
    peak_total_bytes: int | None
    peak_reserved_bytes: int | None
    activation_bytes: int | None
    parameter_bytes: int
    parameters: int
    device: str
    warning: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _zero_grads(chunks) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        chunk.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _finalize_on_real_groups(config):
    """The executor hands ``finalize_model_grads_func`` the rehearsal's process groups,
    whose pipeline group only stands in (it has no peers); the gradients' reductions run
    on Megatron's real groups of this one rank instead."""
    original = config.finalize_model_grads_func
    if original is None:
        yield
        return

    def finalize(chunks, num_tokens=None, pg_collection=None, force_all_reduce=False):
        return original(chunks, num_tokens, force_all_reduce=force_all_reduce)

    config.finalize_model_grads_func = finalize
    try:
        yield
    finally:
        config.finalize_model_grads_func = original


def _lengths(chunks, config, num_splits, partition, split_lengths, seq_length,
             segment_multiple, documents=None) -> list[int]:
    """The segment lengths the executor ran (its own rounding on CUDA included; the
    documents partition: those of the rehearsal's micro-batch, which every one repeats)."""
    from megatron.core.utils import get_attr_wrapped_model

    from megatron_seq1f1b.runtime.executor import document_cut, resolve_lengths
    from megatron_seq1f1b.schedules.partition import split_documents

    try:
        vocab_size = get_attr_wrapped_model(chunks[0], "vocab_size")
    except RuntimeError:
        vocab_size = None
    if partition == "documents" and split_lengths is None:
        costs, multiple = document_cut(chunks, config, vocab_size, segment_multiple)
        return split_documents(documents, num_splits, costs, multiple_of=multiple)
    return resolve_lengths(num_splits, partition, split_lengths, seq_length, chunks, config,
                           vocab_size, segment_multiple)


def documents_of(data_iterator, source, seq_length: int):
    """The documents of the next micro-batch ``data_iterator`` yields (a rehearsal repeats
    one), or None."""
    if source is None:
        return None
    from megatron_seq1f1b.segments.document_plan import read_documents

    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    return read_documents(source, next(iterator), seq_length)


def rehearse_stage(
    model,
    forward_step_func: Callable,
    data_iterator: Iterator | list | None,
    *,
    num_stages: int,
    stage: int,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    num_splits: int = 1,
    partition: str = "uniform",
    split_lengths: Sequence[int] | None = None,
    schedule: str = "1f1b",
    segment_costs=None,
    segment_multiple: int | None = None,
    iters: int = 1,
    warmup: int = 0,
    optimizer=None,
    count_saved: bool | None = None,
    documents=None,
) -> Rehearsal:
    """Run stage ``stage`` of a ``num_stages`` pipeline alone; ``warmup`` + ``iters``
    iterations, the last ``iters`` measured.

    ``model``: that stage's chunk(s) (:func:`build_stage_chunks`; wrapped or not, Seq1F1B-
    enabled when ``num_splits > 1``); ``data_iterator`` as Megatron's (one per chunk for
    several), yielding at least ``num_microbatches`` per iteration. Scheduling arguments
    as :func:`megatron_seq1f1b.get_forward_backward_func`'s. ``optimizer``: stepped after
    every iteration (its states then count in the CUDA total). ``count_saved``: count
    the bytes autograd saves (default on CPU, where the allocator cannot tell; it costs
    host time per operation). ``documents``: where each micro-batch's packed documents
    are (:func:`megatron_seq1f1b.get_forward_backward_func`'s argument).
    """
    from megatron.core.utils import get_model_config

    from megatron_seq1f1b.planner.peak_memory import PeakMemory, SavedActivations
    from megatron_seq1f1b.runtime import executor
    from megatron_seq1f1b.runtime.model_hooks import chunks_of, unwrap
    from megatron_seq1f1b.runtime.trace import TimelineRecorder

    chunks = chunks_of(model)
    config = get_model_config(chunks[0])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    on_gpu = device.type == "cuda"
    count_saved = (not on_gpu) if count_saved is None else count_saved
    params = [p for chunk in chunks for p in unwrap(chunk).parameters()]
    meter = SavedActivations(exclude=params) if count_saved else None
    memory = PeakMemory(device)
    recorder = TimelineRecorder()
    walls, peaks, totals, reserved, saved = [], [], [], [], []
    call = partial(
        executor.forward_backward, forward_step_func=forward_step_func,
        data_iterator=data_iterator, model=model, num_microbatches=num_microbatches,
        seq_length=seq_length, micro_batch_size=micro_batch_size, num_splits=num_splits,
        partition=partition, split_lengths=split_lengths, recorder=recorder, schedule=schedule,
        segment_costs=segment_costs, segment_multiple=segment_multiple,
        rehearse=(num_stages, stage), documents=documents)
    with _finalize_on_real_groups(config), (meter or contextlib.nullcontext()):
        for iteration in range(warmup + iters):
            _zero_grads(chunks)
            if optimizer is not None:
                optimizer.zero_grad()
            if on_gpu:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            memory.reset()
            if meter is not None:
                meter.reset()
            start = time.perf_counter()
            call()
            if optimizer is not None:
                optimizer.step()
            if on_gpu:
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - start
            if iteration < warmup:
                continue
            walls.append(wall)
            peaks.append(memory.peak_above_baseline())
            if on_gpu:
                totals.append(torch.cuda.max_memory_allocated(device))
                reserved.append(torch.cuda.max_memory_reserved(device))
            if meter is not None:
                saved.append(meter.peak_bytes)
    _zero_grads(chunks)
    lengths = _lengths(chunks, config, num_splits, partition, split_lengths, seq_length,
                       segment_multiple, documents_of(data_iterator, documents, seq_length))
    record = recorder.last
    action_s = [iv.end - iv.start for iv in record.compute]
    return Rehearsal(
        num_stages=num_stages, stage=stage, num_model_chunks=len(chunks),
        num_microbatches=num_microbatches,
        lengths=lengths,
        schedule=schedule, actions=[str(iv.action) for iv in record.compute],
        action_s=action_s, compute_s=sum(action_s), iteration_s=walls,
        peak_bytes=max(peaks), peak_total_bytes=max(totals) if totals else None,
        peak_reserved_bytes=max(reserved) if reserved else None,
        activation_bytes=max(saved) if saved else None,
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        parameters=sum(p.numel() for p in params), device=str(device),
        warning=memory.warning)


# ------------------------------------------------------------------ command line


def build_parser() -> ArgumentParser:
    """The rehearsal's flags; every number is checked as it is read."""
    p = ArgumentParser(
        prog="python -m megatron_seq1f1b.rehearse",
        description="Run one stage of a pipeline alone on this device (stand-in messages): "
                    "its peak memory and compute time, and the planner's prediction for it.")
    model = p.add_argument_group("model (the trainer's flags)")
    model.add_argument("--num-layers", type=positive_int, required=True, help="of the whole model")
    model.add_argument("--hidden-size", type=positive_int, required=True)
    model.add_argument("--num-attention-heads", type=positive_int, required=True)
    model.add_argument("--ffn-hidden-size", type=positive_int, default=None,
                       help="default 4 * hidden")
    model.add_argument("--num-query-groups", type=positive_int, default=None)
    model.add_argument("--seq-length", type=positive_int, required=True)
    model.add_argument("--vocab-size", type=positive_int, required=True)
    model.add_argument("--swiglu", action="store_true")
    model.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    model.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"],
                       default="rope")
    model.add_argument("--tie-embeddings", action="store_true",
                       help="share embedding and output weights (default: untied)")
    model.add_argument("--bf16", action="store_true")
    model.add_argument("--attention-backend", choices=["local", "flash"], default="local")
    par = p.add_argument_group("pipeline")
    par.add_argument("--pipeline-model-parallel-size", type=positive_int, required=True)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None)
    par.add_argument("--rehearse-stage", type=non_negative_int, required=True)
    par.add_argument("--context-parallel-size", type=positive_int, default=1,
                     help="rehearse rank 0 of a context-parallel group of this size (its peers' "
                          "keys and values made up; needs --seq1f1b-splits' segments to divide "
                          "into 2 x this many chunks)")
    par.add_argument("--micro-batch-size", type=positive_int, default=1)
    par.add_argument("--num-microbatches", type=positive_int, required=True)
    par.add_argument("--seq1f1b-splits", type=positive_int, default=1)
    par.add_argument("--seq1f1b-partition", choices=["uniform", "balanced", "documents"],
                     default="uniform", help="documents: needs --document-length")
    par.add_argument("--document-length", type=positive_int, default=None, metavar="N",
                     help="pack documents of about N tokens (log-normal lengths) into every "
                          "micro-batch, ended by the last vocabulary id; attention keeps them "
                          "apart and the prediction follows them")
    par.add_argument("--seq1f1b-schedule", choices=["1f1b", "zb-h1", "zb-h2"], default="1f1b")
    par.add_argument("--seq1f1b-segment-multiple", type=positive_int, default=None)
    train = p.add_argument_group("training state")
    train.add_argument("--optimizer", choices=["adam", "none"], default="adam",
                       help="adam: Megatron's (its states count in the peak); none: weights "
                            "and gradients only")
    train.add_argument("--use-distributed-optimizer", action="store_true",
                       help="(one rank: shards over a data-parallel size of 1)")
    p.add_argument("--iters", type=positive_int, default=2, help="measured iterations")
    p.add_argument("--warmup", type=non_negative_int, default=1,
                   help="iterations before measuring (the optimizer's states appear in the "
                        "first step)")
    p.add_argument("--count-saved", choices=["auto", "yes", "no"], default="auto",
                   help="count the bytes autograd saves (default: on CPU only)")
    p.add_argument("--save-calibration", metavar="FILE",
                   help="also time this stage's segments (the start-up measurement's cases) "
                        "and write them as a one-stage planner calibration")
    p.add_argument("--calibration-reps", type=positive_int, default=3)
    p.add_argument("--min-segment-length", type=positive_int, default=128,
                   help="shortest segment the calibration times (the planner's)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--seed", type=non_negative_int, default=1234)
    return p

def check_args(parser: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """What needs several flags, before anything is built: one line and status 2 if it fails."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if args.rehearse_stage >= pp:
        parser.error(f"--rehearse-stage {args.rehearse_stage}: a {pp}-stage pipeline "
                     f"(--pipeline-model-parallel-size) has stages 0 to {pp - 1}")
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
    if args.hidden_size % args.num_attention_heads:
        parser.error(f"--hidden-size {args.hidden_size} must divide by --num-attention-heads "
                     f"{args.num_attention_heads}")
    if args.num_query_groups and args.num_attention_heads % args.num_query_groups:
        parser.error(f"--num-query-groups {args.num_query_groups} must divide "
                     f"--num-attention-heads {args.num_attention_heads}")
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
    vpp_layers = args.num_layers_per_virtual_pipeline_stage
    vpp = (args.num_layers // (vpp_layers * args.pipeline_model_parallel_size)
           if vpp_layers else None)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups, normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=dtype, params_dtype=dtype,
        bf16=args.bf16, use_cpu_initialization=not cuda,
        masked_softmax_fusion=False, bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True, context_parallel_size=args.context_parallel_size)


def _chunks_count(args) -> int:
    layers = args.num_layers_per_virtual_pipeline_stage
    if not layers:
        return 1
    per_rank = args.num_layers // args.pipeline_model_parallel_size
    if per_rank % layers:
        raise SystemExit(f"--num-layers-per-virtual-pipeline-stage {layers} does not divide the "
                         f"{per_rank} layers of a pipeline rank")
    return per_rank // layers


def _forward_step(data_iterator, model):
    """Megatron-LM's GPT step on the segment of the batch (:func:`slice_batch`)."""
    from megatron_seq1f1b.segments.run import slice_batch

    batch = slice_batch(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
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

    config = _config(args)
    spec = get_gpt_layer_local_spec(normalization=args.normalization)
    if args.attention_backend == "flash":
        spec = flash_layer_spec(spec)
    if args.context_parallel_size > 1:  # rank 0 of the CP group, its peers made up
        from megatron_seq1f1b.attention.context_parallel import context_parallel_layer_spec

        spec = context_parallel_layer_spec(spec)
    chunks = build_stage_chunks(
        config, args.pipeline_model_parallel_size, args.rehearse_stage,
        vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
        num_model_chunks=_chunks_count(args), layer_spec=spec,
        tied_embeddings=args.tie_embeddings,
        position_embedding_type=args.position_embedding_type)
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


def predicted(args, rehearsal: Rehearsal, costs=None) -> dict:
    """The planner's memory prediction for this stage, with the rehearsal's own layout
    (one rank: data-parallel size 1), its segment lengths and, for zero bubble, the
    per-segment costs that placed its W actions (``costs``)."""
    from megatron_seq1f1b.planner.footprint import ModelShape, Training
    from megatron_seq1f1b.planner.memory_model import stage_memory
    from megatron_seq1f1b.schedules.schedule import build_schedule

    shape = ModelShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
        ffn_hidden_size=args.ffn_hidden_size, num_query_groups=args.num_query_groups,
        gated_linear_unit=args.swiglu, normalization=args.normalization,
        tied_embeddings=args.tie_embeddings,
        position_embedding_type=args.position_embedding_type,
        max_sequence_length=args.seq_length)
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
                          context_parallel_size=args.context_parallel_size)
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
    rehearsal = rehearse_stage(
        model if len(model) > 1 else model[0], _forward_step, data,
        num_stages=args.pipeline_model_parallel_size, stage=args.rehearse_stage,
        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, num_splits=args.seq1f1b_splits,
        partition=args.seq1f1b_partition, schedule=args.seq1f1b_schedule,
        segment_multiple=args.seq1f1b_segment_multiple, iters=args.iters, warmup=args.warmup,
        optimizer=optimizer, count_saved=count,
        documents=args.vocab_size - 1 if args.document_length else None)
    costs = None
    if args.seq1f1b_schedule != "1f1b":
        from megatron_seq1f1b.runtime.executor import zero_bubble_costs

        costs = zero_bubble_costs(rehearsal.lengths, model, config, args.vocab_size)
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
