"""``python -m megatron_seq1f1b.planner``: plan k, partition and schedule offline, from costs.

Without a calibration the offline command line turns FLOPs into seconds at
:data:`OFFLINE_FLOP_RATE` and charges every unit (one segment through one
stage) :data:`OFFLINE_HOST_SECONDS_PER_LAYER` of host time per layer of the
stage: the fixed cost that makes many short segments slower than few (FLOPs
alone chose k=16 for a 7B model at 32k tokens; see docs/design.md). With
``--tp`` (Megatron-LM's ``--tensor-model-parallel-size``) a rank computes 1/TP
of the FLOPs and pays the TP group's all-reduces at ``--tp-bandwidth-gbps``,
and memory is per TP rank (``--sequence-parallel`` splits the rest of the
activations)::

    python -m megatron_seq1f1b.planner --seq-length 32768 --pp 4 --microbatches 8 \\
        (--calibration calib.json | --hidden-size 4096 --num-layers 32 ...) \\
        [--tp 2 --sequence-parallel] [--top 5] \\
        [--memory-budget-microbatches 2.0 | --memory-budget-gib 40 --bytes-per-token 65536] \\
        [--vocab-size 50257 --bf16 --data-parallel-size 2 --use-distributed-optimizer \\
         --gpu-memory-gib 80]     # GB per stage: weights, gradients, optimizer, activations

It prints what it planned for and the costs in words, the chosen flags (and,
where the tie rule kept a plan slower than the fastest, by how much and why),
Megatron-Core's own 1F1B (and interleaved 1F1B with ``--vpp``) on the same costs with
the speed and memory ratios (:mod:`~megatron_seq1f1b.planner.report`), the ``--top``
fastest candidates, the winner's memory, and whether memory was checked against a GPU
(without ``--gpu-memory-gib``: the busiest stage against common GPU sizes). Candidates
that cannot be among the ``--top`` are not timed (``--top 0`` times every one).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from megatron_seq1f1b.base.checks import attention_shape_problems, segment_multiple
from megatron_seq1f1b.base.flags import (
    ArgumentParser, OldSpelling, fraction, integer, non_negative_float, non_negative_int,
    output_file, positive_float, positive_int,
)
from megatron_seq1f1b.planner.choice import TIE_TOLERANCE, BudgetError, Plan, tie_note
from megatron_seq1f1b.planner.costs import Calibration, Fit, load_calibration, save_calibration
from megatron_seq1f1b.planner.footprint import ModelShape, Training
from megatron_seq1f1b.planner.memory_model import GIB, MemoryModel
from megatron_seq1f1b.planner.model_flags import (
    add_recurrent_arguments, pattern_stages, read_hybrid_pattern, recurrent_fields,
)
from megatron_seq1f1b.planner.recurrent import KERNELS
from megatron_seq1f1b.planner.report import (
    baseline_lines, cap_note, chosen_flags, megatron_baselines, memory_lines,
)
from megatron_seq1f1b.planner.search import MAX_SPLITS, RUNTIME_TIMING, choose_plan
from megatron_seq1f1b.schedules.interleaved import ZB_H2_PROBLEM
from megatron_seq1f1b.schedules.partition import METHODS, CostModel
from megatron_seq1f1b.schedules.replay import TIMINGS
from megatron_seq1f1b.schedules.schedule import SCHEDULES

#: Offline plans without a calibration: sustained FLOP/s of a large GPU in bf16 (about 40 %
#: of an H100/H200's dense peak; only ratios between plans matter, not the absolute time).
OFFLINE_FLOP_RATE = 400e12
#: ... and the host time one unit pays per transformer layer of its stage, forward and
#: backward together (half each): Megatron-Core's Python dispatch of the local layer spec, the
#: GPU idle meanwhile, measured on an H200 with torch 2.11 (17-23 ms for a 4-layer chunk
#: whatever the segment length up to ~2k tokens; one H200, bf16, 2026-12-04: docs/gpu.md).
OFFLINE_HOST_SECONDS_PER_LAYER = 4.75e-3
#: Default bus bandwidth (GB/s, as nccl-tests reports busbw) of a tensor-parallel group's
#: all-reduces: a conservative figure for NVLink inside one node (measure yours with
#: nccl-tests' all_reduce_perf); TP across nodes gets the network's.
TP_BANDWIDTH_GBPS = 200.0
#: Candidates the command line lists by default (--top; 0 lists all).
TOP = 5

# ------------------------------------------------------------------ command line


def build_parser() -> ArgumentParser:
    """The planner's flags; every number is checked as it is read (:mod:`~.flags`)."""
    parser = ArgumentParser(
        prog="python -m megatron_seq1f1b.planner",
        description="Pick segments per micro-batch, partition and schedule from per-segment "
                    "costs (a calibration file, or FLOPs of the model) and a memory budget.")
    parser.add_argument("--seq-length", type=positive_int, required=True, metavar="TOKENS",
                        help="tokens per sample (Megatron's --seq-length)")
    parser.add_argument("--pp", type=positive_int, required=True, metavar="STAGES",
                        help="pipeline stages (Megatron's --pipeline-model-parallel-size)")
    parser.add_argument("--vpp", type=positive_int, default=1, metavar="CHUNKS",
                        help="model chunks per pipeline rank (interleaving; default 1)")
    parser.add_argument("--microbatches", type=positive_int, required=True, metavar="M",
                        help="micro-batches per iteration and data-parallel rank (global batch "
                             "/ (micro-batch size x data-parallel size))")
    parser.add_argument("--micro-batch-size", type=positive_int, default=1, metavar="SAMPLES",
                        help="samples per micro-batch (default 1; scales activation memory)")
    parser.add_argument("--tensor-model-parallel-size", "--tp", type=positive_int, default=1,
                        dest="tensor_model_parallel_size", metavar="TP",
                        help="tensor-parallel ranks per stage, as Megatron-LM's flag: per rank "
                             "1/TP of the FLOPs, of the split layers' weights, gradients and "
                             "optimizer states and of their activations, plus the TP "
                             "all-reduces (FLOP costs only: a --calibration measured with TP "
                             "has it in its times, then --tp only sizes memory and segment "
                             "lengths; default 1)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp > 1, as Megatron-LM's flag: the norms' and linear "
                             "inputs' activations split over TP too, and every segment's "
                             "tokens must divide by TP (ignored with --tp 1, as Megatron-LM "
                             "does)")
    parser.add_argument("--tp-bandwidth-gbps", type=positive_float, default=TP_BANDWIDTH_GBPS,
                        metavar="GB/S",
                        help="with --tp and FLOP costs: the TP group's bus bandwidth in GB/s "
                             "(nccl-tests' busbw: an all-reduce of N bytes takes 2(TP-1)/TP x "
                             "N / busbw seconds); 2 all-reduces of a layer's [tokens x hidden] "
                             "activations per layer in the forward (with --sequence-parallel "
                             "2 all-gathers and 2 reduce-scatters, as many bytes), as many in "
                             f"the backward (default {TP_BANDWIDTH_GBPS:g}: NVLink inside a "
                             "node, conservatively; TP across nodes gets the network's, e.g. "
                             "50 for 400 Gb/s)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="measured costs: a calibration JSON (--save-calibration, the "
                             "trainer's start-up measurement) or a benchmark's results.json; "
                             "without it, costs come from the model's FLOPs")
    parser.add_argument("--layout", choices=["plain", "interleaved"], default=None,
                        help="with --calibration a benchmark's results.json: which of its fits, "
                             "plain (default) or interleaved")
    model = parser.add_argument_group("model (FLOP costs; the balanced partition)")
    model.add_argument("--hidden-size", type=positive_int, metavar="H",
                       help="hidden size (width of the residual stream)")
    model.add_argument("--num-layers", type=positive_int, metavar="LAYERS",
                       help="transformer layers of the whole model")
    model.add_argument("--num-attention-heads", type=positive_int, metavar="HEADS",
                       help="attention heads (query heads with GQA)")
    model.add_argument("--num-query-groups", type=positive_int, metavar="GROUPS",
                       help="key/value heads with grouped-query attention (default: one per "
                            "head)")
    model.add_argument("--ffn-hidden-size", type=positive_int, metavar="FFN",
                       help="MLP width (default 4 x --hidden-size)")
    model.add_argument("--swiglu", action="store_true",
                       help="gated linear unit (SwiGLU): the MLP's first layer twice as wide")
    model.add_argument("--hybrid-layer-pattern", metavar="PATTERN",
                       help="a HybridModel's layers, one symbol each (Megatron-LM's flag): '*' "
                            "attention, '-' MLP, 'E' MoE (with --num-experts), 'M' Mamba-2, 'G' "
                            "gated delta net (sized by --mamba-* / --linear-*); '|' between "
                            "virtual pipeline stages (--pp x --vpp of them, or none: an even "
                            "split), '/' before each multi-token-prediction depth's layers. Sets "
                            "--num-layers; FLOPs and memory per stage by layer kind")
    model.add_argument("--mtp-num-layers", type=positive_int, metavar="DEPTHS",
                       help="multi-token prediction depths on the last stage (a GPTModel's: a "
                            "layer like its last, a projection and one more output layer each; "
                            "with --hybrid-layer-pattern its '/' parts set it)")
    model.add_argument("--num-experts", type=positive_int, metavar="EXPERTS",
                       help="MoE experts per MoE layer (every GPTModel layer, or the pattern's "
                            "E layers)")
    model.add_argument("--moe-router-topk", type=positive_int, default=2, metavar="K",
                       help="experts each token visits (default 2)")
    model.add_argument("--moe-ffn-hidden-size", type=positive_int, metavar="FFN",
                       help="each expert's MLP width (default --ffn-hidden-size)")
    model.add_argument("--moe-shared-expert-intermediate-size", type=positive_int, metavar="FFN",
                       help="a shared expert's MLP width (default: none)")
    model.add_argument("--vocab-size", type=positive_int, metavar="TOKENS",
                       help="vocabulary size: the output layer's FLOPs, and needed for memory "
                            "per stage")
    add_recurrent_arguments(model)
    model.add_argument("--recurrent-kernels", choices=KERNELS, default="cuda",
                       help="what runs M and G layers, for their activations: cuda (default: "
                            "mamba_ssm, causal-conv1d, fla) or reference (the package's torch "
                            "kernels on CPU, which keep [chunk x chunk] blocks per head)")
    model.add_argument("--dense-attention", action="store_true",
                       help="attention computes the masked scores too (non-flash kernels)")
    parser.add_argument("--memory-budget-microbatches", "--memory-budget", type=positive_float,
                        dest="memory_budget_microbatches", metavar="N", action=OldSpelling,
                        old="--memory-budget", why="micro-batches of a stage, not MB",
                        help="peak activations per stage, in micro-batches of a stage (1F1B's "
                             "first stage holds --pp); --memory-budget is its old spelling")
    parser.add_argument("--memory-budget-gib", type=positive_float, metavar="GIB",
                        help="peak activations per stage in GiB (as the trainer's "
                             "--seq1f1b-memory-budget); needs --bytes-per-token or a "
                             "calibration that has them")
    parser.add_argument("--bytes-per-token", type=positive_float, metavar="BYTES",
                        help="activation bytes one token of one sample leaves on a stage's "
                             "rank, as measured there (TP, SP and CP already in it)")
    parser.add_argument("--context-parallel-size", type=positive_int, default=1, metavar="CP",
                        help="context parallelism inside segments: each rank holds 1/N of a "
                             "segment (FLOPs and activations per rank; keys and values whole; "
                             "default 1)")
    parser.add_argument("--cp-bandwidth-gbps", type=positive_float, default=100.0,
                        metavar="GB/S",
                        help="with --context-parallel-size and the FLOP model: what a rank's "
                             "all-gather / reduce-scatter of keys and values moves per second, "
                             "in GB/s (default 100)")
    parser.add_argument("--min-segment-length", type=positive_int, default=128, metavar="TOKENS",
                        help="shortest segment a plan may use (default 128)")
    parser.add_argument("--max-splits", type=positive_int, default=MAX_SPLITS, metavar="K",
                        help=f"most segments per micro-batch to try (default {MAX_SPLITS})")
    parser.add_argument("--multiple-of", type=positive_int, default=1, metavar="TOKENS",
                        help="every segment length's divisor (e.g. 8 with FP8); combined (least "
                             "common multiple) with what the layout needs: TP x CP with "
                             "--sequence-parallel, 2 x CP with context parallelism (default 1)")
    parser.add_argument("--splits", type=positive_int, nargs="+", metavar="K",
                        help="only these segment counts (default: 1 to --max-splits)")
    parser.add_argument("--partitions", nargs="+", choices=METHODS,
                        help="only these partitions (default: all that apply; documents needs "
                             "packed documents, which only the trainer's auto plan has)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES,
                        help="only these schedules (default: all the layout allows)")
    parser.add_argument("--message-latency", type=non_negative_float, default=None,
                        metavar="SECONDS",
                        help="one-way time of a pipeline message in seconds (default: the "
                             "calibration's message fit, else 0)")
    parser.add_argument("--timing", choices=TIMINGS, default=None,
                        help=f"how the executor's transport posts its transfers and waits "
                             f"(default {RUNTIME_TIMING}: NCCL's links transport, a step posts "
                             "once the previous step's sends completed); gloo: receives posted a "
                             "step ahead (CPU runs); rendezvous: a step waits for all its "
                             "transfers (SEQ1F1B_P2P=batch on NCCL, Megatron's own schedules); "
                             "slack: it waits for its receives and the previous step's sends "
                             "(what the planner assumed before; docs/design.md)")
    parser.add_argument("--send-slack", type=integer(0, 1), choices=(0, 1), default=None,
                        help="the older spelling of --timing: 0 rendezvous, 1 slack")
    parser.add_argument("--flop-rate", type=positive_float, default=OFFLINE_FLOP_RATE / 1e12,
                        metavar="TFLOPS",
                        help="without --calibration: sustained TFLOP/s per GPU that turn FLOPs "
                             f"into seconds (default {OFFLINE_FLOP_RATE / 1e12:g})")
    parser.add_argument("--host-ms-per-layer", type=non_negative_float, metavar="MS",
                        default=OFFLINE_HOST_SECONDS_PER_LAYER * 1e3,
                        help="without --calibration: host time in milliseconds a unit (one "
                             "segment through one stage) pays per layer of its stage, forward "
                             f"+ backward (default {OFFLINE_HOST_SECONDS_PER_LAYER * 1e3:g}, "
                             "measured on an H200; 0: FLOPs alone)")
    parser.add_argument("--tie-tolerance", type=fraction, default=TIE_TOLERANCE,
                        metavar="FRACTION",
                        help="plans predicted this close to the fastest count as a tie, won by "
                             "1F1B over zero bubble, then balanced/measured/uniform, then fewer "
                             f"segments (default {TIE_TOLERANCE}, measured and FLOP costs "
                             "alike: neither predicts closer than that; 0: the fastest "
                             "prediction wins)")
    parser.add_argument("--top", type=non_negative_int, default=TOP, metavar="N",
                        help=f"list the N fastest candidates timed and the chosen one (default "
                             f"{TOP}; with candidates left out, only the busiest stage's "
                             "memory; candidates that cannot change the choice are not timed, "
                             "and counted); 0: time and list every candidate and every stage")
    memory = parser.add_argument_group(
        "memory per stage (with the model: weights, main gradients, Adam states, activations)")
    memory.add_argument("--bf16", action="store_true", help="bf16 weights (default fp32)")
    memory.add_argument("--fp16", action="store_true", help="fp16 weights")
    memory.add_argument("--no-grad-reduce-in-fp32", action="store_true",
                        help="half-precision main gradients (default: fp32 with bf16/fp16)")
    memory.add_argument("--optimizer", choices=["adam", "none"], default="adam",
                        help="adam: two fp32 moments (and fp32 master weights in half "
                             "precision) per parameter; none: weights and gradients only")
    memory.add_argument("--use-distributed-optimizer", action="store_true",
                        help="shard master weights and Adam moments over data-parallel ranks")
    memory.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="DP",
                        help="data-parallel ranks the distributed optimizer shards over "
                             "(default 1)")
    memory.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                        help="the output layer has its own weights (default: tied to the "
                             "embedding, as Megatron-LM)")
    memory.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"],
                        default="rope",
                        help="rope (default; RoPE's cosines and sines per layer) or "
                             "learned_absolute (--seq-length x --hidden-size more weights)")
    memory.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                        help="LayerNorm (default: weight and bias) or RMSNorm (weight only)")
    memory.add_argument("--disable-bias-linear", action="store_true",
                        help="linear layers without biases (Megatron-LM's flag)")
    memory.add_argument("--gpu-memory-gib", type=positive_float, default=None, metavar="GIB",
                        help="GiB per GPU for the busiest stage's total (weights, gradients, "
                             "optimizer, activations): plans over it are ruled out")
    parser.add_argument("--json", metavar="FILE", type=output_file(),
                        help="write the choice, the candidates timed (all with --top 0; "
                             "'untimed' counts the rest) and Megatron-Core's schedules beside "
                             "it here (JSON; times in 'unit'; a zero-bubble plan's "
                             "segment_costs are per segment (F, B, W) relative to the mean "
                             "forward, what places its W)")
    parser.add_argument("--save-calibration", metavar="FILE", type=output_file(),
                        help="write the costs used as a calibration file (JSON)")
    return parser


