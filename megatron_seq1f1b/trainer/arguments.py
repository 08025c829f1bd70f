"""Command-line flags of the standalone trainer, with Megatron-LM's names and meanings.

Only what this trainer implements is accepted; an unknown flag, a contradictory
combination or a ``--data-path`` that is no usable data set stops the run before any
process group exists: rank 0 prints one line per problem, every rank exits with status 2
(:func:`refuse`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import re
import signal
import sys
from typing import NoReturn

from megatron_seq1f1b.base.checks import (
    attention_shape_problems, local_expert_bias_problems, segment_multiple,
)
from megatron_seq1f1b.base.flags import (
    ArgumentParser, fraction, non_negative_float, non_negative_int, positive_float,
    positive_int,
)
from megatron_seq1f1b.megatron_lm.arguments import (
    AUTO, add_arguments, auto_flag_problems, backward_by_documents_flag_problems,
    moe_flag_problems, segment_splits, segment_tokens_flag_problems, split_lengths_flag_problems,
    window_problems,
)
from megatron_seq1f1b.planner.model_flags import add_recurrent_arguments, recurrent_fields
from megatron_seq1f1b.planner.footprint import ModelShape
from megatron_seq1f1b.planner.recurrent import gdn_sizes, mamba_sizes
from megatron_seq1f1b.schedules.interleaved import ZB_H2_PROBLEM
from megatron_seq1f1b.schedules.partition import split_sequence
from megatron_seq1f1b.schedules.variable import segment_count
from megatron_seq1f1b.trainer import data as trainer_data
from megatron_seq1f1b.trainer import lengths

PROG = "pretrain_gpt.py"
#: Seconds a refusing rank under torchrun waits for every other rank to refuse too.
REFUSAL_WAIT_S = 30.0


def refuse(problems: list[str], prog: str = PROG) -> NoReturn:
    """``<prog>: error: <problem>`` lines, printed once, and exit status 2 on every rank.

    Every rank finds the same problems before any process group exists; rank 0 (env
    ``RANK`` 0 or unset) prints them. Under torchrun the ranks first meet at its agent's
    store and then leave at once, skipping the interpreter's teardown (seconds): torchrun
    ends the other ranks (SIGTERM, status -15) as soon as one exits, which would cut off
    rank 0's line or a peer's status 2. Outside torchrun: ``SystemExit(2)``.
    """
    rank = os.environ.get("RANK", "0")
    lines = "".join(f"{prog}: error: {problem}\n" for problem in problems)
    if rank == "0":
        sys.stderr.write(lines)
        sys.stderr.flush()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise SystemExit(2)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))  # torchrun ends us: still a 2
    if not _all_ranks_refused() and rank != "0" and os.environ.get("LOCAL_RANK") == "0":
        sys.stderr.write(lines)  # rank 0 went on (e.g. a data set missing on this node only)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


def _all_ranks_refused() -> bool:
    """Wait at torchrun's agent store until every rank has refused (False: not all did in
    :data:`REFUSAL_WAIT_S`, or the store cannot be reached)."""
    import torch.distributed as dist

    key = f"seq1f1b/refused/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False,
                              timeout=datetime.timedelta(seconds=REFUSAL_WAIT_S))
        if store.add(key, 1) == int(os.environ.get("WORLD_SIZE", "1")):
            store.set(f"{key}/all", "1")
        store.wait([f"{key}/all"])
    except (RuntimeError, KeyError, ValueError):  # DistStoreError is a RuntimeError
        return False
    return True


class StartupParser(ArgumentParser):
    """The one-line parser whose errors go through :func:`refuse` (once under torchrun)."""

    def error(self, message: str) -> NoReturn:
        refuse([message], self.prog)


def _int_pair(text: str) -> tuple[int, int]:
    """Megatron-LM's tuple flags: '(1024, 0)' or '1024,0'."""
    parts = [part.strip() for part in text.strip().strip("()").split(",")]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected two integers like '(1024, 0)', got {text!r}")
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers like '(1024, 0)', got {text!r}")


