"""One model per layer-to-rank layout, holding the same weights, and one fixed set of batches.

The non-interleaved ("plain") layout always exists; with ``--vpp`` an
interleaved one is built too and receives the plain model's weights, so that
every schedule trains the same network on the same micro-batches.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class Layout:
    """A model built for one layer-to-rank map, with the trainer flags and config it came from."""

    name: str
    targs: argparse.Namespace
    config: object
    model: list  # DDP-wrapped chunks of this rank
    vpp: int | None

    @property
    def chunks(self) -> int:
        return len(self.model)

    def activate(self) -> None:
        """Megatron reads the virtual pipeline size from global state: set it for this layout."""
        from megatron.core import parallel_state

        parallel_state.set_virtual_pipeline_model_parallel_world_size(self.vpp)


def trainer_argv(args: argparse.Namespace, interleaved: bool) -> list[str]:
    """The standalone trainer's flags for one layout (reuses its validation and setup)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp = getattr(args, "context_parallel_size", 1)
    dp = max(world // (args.tp * args.pp * cp), 1)  # CP ranks of a replica share its batch
    argv = [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--vocab-size", str(args.vocab_size),
        "--position-embedding-type", args.position_embedding_type, "--mock-data",
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.micro_batch_size * args.microbatches * dp),
        "--tensor-model-parallel-size", str(args.tp),
        "--pipeline-model-parallel-size", str(args.pp),
        "--seed", str(args.seed), "--train-iters", "1",
        "--seq1f1b", "--seq1f1b-splits", str(args.splits),  # build_model enables segments
        "--attention-backend", getattr(args, "attention_backend", "local"),
    ]
    if getattr(args, "document_length", None) is not None:
        # packed documents (bench/packing.py): the trainer then says which form each
        # schedule takes and where Seq1F1B finds the documents
        argv += ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    if cp > 1:
        argv += ["--context-parallel-size", str(cp)]
    if args.sequence_parallel:
        argv.append("--sequence-parallel")
    if args.bf16:
        argv.append("--bf16")
    if args.window_size is not None:
        argv += ["--window-size", f"({args.window_size}, 0)"]
    if args.num_experts:
        argv += ["--num-experts", str(args.num_experts), "--moe-router-topk",
                 str(args.moe_router_topk), "--moe-aux-loss-coeff", str(args.moe_aux_loss_coeff),
                 "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]
    if args.window_attn_skip_freq is not None:
        argv += ["--window-attn-skip-freq", str(args.window_attn_skip_freq)]
    if getattr(args, "swiglu", False):
        argv.append("--swiglu")
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is not None:
        argv.append(f"--hybrid-layer-pattern={pattern}")  # it may begin with a '-'
        from megatron_seq1f1b.planner.model_flags import recurrent_fields

        for name, value in recurrent_fields(args).items():
            argv += [f"--{name.replace('_', '-')}", str(value)]
    if interleaved:
        argv += ["--num-layers-per-virtual-pipeline-stage",
                 str(args.num_layers // (args.pp * args.vpp))]
    return argv


def build_layouts(args: argparse.Namespace, plain_args: argparse.Namespace,
                  model_provider: Callable, world: int) -> dict[str, Layout]:
    """{"plain": ..., and with --vpp "interleaved": ...}; collective (weights are exchanged)."""
    from megatron.core import parallel_state

    from megatron_seq1f1b.trainer import arguments, setup

    tied = True  # the trainer's default (no --untie-embeddings-and-output-weights)
    layouts = {}
    plain_config = setup.transformer_config(plain_args)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    layouts["plain"] = Layout("plain", plain_args, plain_config,
                              setup.build_model(plain_args, plain_config, model_provider), None)
    if args.vpp:
        inter_args = arguments.parse(trainer_argv(args, True), world)
        inter_config = setup.transformer_config(inter_args)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(args.vpp)
        layouts["interleaved"] = Layout("interleaved", inter_args, inter_config,
                                        setup.build_model(inter_args, inter_config,
                                                          model_provider), args.vpp)
        copy_weights_across_layouts(layouts["plain"], layouts["interleaved"], tied)
    return layouts


def _global_name(gpt, name: str, tied: bool) -> str:
    """A parameter's name independent of the layout: layers by global number."""
    if name.startswith("decoder.layers."):
        _, _, index, rest = name.split(".", 3)
        return f"layer{gpt.decoder.layers[int(index)].layer_number}.{rest}"
    if name == "output_layer.weight" and tied:
        return "embedding.word_embeddings.weight"
    return name


def _named_global_params(model: list, tied: bool) -> dict:
    from megatron_seq1f1b.runtime.model_hooks import unwrap

    params = {}
    for chunk in model:
        gpt = unwrap(chunk)
        for name, param in gpt.named_parameters():
            params[_global_name(gpt, name, tied)] = param
    return params


def copy_weights_across_layouts(src: Layout, dst: Layout, tied: bool) -> None:
    """Give `dst` (other layer-to-rank map) exactly the weights of `src` (collective)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    mine = {name: p.detach().cpu().clone()
            for name, p in _named_global_params(src.model, tied).items()}
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (tp_rank, mine))
    table = {}
    for their_tp, params in everything:
        if their_tp == tp_rank:
            table.update(params)
    with torch.no_grad():
        for name, param in _named_global_params(dst.model, tied).items():
            param.copy_(table[name].to(param.device))


def microbatches(targs: argparse.Namespace, args: argparse.Namespace) -> list[dict]:
    """This data-parallel rank's m micro-batches, materialized once and reused by every run."""
    from megatron.core import parallel_state

    from megatron_seq1f1b.trainer import data

    tokenizer = data.make_tokenizer(targs)
    train, _ = data.build_datasets(targs, tokenizer, train_samples=targs.global_batch_size,
                                   eval_samples=1)
    dp_rank = parallel_state.get_data_parallel_rank()
    stream = data.batches(train, targs.micro_batch_size, dp_rank, targs.data_parallel_size)
    return [next(stream) for _ in range(args.microbatches)]