def _check(parser: ArgumentParser, args: argparse.Namespace) -> None:
    """What needs several flags: one line and status 2 (``parser.error``) if it fails."""
    if args.vpp > 1 and args.pp < 2:
        parser.error(f"--vpp {args.vpp} needs --pp >= 2 (interleaving spreads model chunks over "
                     "pipeline stages), got --pp 1")
    if args.bf16 and args.fp16:
        parser.error("--bf16 and --fp16 are exclusive")
    if args.timing is not None and args.send_slack is not None:
        parser.error(f"--timing {args.timing} and --send-slack {args.send_slack} say the same "
                     "thing; give one of them")
    multiple = _segment_multiple(args)
    if args.seq_length % multiple:
        layout = "" if multiple == args.multiple_of else (
            f" (the least common multiple of --multiple-of {args.multiple_of} and the layout's "
            f"{segment_multiple(_layout(args))}: {_layout_rule(args)})")
        parser.error(f"--seq-length {args.seq_length} must be a multiple of "
                     f"{'--multiple-of ' if not layout else ''}{multiple}{layout}")
    most = args.seq_length // multiple
    for k in args.splits or ():
        if k > most:
            parser.error(f"--splits {k}: {args.seq_length} tokens (--seq-length) make at most "
                         f"{most} segments of a multiple of {multiple} tokens")
        if k > 1 and args.seq_length // k < args.min_segment_length:
            parser.error(f"--splits {k}: {args.seq_length} tokens (--seq-length) in {k} segments "
                         f"are shorter than --min-segment-length {args.min_segment_length}; "
                         "use at most "
                         f"{max(args.seq_length // args.min_segment_length, 1)} splits or "
                         "lower --min-segment-length")
    if args.hybrid_layer_pattern is not None:
        _check_pattern(parser, args)
    if args.hidden_size is not None:
        missing = [f"--{n.replace('_', '-')}" for n in ("num_layers", "num_attention_heads")
                   if getattr(args, n) is None]
        if missing:
            parser.error(f"--hidden-size needs {' and '.join(missing)} too")
        if args.num_layers % (args.pp * args.vpp) and not pattern_stages(args):
            parser.error(f"--num-layers {args.num_layers} must divide by --pp x --vpp "
                         f"({args.pp * args.vpp}): every virtual stage holds as many layers")
        if args.num_experts is None and args.hybrid_layer_pattern is None and any(
                getattr(args, n) is not None for n in ("moe_ffn_hidden_size",
                                                       "moe_shared_expert_intermediate_size")):
            parser.error("--moe-ffn-hidden-size / --moe-shared-expert-intermediate-size need "
                         "--num-experts")
        for problem in attention_shape_problems(
                args.hidden_size, args.num_attention_heads, args.num_query_groups,
                args.tensor_model_parallel_size, args.ffn_hidden_size):
            parser.error(problem)
    if args.gpu_memory_gib is not None and (args.hidden_size is None or not args.vocab_size):
        parser.error("--gpu-memory-gib needs the model (--hidden-size ...) and --vocab-size")
    if args.layout is not None and args.calibration is None:
        parser.error(f"--layout {args.layout} picks the fits of a --calibration results.json; "
                     "give --calibration FILE (the FLOP model has no layouts)")
    if args.calibration is None and args.hidden_size is None:
        parser.error("give --calibration FILE, or the model (--hidden-size, --num-layers, "
                     "--num-attention-heads, ...) for FLOP costs")
    if "documents" in (args.partitions or ()):
        parser.error("--partitions documents cuts a micro-batch's packed documents, which this "
                     "command line does not take (the trainer's --seq1f1b-splits auto plans "
                     "on its measured micro-batch's documents); choose from uniform, balanced "
                     "and measured")
    if "balanced" in (args.partitions or ()) and args.hidden_size is None:
        parser.error("--partitions balanced needs the model (--hidden-size ...): it balances "
                     "the model's FLOPs")
    if "zb-h2" in (args.schedules or ()) and args.vpp > 1:
        parser.error(f"--schedules zb-h2 with --vpp {args.vpp}: {ZB_H2_PROBLEM}")