#: --num-layers when neither it nor --hybrid-layer-pattern is given.
DEFAULT_NUM_LAYERS = 4

#: The --hybrid-layer-pattern symbols this trainer builds (Megatron-Core's
#: ``hybrid_layer_allocation.Symbols``; the sparse attention D is not among them).
HYBRID_SYMBOLS = "*+MG-E|/"


def _hybrid_pattern_problems(args, pp: int) -> list[str]:
    """--hybrid-layer-pattern as Megatron-LM reads it: --num-layers from the pattern, its '|'
    stages over the pipeline ranks (virtual stages where there are more); what this trainer
    builds."""
    from megatron_seq1f1b.base.compat import language_models

    pattern = args.hybrid_layer_pattern
    problems = []
    if len(language_models()) < 2:
        problems.append("--hybrid-layer-pattern needs megatron-core 0.18 or later (HybridModel)")
    other = sorted(set(pattern) - set(HYBRID_SYMBOLS))
    if other:
        problems.append(f"--hybrid-layer-pattern {pattern!r}: this trainer builds attention "
                        f"(*), multi-latent attention (+), Mamba-2 (M), gated delta net (G), "
                        f"MLP (-) and MoE (E) layers and MTP depths (/); not {' '.join(other)}")
    if ("+" in pattern) != bool(args.multi_latent_attention):
        problems.append(f"--hybrid-layer-pattern {pattern!r}: multi-latent attention layers "
                        "(+) take their sizes from --multi-latent-attention's flags, and "
                        "--multi-latent-attention builds MLA only in '+' layers: give both "
                        "or neither")
    main, *depths = pattern.split("/")
    if depths:  # Megatron-LM: the MTP depths come from the pattern
        if args.mtp_num_layers not in (None, len(depths)):
            problems.append(f"--mtp-num-layers {args.mtp_num_layers} with a pattern of "
                            f"{len(depths)} MTP depths ('/' parts); give one of them")
        args.mtp_num_layers = len(depths)
    elif args.mtp_num_layers:
        problems.append("--mtp-num-layers with --hybrid-layer-pattern: give the MTP depths "
                        "as '/' parts of the pattern (e.g. '*-*-/*-/*-' for two)")
    stages = main.split("|")
    if any(not stage for stage in stages):
        problems.append(f"--hybrid-layer-pattern {pattern!r}: a '|' stage without layers")
    if "E" in pattern and not args.num_experts:
        problems.append("--hybrid-layer-pattern with MoE layers (E) needs --num-experts")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        problems.append("--hybrid-layer-pattern sets the virtual pipeline by its '|' stages; "
                        "drop --num-layers-per-virtual-pipeline-stage")
    layers = len(main.replace("|", ""))
    if args.num_layers not in (None, layers):
        args.startup_warnings.append(
            f"--hybrid-layer-pattern {pattern!r} has {layers} layers; ignoring --num-layers "
            f"{args.num_layers} (as Megatron-LM does)")
    args.num_layers = layers
    if len(stages) > 1 and pp > 1:
        if len(stages) % pp:
            problems.append(f"--hybrid-layer-pattern has {len(stages)} '|' stages, not a "
                            f"multiple of --pipeline-model-parallel-size {pp}")
        elif len(stages) > pp:
            args.virtual_pipeline_model_parallel_size = len(stages) // pp
    elif pp > 1 and args.num_layers % pp:
        problems.append(f"--hybrid-layer-pattern's {args.num_layers} layers without '|' must "
                        f"divide by --pipeline-model-parallel-size {pp}")
    return problems