def _check_calibration(parser: ArgumentParser, args: argparse.Namespace,
                       calibration: Calibration, stages: int) -> None:
    """A calibration's fits are per virtual stage, each for the layers that stage held: one
    for every stage of the pipeline planned (--pp x --vpp), or a single one that every stage
    gets (the format's "same on every stage")."""
    found = len(calibration.stages)
    if found > 1 and found != stages:
        vpp = f" x --vpp {args.vpp}" if args.vpp > 1 else ""
        parser.error(f"--calibration {args.calibration} has costs for {found} virtual stages "
                     f"(pipeline stages x model chunks), but --pp {args.pp}{vpp} plans {stages}: "
                     "a stage's fit holds for the layers that stage held; plan the pipeline "
                     "the file was made for, or make one for this pipeline (a measurement, or "
                     "--save-calibration)")


def _check_pattern(parser: ArgumentParser, args: argparse.Namespace) -> None:
    """The pattern (:func:`read_hybrid_pattern`), its '|' stages one per virtual stage."""
    pattern, _ = read_hybrid_pattern(parser, args, args.pp, "the planner costs")
    stages = pattern_stages(args)
    if stages and stages != args.pp * args.vpp:
        parser.error(f"--hybrid-layer-pattern {pattern!r} has {stages} '|' stages: give --pp x "
                     f"--vpp = {stages} ({args.pp} x {args.vpp} now)")


def _model_config(args: argparse.Namespace):
    """The model's sizes for the FLOP model (checked by :func:`_check`), or None."""
    if args.hidden_size is None:
        return None
    return SimpleNamespace(
        hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads, kv_channels=None,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        gated_linear_unit=args.swiglu, mtp_num_layers=args.mtp_num_layers,
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_layer_freq=1, **recurrent_fields(args))


def _by_layer_kind(args: argparse.Namespace) -> bool:
    """Stages differ by what they hold: a hybrid pattern, or MTP on the last stage."""
    return args.hybrid_layer_pattern is not None or bool(args.mtp_num_layers)


def _stage_cost_models(args: argparse.Namespace, config, stages: int) -> list[tuple]:
    """Per virtual stage, in pipeline order: (the FLOP model of its own layers, its layers);
    the output layer and the MTP depths on the last (the embedding's FLOPs are left out, as
    the whole model's FLOP model leaves them)."""
    from megatron_seq1f1b.planner.footprint import hybrid_stage_patterns, layers_per_virtual_stage

    mtp = args.mtp_num_layers or 0
    if args.hybrid_layer_pattern is not None:
        parts = hybrid_stage_patterns(args.hybrid_layer_pattern, stages)
        counts = [len(part.split("/")[0]) for part in parts]
    else:
        per = layers_per_virtual_stage(args.num_layers, stages)
        parts, counts = [None] * stages, [per] * stages
    models = []
    for index, (part, layers) in enumerate(zip(parts, counts)):
        last = index == stages - 1
        stage = SimpleNamespace(**{**vars(config), "num_layers": layers,
                                   "mtp_num_layers": mtp if last else None})
        models.append((CostModel.from_config(stage, args.vocab_size if last else None,
                                             args.dense_attention, pattern=part), layers))
    return models