def build_parser() -> StartupParser:
    """The trainer's flags; errors are one line, status 2 (once per job under torchrun)."""
    p = StartupParser(
        prog=PROG,
        description="Train a GPT with Megatron-Core and (optionally) Seq1F1B. Launch with "
                    "torchrun (one process runs without it).",
        allow_abbrev=False,
    )
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=positive_int, default=None,
                       help=f"default {DEFAULT_NUM_LAYERS}; with --hybrid-layer-pattern the "
                            "pattern's layer count (a different --num-layers is ignored with a "
                            "warning, as in Megatron-LM)")
    model.add_argument("--mtp-num-layers", type=positive_int, default=None, metavar="D",
                       help="multi-token prediction: D extra layers on the last stage, depth d "
                            "predicting token t + d + 1 (as Megatron-LM's flag; with "
                            "--hybrid-layer-pattern, its '/' parts set it)")
    model.add_argument("--mtp-loss-scaling-factor", type=non_negative_float, default=0.1,
                       help="weight of the MTP losses (their mean over the depths)")
    model.add_argument("--hybrid-layer-pattern", default=None, metavar="PATTERN",
                       help="build Megatron-Core's HybridModel (0.18+): one symbol per layer, "
                            "'*' attention, '+' MLA (with --multi-latent-attention), '-' MLP, 'E' "
                            "MoE (with --num-experts), 'M' Mamba-2, 'G' gated delta net (with "
                            "--swiglu), '/' before each MTP depth; '|' between "
                            "pipeline stages (stages / --pipeline-model-parallel-size = virtual "
                            "stages per rank). Sets --num-layers. As Megatron-LM's flag")
    model.add_argument("--hidden-size", type=positive_int, default=128)
    model.add_argument("--ffn-hidden-size", type=positive_int, default=None,
                       help="default 4 * hidden")
    model.add_argument("--num-attention-heads", type=positive_int, default=4)
    model.add_argument("--num-query-groups", type=positive_int, default=None, help="GQA groups")
    model.add_argument("--seq-length", type=positive_int, default=256)
    model.add_argument("--max-position-embeddings", type=positive_int, default=None)
    model.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"],
                       default="learned_absolute")
    model.add_argument("--swiglu", action="store_true")
    model.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--hidden-dropout", type=fraction, default=0.0)
    model.add_argument("--attention-dropout", type=fraction, default=0.0)
    model.add_argument("--window-size", type=_int_pair, default=None,
                       help="sliding-window attention, e.g. '(1024, 0)': each token sees the "
                            "1024 tokens before it")
    model.add_argument("--window-attn-skip-freq", type=positive_int, default=None,
                       help="every N-th layer attends to the whole prefix (no window)")

    model.add_argument("--disable-bias-linear", action="store_true",
                       help="no biases in linear layers (as MoE models train)")
    model.add_argument("--attention-backend", choices=["local", "flash"], default="local",
                       help="core attention (Megatron-LM's flag): 'local' is Megatron-Core's "
                            "DotProductAttention (unfused, [s, s] scores); 'flash' is "
                            "megatron_seq1f1b.attention.flash (PyTorch SDPA: flash kernel on "
                            "CUDA, no [s, s] tensor). Default local.")
    mla = p.add_argument_group("multi-latent attention (Megatron-LM's flags)")
    mla.add_argument("--multi-latent-attention", action="store_true",
                     help="MLA; its core attention is megatron_seq1f1b.attention.flash with "
                          "either --attention-backend (separate K/V widths, PyTorch SDPA)")
    mla.add_argument("--q-lora-rank", type=positive_int, default=None)
    mla.add_argument("--kv-lora-rank", type=positive_int, default=32)
    mla.add_argument("--qk-head-dim", type=positive_int, default=128)
    mla.add_argument("--qk-pos-emb-head-dim", type=positive_int, default=64)
    mla.add_argument("--v-head-dim", type=positive_int, default=128)
    mla.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                     help="MLA's rotary embedding (Megatron's default for MLA: yarn)")
    mla.add_argument("--rotary-scaling-factor", type=positive_float, default=1.0)
    moe = p.add_argument_group("mixture of experts (Megatron-LM's flags)")
    moe.add_argument("--num-experts", type=positive_int, default=None)
    moe.add_argument("--moe-router-topk", type=positive_int, default=2)
    moe.add_argument("--moe-ffn-hidden-size", type=positive_int, default=None)
    moe.add_argument("--moe-shared-expert-intermediate-size", type=positive_int, default=None)
    moe.add_argument("--moe-layer-freq", type=positive_int, default=1,
                     help="every N-th layer is MoE (the others dense)")
    moe.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                     choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "none"])
    moe.add_argument("--moe-aux-loss-coeff", type=non_negative_float, default=0.0)
    moe.add_argument("--moe-z-loss-coeff", type=non_negative_float, default=None)
    moe.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"],
                     default="softmax")
    moe.add_argument("--moe-router-enable-expert-bias", action="store_true")
    moe.add_argument("--moe-router-bias-update-rate", type=non_negative_float, default=1e-3)
    moe.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"],
                     default="allgather")
    moe.add_argument("--moe-expert-capacity-factor", type=positive_float, default=None)
    moe.add_argument("--expert-model-parallel-size", type=positive_int, default=1)

    ssm = p.add_argument_group(
        "Mamba-2 (M) and gated delta net (G) layers of --hybrid-layer-pattern (Megatron-LM's "
        "flags; unset: Megatron's defaults)",
        "Seq1F1B carries their convolution windows and recurrent states from segment to "
        "segment. Gated delta nets take the activation of --swiglu (silu).")
    add_recurrent_arguments(ssm)

    par = p.add_argument_group("parallelism")
    par.add_argument("--micro-batch-size", type=positive_int, default=1)
    par.add_argument("--global-batch-size", type=positive_int, default=None,
                     help="default micro-batch size * data-parallel size")
    par.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None)
    par.add_argument("--context-parallel-size", type=positive_int, default=1,
                     help="context parallelism (Megatron-LM's flag): every Seq1F1B segment is "
                          "cut into 2 x N chunks over N ranks, which gather each other's keys "
                          "and values; needs --seq1f1b (--seq1f1b-splits 1: whole "
                          "micro-batches). World = TP x PP x CP x DP.")
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--use-distributed-optimizer", action="store_true")
    par.add_argument("--overlap-grad-reduce", action="store_true")

    opt = p.add_argument_group("optimization")
    opt.add_argument("--lr", type=non_negative_float, default=3e-4)
    opt.add_argument("--min-lr", type=non_negative_float, default=0.0)
    opt.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    opt.add_argument("--lr-warmup-iters", type=non_negative_int, default=0)
    opt.add_argument("--weight-decay", type=non_negative_float, default=0.01)
    opt.add_argument("--clip-grad", type=non_negative_float, default=1.0)
    opt.add_argument("--adam-beta1", type=fraction, default=0.9)
    opt.add_argument("--adam-beta2", type=fraction, default=0.95)
    opt.add_argument("--calculate-per-token-loss", action="store_true")
    opt.add_argument("--bf16", action="store_true",
                     help="bf16 parameters and activations (also on CPU, slowly)")
    opt.add_argument("--fp16", action="store_true",
                     help="fp16 parameters and activations, with loss scaling")
    opt.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    opt.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    opt.add_argument("--recompute-num-layers", type=positive_int, default=None)

    run = p.add_argument_group("training loop")
    run.add_argument("--train-iters", type=positive_int, default=20)
    run.add_argument("--eval-interval", type=positive_int, default=None, help="default: never")
    run.add_argument("--eval-iters", type=non_negative_int, default=2,
                     help="validation batches per evaluation (0: no evaluation, as Megatron-LM)")
    run.add_argument("--log-interval", type=positive_int, default=1)
    run.add_argument("--seed", type=non_negative_int, default=1234)
    run.add_argument("--save", default=None, help="checkpoint directory to write")
    run.add_argument("--load", default=None, help="checkpoint directory to resume from")
    run.add_argument("--save-interval", type=positive_int, default=None)
    run.add_argument("--exit-interval", type=positive_int, default=None,
                     help="stop (and save, with --save) after an iteration divisible by this; "
                          "the LR schedule still spans --train-iters, so a resumed run continues "
                          "exactly")
    run.add_argument("--log-json", default=None, help="also write per-iteration records here")
    run.add_argument("--timeline-dir", default=None,
                     help="record the last training iteration's per-action timeline (every "
                          "rank) and write timeline.png and timeline.json (Chrome trace) here")

    data = p.add_argument_group("data")
    data.add_argument("--mock-data", action="store_true")
    data.add_argument("--data-path", nargs="+", default=None,
                      help="Megatron indexed dataset prefix(es) (.bin/.idx)")
    data.add_argument("--split", default="98,2,0", help="train,valid,test weights")
    data.add_argument("--tokenizer-type", choices=["NullTokenizer", "ByteTokenizer"],
                      default="NullTokenizer")
    data.add_argument("--vocab-size", type=positive_int, default=None)
    data.add_argument("--data-cache-path", default=None)
    docs = p.add_argument_group(
        "documents (Megatron-LM's flags)",
        "Samples pack several documents. --reset-attention-mask or "
        "--dataloader-inter-document-masking keep them apart in attention, with every schedule "
        "and both attention backends: on 'flash' every batch is packed (THD: cu_seqlens, "
        "PackedSeqParams; micro-batches of b > 1 flattened into one sequence of b x "
        "--seq-length tokens, as Megatron-LM does) and no [s, s] mask is built; on 'local' "
        "Megatron's schedules get a dense [b, 1, s, s] document mask and Seq1F1B gets the "
        "documents (its segments build their own masks).")
    docs.add_argument("--reset-position-ids", action="store_true",
                      help="position ids restart after every end-of-document token")
    docs.add_argument("--reset-attention-mask", action="store_true",
                      help="a token after an end-of-document token starts a new document: "
                           "attention stays within documents")
    docs.add_argument("--eod-mask-loss", action="store_true",
                      help="no loss on end-of-document tokens")
    docs.add_argument("--dataloader-inter-document-masking", action="store_true",
                      help="the dataset's documents (where it cut them into the sample, not "
                           "end-of-document tokens) as cu_seqlens; attention stays within "
                           "them and position ids restart at each (takes precedence over "
                           "--reset-attention-mask)")

    varlen = p.add_argument_group(
        "variable-length micro-batches",
        "Micro-batches of their own length, at most --seq-length, as post-training packs them: "
        "Megatron-Core's variable_seq_lengths, for Megatron's schedules and Seq1F1B alike "
        "(with --seq1f1b-segment-tokens every segment about the same size). Tokens/s counts "
        "the micro-batches' tokens.")
    varlen.add_argument(
        "--variable-seq-lengths", nargs="?", const=lengths.DOCUMENTS, choices=lengths.MODES,
        default=None,
        help="'documents' (the default): each sample cut after its last whole document "
             "(end-of-document tokens, or the dataset's boundaries with "
             "--dataloader-inter-document-masking; --micro-batch-size 1); 'lognormal': the "
             "length of each global micro-batch drawn from a log-normal seeded by --seed and "
             "its index, clipped to [--variable-seq-lengths-min, --seq-length]")
    varlen.add_argument(
        "--variable-seq-lengths-min", type=positive_int, default=None, metavar="N",
        help=f"lognormal: the shortest micro-batch (default --seq-length / "
             f"{lengths.DEFAULT_MIN_FRACTION}); the median is the geometric mean of it and "
             "--seq-length")
    varlen.add_argument(
        "--variable-seq-lengths-sigma", type=positive_float, default=lengths.DEFAULT_SIGMA,
        metavar="S", help=f"lognormal: the spread (sigma of the log; default "
                          f"{lengths.DEFAULT_SIGMA})")

    add_arguments(p)  # --seq1f1b... flags, as in Megatron-LM (auto's budget flags too)
    return p


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Fill defaults and reject contradictions (each message names the flags); what is
    accepted but overridden goes to ``args.startup_warnings`` (printed at start-up)."""
    problems = []
    args.startup_warnings = []
    if args.hybrid_layer_pattern is None and args.num_layers is None:
        args.num_layers = DEFAULT_NUM_LAYERS
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    if world_size % (tp * pp * cp):
        problems.append(f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                        f"{tp} x --pipeline-model-parallel-size {pp}"
                        + (f" x --context-parallel-size {cp}" if cp > 1 else ""))
    # Data parallelism without context parallelism: every CP rank of a replica reads the
    # same micro-batches (as in Megatron-LM); Seq1F1B's cut gives each its part.
    args.data_parallel_size = max(world_size // (tp * pp * cp), 1)
    ep = args.expert_model_parallel_size
    if ep > 1 and (not args.num_experts or args.data_parallel_size * tp % ep
                   or args.num_experts % ep):
        problems.append(f"--expert-model-parallel-size {ep} needs --num-experts divisible by "
                        f"it, and to divide data-parallel x tensor-parallel size "
                        f"{args.data_parallel_size * tp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.hybrid_layer_pattern is not None:
        problems += _hybrid_pattern_problems(args, pp)
    elif args.num_layers % pp:
        problems.append(f"--num-layers {args.num_layers} must divide by "
                        f"--pipeline-model-parallel-size {pp}")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp < 2:
            problems.append("--num-layers-per-virtual-pipeline-stage needs "
                            "--pipeline-model-parallel-size >= 2")
        elif per_stage % args.num_layers_per_virtual_pipeline_stage:
            problems.append(f"layers per stage ({per_stage}) must divide by "
                            "--num-layers-per-virtual-pipeline-stage")
        else:
            args.virtual_pipeline_model_parallel_size = (
                per_stage // args.num_layers_per_virtual_pipeline_stage)
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron-LM: meaningless without TP
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 are exclusive")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        problems.append(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                        f"--micro-batch-size x data-parallel size ({per_step})")
    args.num_microbatches = max(args.global_batch_size // per_step, 1)
    if args.mock_data == bool(args.data_path):
        problems.append("give exactly one of --mock-data and --data-path")
    if args.tokenizer_type == "ByteTokenizer":
        args.vocab_size = args.vocab_size or 257
    elif args.vocab_size is None:
        problems.append("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.vocab_size and args.vocab_size % tp:
        padded = -(-args.vocab_size // tp) * tp
        default = " (ByteTokenizer's default)" if args.vocab_size == 257 else ""
        problems.append(f"--vocab-size {args.vocab_size}{default} must divide by "
                        f"--tensor-model-parallel-size {tp}: each TP rank holds an equal share "
                        f"of the embedding and output layer; give --vocab-size {padded} (ids no "
                        "token uses are harmless), as Megatron-LM pads it")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        problems.append("--seq-length exceeds --max-position-embeddings")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:
            args.ffn_hidden_size = int(math.ceil(8 * args.hidden_size / 3 / 64) * 64)
    if args.recompute_granularity == "full" and args.recompute_method is None:
        problems.append("--recompute-granularity full needs --recompute-method uniform|block")
    if args.recompute_method and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    if args.eval_iters == 0:
        args.eval_interval = None  # as Megatron-LM: no validation batches, no evaluation
    if args.save_interval is not None and not args.save:
        problems.append("--save-interval needs --save")
    if args.use_distributed_optimizer and (args.save or args.load) \
            and importlib.util.find_spec("psutil") is None:
        problems.append("--save/--load with --use-distributed-optimizer write Megatron-Core "
                        "distributed checkpoints, whose writer needs psutil: pip install psutil "
                        "(or this package's [train] extra)")
    auto = args.seq1f1b_splits == AUTO
    problems += auto_flag_problems(args)
    problems += document_problems(args, auto)
    problems += segment_tokens_flag_problems(args)
    problems += split_lengths_flag_problems(args, args.schedule_seq_length)
    problems += backward_by_documents_flag_problems(args)
    budget = args.seq1f1b_segment_tokens
    if args.seq1f1b and isinstance(budget, int) and budget >= args.schedule_seq_length:
        args.startup_warnings.append(
            f"--seq1f1b-segment-tokens {budget} is at least the longest micro-batch's "
            f"{args.schedule_seq_length} tokens: no micro-batch is cut, each runs whole as one "
            "segment (Megatron's 1F1B order)")
    if args.seq1f1b and args.seq1f1b_backward_by_documents and args.documents is None:
        problems.append("--seq1f1b-backward-by-documents runs a micro-batch's documents apart, "
                        "but the batches carry none: add --reset-attention-mask (end-of-document "
                        "tokens) or --dataloader-inter-document-masking")
    problems += lengths.flag_problems(args)
    # unset: 4, or with --seq1f1b-segment-tokens no cap (the longest micro-batch's count)
    args.seq1f1b_splits = segment_splits(args, args.schedule_seq_length)
    if args.seq1f1b and args.seq1f1b_schedule == "zb-h2" \
            and args.virtual_pipeline_model_parallel_size is not None:
        problems.append(f"--seq1f1b-schedule zb-h2 with virtual pipelining: {ZB_H2_PROBLEM}")
    requested = args.seq1f1b_segment_multiple
    if requested is not None and not args.seq1f1b:
        problems.append("--seq1f1b-segment-multiple needs --seq1f1b")
    elif args.seq1f1b and not auto and args.seq1f1b_splits >= 1 \
            and args.variable_seq_lengths is None \
            and args.seq1f1b_split_lengths is None:  # variable: each cut by its own length;
        # given lengths: checked with their flag
        multiple = segment_multiple(args)  # TP with SP; 2 x CP chunks with CP
        if requested is not None:
            multiple = math.lcm(multiple, requested)
        budget = args.seq1f1b_segment_tokens
        count = args.seq1f1b_splits if budget is None else segment_count(
            args.schedule_seq_length, args.seq1f1b_splits, budget, multiple)
        try:
            split_sequence(args.schedule_seq_length, count, multiple_of=multiple)
        except ValueError as exc:
            flag = "--seq1f1b-splits" if budget is None else "--seq1f1b-segment-tokens"
            problems.append(f"--seq-length / {flag}: {exc}")
    if args.seq1f1b and args.num_experts:
        problems += moe_flag_problems(args)
    if cp > 1:
        problems += context_parallel_problems(args)
    problems += recurrent_problems(args)
    problems += model_shape_problems(args)
    problems += seq1f1b_flag_problems(args)
    if args.data_path and not args.mock_data:
        split = trainer_data.split_weights_problem(args.split)
        problems += [split] if split else []
        problems += trainer_data.data_path_problems(args)
    if problems:  # all at once, one line each, as argparse's own errors: status 2
        refuse(problems)
    return args


def core_attention(args: argparse.Namespace) -> str:
    """The core attention the model gets: ``"flash"`` where ``--attention-backend flash`` asks
    for it, and always with ``--multi-latent-attention`` (Megatron's local attention has one
    K/V width); else ``"local"``. What the model provider builds and the summary reports."""
    return "flash" if args.multi_latent_attention or args.attention_backend == "flash" \
        else "local"


def model_shape_problems(args: argparse.Namespace) -> list[str]:
    """Shapes Megatron-LM's ``validate_args`` (or the layers, later, with a traceback) refuses
    (:func:`~megatron_seq1f1b.base.checks.attention_shape_problems`), a router that picks
    more experts than there are, local experts with linear biases (which fail in Megatron-Core's
    first forward) and a look-ahead window under Seq1F1B."""
    problems = attention_shape_problems(
        args.hidden_size, args.num_attention_heads, args.num_query_groups,
        args.tensor_model_parallel_size, args.ffn_hidden_size)
    if args.num_experts and args.moe_router_topk > args.num_experts:
        problems.append(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts "
                        f"{args.num_experts}")
    problems += local_expert_bias_problems(args.num_experts, args.disable_bias_linear)
    if args.seq1f1b:
        problems += window_problems(args)
    return problems


#: The --seq1f1b-* flags that choose Seq1F1B's plan (the auto budget flags say so themselves).
PLAN_FLAGS = ("--seq1f1b-splits", "--seq1f1b-schedule", "--seq1f1b-partition")


def seq1f1b_flag_problems(args: argparse.Namespace) -> list[str]:
    """Plan flags given without ``--seq1f1b``: Megatron-Core's own schedule would run and
    ignore them."""
    given = [flag for flag in PLAN_FLAGS if flag in getattr(args, "given_flags", ())]
    if args.seq1f1b or not given:
        return []
    return [f"{' / '.join(given)} without --seq1f1b: Megatron-Core's own schedule would run "
            "and ignore it; add --seq1f1b"]


def context_parallel_problems(args: argparse.Namespace) -> list[str]:
    """--context-parallel-size > 1 runs only under Seq1F1B, whose segments gather keys and
    values over the CP group (documents, MoE and MLA included)."""
    if args.seq1f1b:
        return []
    return [f"--context-parallel-size {args.context_parallel_size} needs --seq1f1b: this "
            "trainer's core attentions exchange keys and values over the context-parallel "
            "group only inside Seq1F1B's segments (Megatron-Core's own schedules would give "
            "them none); add --seq1f1b (--seq1f1b-splits 1 for whole micro-batches)"]


def recurrent_problems(args: argparse.Namespace) -> list[str]:
    """Mamba-2 (M) and gated delta net (G) layers of --hybrid-layer-pattern: context
    parallelism (megatron_seq1f1b carries their state without it only), the activation
    Megatron-Core's GatedDeltaNet asserts, and the head counts its layers assert."""
    pattern = args.hybrid_layer_pattern or ""
    mamba, gdn = "M" in pattern, "G" in pattern
    if not (mamba or gdn):
        return []
    problems = []
    layers = " or ".join(name for name, there in (("Mamba-2 (M)", mamba),
                                                   ("gated delta net (G)", gdn)) if there)
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp > 1:
        problems.append(f"--context-parallel-size {cp} with {layers} layers in "
                        "--hybrid-layer-pattern: Seq1F1B carries their state from segment to "
                        "segment without context parallelism only (Megatron's recurrent "
                        "layers split their heads over the context-parallel group); use "
                        "--context-parallel-size 1")
    if gdn and not args.swiglu:
        problems.append("gated delta net (G) layers need the silu activation (Megatron-Core's "
                        "GatedDeltaNet convolution asserts it): add --swiglu, which sets it, as "
                        "in Megatron-LM")
    shape = ModelShape(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=1,
                       vocab_size=1, **recurrent_fields(args))
    for there, sizes in ((mamba, mamba_sizes), (gdn, gdn_sizes)):
        try:
            if there:
                sizes(shape, tp)
        except ValueError as exc:  # Megatron's layers would assert it when built
            named = re.sub(r"\b(?:mamba|linear)_[a-z_]+",
                           lambda field: "--" + field.group(0).replace("_", "-"), str(exc))
            problems.append(f"{named} (with --tensor-model-parallel-size {tp})")
    return problems