def _flop_calibration(args: argparse.Namespace, config, stages: int) -> Calibration:
    """Costs from the model's FLOPs: split evenly over the virtual stages, or (a hybrid
    pattern, MTP) each stage by its own layers."""
    exchange = (_exchange_seconds_per_token(args, config, stages)
                + _tensor_parallel_seconds_per_token(args, config, stages))
    common = dict(flop_rate=args.flop_rate * 1e12,
                  context_parallel_size=args.context_parallel_size,
                  exchange_seconds_per_token=exchange,
                  tensor_parallel_size=args.tensor_model_parallel_size)
    host = args.host_ms_per_layer * 1e-3
    if not _by_layer_kind(args):
        return Calibration.from_cost_model(
            CostModel.from_config(config, args.vocab_size, args.dense_attention), stages,
            host_seconds=host * args.num_layers / stages, **common)
    parts = [Calibration.from_cost_model(model, 1, host_seconds=host * layers, **common)
             for model, layers in _stage_cost_models(args, config, stages)]
    return replace(parts[-1], stages=tuple(p.stages[0] for p in parts),
                   source=parts[-1].source + "; each virtual stage by its own layers")


def _memory_model(args: argparse.Namespace, config) -> MemoryModel | None:
    """With the model's sizes and vocabulary: weights, gradients, optimizer and activations
    per stage; the activations' bytes per token scaled to --bytes-per-token if given."""
    if config is None or not args.vocab_size:
        return None
    shape = ModelShape(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, vocab_size=args.vocab_size,
        ffn_hidden_size=config.ffn_hidden_size, num_query_groups=config.num_query_groups,
        gated_linear_unit=config.gated_linear_unit, normalization=args.normalization,
        add_bias_linear=not args.disable_bias_linear,
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        max_sequence_length=args.seq_length, hybrid_layer_pattern=args.hybrid_layer_pattern,
        mtp_num_layers=args.mtp_num_layers or 0, num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_router_topk=args.moe_router_topk,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        **recurrent_fields(args))
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    training = Training(dtype=dtype, grad_reduce_in_fp32=False if args.no_grad_reduce_in_fp32
                        else None, optimizer=None if args.optimizer == "none" else "adam",
                        distributed_optimizer=args.use_distributed_optimizer,
                        data_parallel_size=args.data_parallel_size)
    return MemoryModel(shape, training, flash=not args.dense_attention,
                       bytes_per_token=args.bytes_per_token,
                       context_parallel_size=args.context_parallel_size,
                       tensor_parallel_size=args.tensor_model_parallel_size,
                       sequence_parallel=_sequence_parallel(args),
                       recurrent_kernels=args.recurrent_kernels)


def _exchange_seconds_per_token(args: argparse.Namespace, config, stages: int) -> float:
    """Seconds a stage's CP exchange takes per token of a segment, in one direction: a rank
    sends ``(cp - 1) / cp`` of each layer's keys and values
    (:func:`~megatron_seq1f1b.attention.context_parallel.exchanged_bytes`) at
    ``--cp-bandwidth-gbps``."""
    cp = args.context_parallel_size
    if cp == 1:
        return 0.0
    from megatron_seq1f1b.attention.context_parallel import exchanged_bytes  # imports torch

    width = 2 if args.bf16 or args.fp16 else 4
    head = config.kv_channels or config.hidden_size // config.num_attention_heads
    kv = 2 * (config.num_query_groups or config.num_attention_heads) * head * width
    sent = exchanged_bytes([1], _attention_layers(args) / stages, kv, cp, forward_only=True)
    return sent / (args.cp_bandwidth_gbps * 1e9)


def _tensor_parallel_seconds_per_token(args: argparse.Namespace, config,
                                       stages: int) -> float:
    """Seconds a stage's TP communication takes per token of a segment, in one direction:
    per layer 2 all-reduces of the ``[s, b, h]`` activations (with sequence parallelism 2
    all-gathers and 2 reduce-scatters, as many bytes), each ``2 (tp - 1) / tp`` of them
    over ``--tp-bandwidth-gbps`` (a bus bandwidth); a CP rank holds ``1 / cp`` of the
    tokens. The embedding's and the output layer's exchanges (once per stage) are left out."""
    tp = args.tensor_model_parallel_size
    if tp == 1:
        return 0.0
    width = 2 if args.bf16 or args.fp16 else 4
    per_reduce = 2 * (tp - 1) / tp * config.hidden_size * width
    sent = per_reduce * _tp_reduces(args) / stages / args.context_parallel_size
    return sent / (args.tp_bandwidth_gbps * 1e9)


def _attention_layers(args: argparse.Namespace) -> int:
    """Attention layers of the decoder: every GPTModel layer, a pattern's '*' layers."""
    if args.hybrid_layer_pattern is None:
        return args.num_layers
    return args.hybrid_layer_pattern.split("/")[0].count("*")


def _tp_reduces(args: argparse.Namespace) -> int:
    """The decoder's TP all-reduces per forward: two per GPTModel layer (after attention and
    after the MLP), one per layer of a hybrid pattern (each symbol is one of them)."""
    if args.hybrid_layer_pattern is None:
        return 2 * args.num_layers
    return len(args.hybrid_layer_pattern.split("/")[0].replace("|", ""))


def _sequence_parallel(args: argparse.Namespace) -> bool:
    """Sequence parallelism in effect: Megatron-LM turns it off with TP 1."""
    return args.sequence_parallel and args.tensor_model_parallel_size > 1


def _layout(args: argparse.Namespace) -> SimpleNamespace:
    """The parallel layout as :func:`~megatron_seq1f1b.base.checks.segment_multiple` reads it."""
    return SimpleNamespace(tensor_model_parallel_size=args.tensor_model_parallel_size,
                           sequence_parallel=_sequence_parallel(args),
                           context_parallel_size=args.context_parallel_size)