def document_problems(args: argparse.Namespace, auto: bool) -> list[str]:
    """The documents flags; fills in how batches carry documents (``args.documents``: None,
    ``"eod"`` or ``"dataset"``; ``args.packed_documents``: THD batches) and the sequence the
    schedules run (``args.schedule_seq_length`` / ``args.schedule_micro_batch_size``: packed
    micro-batches are one sequence of micro-batch size x --seq-length tokens)."""
    problems = []
    args.documents = ("dataset" if args.dataloader_inter_document_masking
                      else "eod" if args.reset_attention_mask else None)
    args.packed_documents = (args.documents is not None and args.attention_backend == "flash"
                             and args.context_parallel_size == 1)  # CP: as on local
    flattened = args.micro_batch_size if args.packed_documents else 1
    args.schedule_seq_length = args.seq_length * flattened
    args.schedule_micro_batch_size = args.micro_batch_size // flattened
    if args.seq1f1b and args.seq1f1b_partition == "documents" and args.documents is None:
        problems.append("--seq1f1b-partition documents cuts every micro-batch by its "
                        "documents: add --reset-attention-mask or "
                        "--dataloader-inter-document-masking")
    if args.documents is None:
        return problems
    flag = ("--dataloader-inter-document-masking" if args.documents == "dataset"
            else "--reset-attention-mask")
    if args.multi_latent_attention:
        problems.append(f"{flag} with --multi-latent-attention is not supported by this "
                        "trainer yet; remove one of them")
    return problems


def parse(argv=None, world_size: int = 1) -> argparse.Namespace:
    """The checked flags of a run on `world_size` ranks (or every rank exits with status 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.given_flags = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    return validate(args, world_size)