def _segment_multiple(args: argparse.Namespace) -> int:
    """Every segment length's divisor: --multiple-of and what the layout needs."""
    return math.lcm(args.multiple_of, segment_multiple(_layout(args)))


def _layout_rule(args: argparse.Namespace) -> str:
    """Why the layout needs its multiple, in words."""
    rules = []
    if args.context_parallel_size > 1:
        rules.append(f"context parallelism cuts a segment into 2 x {args.context_parallel_size}"
                     " chunks")
    if _sequence_parallel(args):
        rules.append(f"sequence parallelism splits each rank's tokens over "
                     f"{args.tensor_model_parallel_size} TP ranks")
    return " and ".join(rules)


def _layout_text(args: argparse.Namespace) -> str:
    """The first line of the report: what was planned for."""
    text = (f"plan for: {args.seq_length} tokens per sample, {args.micro_batch_size} "
            f"sample(s) per micro-batch, {args.microbatches} micro-batches per iteration; "
            f"{args.pp} pipeline stages")
    if args.vpp > 1:
        text += f" x {args.vpp} model chunks"
    if args.tensor_model_parallel_size > 1:
        text += f", tensor parallel {args.tensor_model_parallel_size}"
        text += " with sequence parallelism" if _sequence_parallel(args) else ""
    if args.context_parallel_size > 1:
        text += f", context parallel {args.context_parallel_size}"
    return text


def _costs_text(args: argparse.Namespace, calibration: Calibration, config,
                stages: int) -> list[str]:
    """What the costs are, in words: from which file and how it was made (measured, or a
    file the FLOP model wrote, as its source says), or the FLOP model's assumptions; and the
    communication inside a stage that the FLOP costs add."""
    if args.calibration:
        source = calibration.source or "no source"
        flops = (calibration.source or "").startswith("FLOP cost model")
        text = (f"costs: from {args.calibration}, made by the FLOP model ({source}): forward "
                f"and backward times of a segment on each stage" if flops else
                f"costs: measured, from {args.calibration} ({source}): fitted forward and "
                f"backward times of a segment on each stage")
        if len(calibration.stages) == 1 and stages > 1:
            text += f" (the file's one stage on each of the {stages})"
        groups = [f"--{flag} {value}" for flag, value in (
            ("tp", args.tensor_model_parallel_size),
            ("context-parallel-size", args.context_parallel_size)) if value > 1]
        if groups and flops:
            text += (f"; {' and '.join(groups)} set{'s' if len(groups) == 1 else ''} memory "
                     "per rank and segment lengths only here (the file's times stay as made)")
        elif groups:
            text += (f"; {' and '.join(groups)} are in the measured times (here they set "
                     "memory per rank and segment lengths only)")
    else:
        layers = config.num_layers / stages
        text = (f"costs: not measured; the model's FLOPs per GPU at {args.flop_rate:g} TFLOP/s, "
                f"{args.host_ms_per_layer * layers:.3g} ms host time per unit (one segment's "
                f"forward + backward on one stage: {args.host_ms_per_layer:g} ms x {layers:g} "
                "layers); partition 'balanced' cuts by the FLOPs, 'measured' by these costs, "
                "host time included")
    if args.message_latency is not None:
        text += f"; pipeline messages {args.message_latency * 1e3:g} ms each"
    elif calibration.message is not None:
        text += "; pipeline messages as measured"
    lines = [text]
    if not args.calibration:
        parts = []
        if args.tensor_model_parallel_size > 1:
            tp = _tensor_parallel_seconds_per_token(args, config, stages)
            parts.append(f"TP all-reduces at {args.tp_bandwidth_gbps:g} GB/s: "
                         f"{tp * 1e9:.3g} ns")
        if args.context_parallel_size > 1:
            cp = _exchange_seconds_per_token(args, config, stages)
            parts.append(f"CP exchange of keys and values at {args.cp_bandwidth_gbps:g} GB/s: "
                         f"{cp * 1e9:.3g} ns")
        if parts:
            lines.append("communication inside a stage per token of a segment, forward and "
                         f"backward each: {'; '.join(parts)}")
    return lines


def main(argv=None) -> int:
    """Plan from the command line: print the choice first, then the candidates."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    config = _model_config(args)
    memory_model = _memory_model(args, config)
    stages = args.pp * args.vpp
    calibration = None
    if args.calibration:
        try:
            calibration = load_calibration(args.calibration, args.layout or "plain")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--calibration {args.calibration}: cannot read it as a calibration "
                         f"(--layout {args.layout or 'plain'}): {type(exc).__name__}: {exc}")
        _check_calibration(parser, args, calibration, stages)
    if calibration is None:
        calibration = _flop_calibration(args, config, stages)
    if args.memory_budget_gib is not None and not (args.bytes_per_token
                                                   or calibration.bytes_per_token):
        parser.error("--memory-budget-gib needs --bytes-per-token (or a calibration that has "
                     "bytes_per_token) to turn micro-batches of activations into bytes")
    if args.message_latency is not None:
        calibration = replace(calibration, message=Fit(0.0, 0.0, args.message_latency))
    common = dict(
        micro_batch_size=args.micro_batch_size, config=config, vocab_size=args.vocab_size,
        dense_attention=args.dense_attention,
        bytes_per_token=args.bytes_per_token, min_segment_length=args.min_segment_length,
        multiple_of=_segment_multiple(args), timing=_timing(args), memory_model=memory_model,
        context_parallel_size=args.context_parallel_size)
    cost_model = (CostModel.from_config(config, args.vocab_size, args.dense_attention,
                                        pattern=args.hybrid_layer_pattern)
                  if config is not None and _by_layer_kind(args) else None)
    try:
        choice = choose_plan(
            args.seq_length, args.pp, args.microbatches, num_model_chunks=args.vpp,
            calibration=calibration, cost_model=cost_model,
            memory_budget=args.memory_budget_microbatches,
            memory_budget_bytes=args.memory_budget_gib * GIB if args.memory_budget_gib else None,
            max_splits=args.max_splits, splits=args.splits,
            partitions=args.partitions, schedules=args.schedules,
            tie_tolerance=args.tie_tolerance,
            memory_budget_total_bytes=args.gpu_memory_gib * GIB if args.gpu_memory_gib else None,
            exhaustive=args.top == 0, **common)
    except BudgetError as exc:  # the flags are fine; no plan fits them
        text = exc.text({"max_splits": "--max-splits",
                         "min_segment_length": "--min-segment-length"})
        raise SystemExit(f"{parser.prog}: error: {text}") from None
    except ValueError as exc:
        parser.error(str(exc))
    plan = choice.plan
    costs = _costs_text(args, calibration, config, stages)
    note = tie_note(choice.candidates, plan, args.tie_tolerance, complete=not choice.untimed)
    print("\n".join([_layout_text(args), *costs]))
    print(f"timed as the {_timing(args)} transport runs the steps (--timing)")
    print(f"chosen: {chosen_flags(plan)}")
    if note:
        print(f"  ({note}; --tie-tolerance 0 takes the fastest)")
    capped = cap_note(choice.candidates, args.max_splits, args.splits, args.seq_length,
                      args.min_segment_length, _segment_multiple(args))
    if capped:
        print(f"  ({capped})")
    plain = None  # the costs of the layout without interleaving (FLOPs only: see report)
    if args.vpp > 1 and not args.calibration:
        plain = _flop_calibration(args, config, args.pp)
        if args.message_latency is not None:
            plain = replace(plain, message=Fit(0.0, 0.0, args.message_latency))
    baselines = megatron_baselines(args.seq_length, args.pp, args.microbatches, args.vpp,
                                   calibration, plain, cost_model=cost_model, **common)
    print("\n".join(baseline_lines(plan, baselines, args.gpu_memory_gib)))
    print(choice.table(args.top))
    print(f"split_lengths {list(plan.lengths)} (the chosen plan's segments, tokens)")
    print("\n".join(memory_lines(plan, args.gpu_memory_gib)))
    if args.save_calibration:
        _write(parser, args.save_calibration,
               lambda: save_calibration(calibration, args.save_calibration))
    if args.json:
        text = json.dumps({
            "plan": _plan_dict(plan), "reason": choice.reason,
            "candidates": [_plan_dict(c) for c in choice.candidates],
            "tie_note": note, "costs": costs, "source": calibration.source,
            "baselines": {name: _plan_dict(b) for name, b in baselines.items()
                          if not isinstance(b, str)},
            "baselines_not_predicted": {name: why for name, why in baselines.items()
                                        if isinstance(why, str)},
            "untimed": choice.untimed, "timing": _timing(args),
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "sequence_parallel": _sequence_parallel(args),
            "context_parallel_size": args.context_parallel_size,
            "segment_multiple": _segment_multiple(args)}, indent=1) + "\n"
        _write(parser, args.json, lambda: Path(args.json).write_text(text))
    return 0


def _write(parser: argparse.ArgumentParser, path: str, write: Callable[[], object]) -> None:
    """Write an output file (``write``), or stop with one line saying why not (the plan is
    printed)."""
    try:
        write()
    except OSError as exc:
        parser.exit(1, f"{parser.prog}: error: cannot write {path}: {exc.strerror or exc}\n")


def _timing(args: argparse.Namespace) -> str:
    """The replay timing the flags ask for (--timing, or --send-slack's, or the default)."""
    if args.send_slack is not None:
        return ("rendezvous", "slack")[args.send_slack]
    return args.timing or RUNTIME_TIMING


def _plan_dict(plan: Plan) -> dict:
    return {"num_splits": plan.num_splits, "partition": plan.partition,
            "lengths": list(plan.lengths), "schedule": plan.schedule, "time": plan.time,
            "unit": plan.unit, "bubble": plan.bubble, "memory_microbatches": plan.memory,
            "memory_bytes": plan.memory_bytes, "within_budget": plan.within_budget,
            "segment_costs": plan.segment_costs,
            "stages": [dict(s) for s in plan.stages] if plan.stages else None}


if __name__ == "__main__":
    raise SystemExit(main())
