"""Megatron-LM's ``--seq1f1b`` flags: their definitions and every check on them.

:mod:`megatron_seq1f1b.megatron_lm` (what the patch hunks call) re-exports all of this;
here live the argument group, the values' parsing and the rules that refuse a combination
before anything is built (:func:`args_problems`), as lists of one-line messages that name
the flags. Importing this module does not import torch or Megatron.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Optional

from megatron_seq1f1b.base.checks import (
    SUPPORTED_POSITIONS, rounding_multiple, segment_multiple, segment_multiple_problems,
)
from megatron_seq1f1b.base.flags import positive_float, positive_int
from megatron_seq1f1b.schedules.interleaved import ZB_H2_PROBLEM
from megatron_seq1f1b.schedules.partition import METHODS, NAMED_PARTITIONS, split_sequence
from megatron_seq1f1b.schedules.schedule import SCHEDULES
from megatron_seq1f1b.schedules.variable import segment_count, segment_tokens_problems
from megatron_seq1f1b.schedules.zero_bubble import VARIANTS

GROUP_TITLE = "seq1f1b"
DEFAULT_SPLITS = 4
DEFAULT_PARTITION = "balanced"
# Partitions a flag can choose: "measured" needs a calibration; its cut goes by lengths.
FLAG_PARTITIONS = NAMED_PARTITIONS
DEFAULT_SCHEDULE = "1f1b"
AUTO = "auto"  # --seq1f1b-splits auto: the planner decides
DEFAULT_MIN_SEGMENT = 128

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "seq1f1b" argument group; a no-op if the flags are already there."""
    if "--seq1f1b" in parser._option_string_actions:  # chained twice: argparse would clash
        return parser
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument(
        "--seq1f1b", action="store_true",
        help="Seq1F1B: split every micro-batch into sequence segments and pipeline the "
             "segments (1F1B per segment; interleaved with virtual pipelining).",
    )
    group.add_argument(
        "--seq1f1b-splits", type=splits_value, default=None, metavar="N|auto",
        help=f"Segments per micro-batch with --seq1f1b (default {DEFAULT_SPLITS}, or as many "
             "as --seq1f1b-split-lengths gives); with "
             "--seq1f1b-segment-tokens the most a micro-batch may get (default: no cap); "
             "'auto': time segments of the first micro-batch on the real model and let "
             "megatron_seq1f1b.planner pick the splits, partition and schedule.",
    )
    group.add_argument(
        "--seq1f1b-segment-tokens", type=positive_int, default=None, metavar="T",
        help="A token budget per segment instead of a fixed count: a micro-batch of S tokens "
             "gets ceil(S / T) segments (a short one stays whole), cut by "
             "--seq1f1b-partition; with micro-batches of different lengths every unit then "
             "costs about the same. --seq1f1b-splits, if given, caps the count.",
    )
    group.add_argument(
        "--seq1f1b-backward-by-documents", action="store_true",
        help="With packed documents: a micro-batch's runs of documents that no cut links go "
             "backward before its later runs come forward, so a stage holds about its longest "
             "run, not its longest micro-batch (needs --calculate-per-token-loss).",
    )
    group.add_argument(
        "--seq1f1b-schedule", choices=SCHEDULES, default=DEFAULT_SCHEDULE,
        help="'1f1b': Seq1F1B; 'zb-h1' / 'zb-h2': zero-bubble Seq1F1B, weight gradients as "
             "separate steps in the bubbles (zb-h1 keeps the first stage's memory, zb-h2 "
             f"holds more for slack). Default {DEFAULT_SCHEDULE}.",
    )
    group.add_argument(
        "--seq1f1b-partition", choices=FLAG_PARTITIONS, default=DEFAULT_PARTITION,
        help="How to cut the sequence: 'uniform' (equal tokens), 'balanced' (equal "
             "estimated FLOPs, longer early segments) or 'documents' (every micro-batch by its "
             "own documents into segments of equal attention cost; needs documents in the "
             f"data: packed batches or end-of-document masking). Default {DEFAULT_PARTITION}.",
    )
    group.add_argument(
        "--seq1f1b-split-lengths", type=split_lengths_value, default=None, metavar="N,N,..",
        help="Segment lengths in tokens, first to last, summing to --seq-length (what the "
             "planner prints for a plan the partitions cannot name, e.g. cut by measured "
             "costs): they set the number of segments and replace --seq1f1b-partition.",
    )
    group.add_argument(
        "--seq1f1b-memory-budget", type=positive_float, default=None, metavar="GIB",
        help="With --seq1f1b-splits auto: most activation memory per pipeline stage the plan "
             "may hold, in GiB (bytes per token measured at start-up).",
    )
    group.add_argument(
        "--seq1f1b-memory-budget-microbatches", type=positive_float, default=None, metavar="N",
        help="With --seq1f1b-splits auto: the same budget in micro-batches of a stage "
             "(Megatron's 1F1B holds p on the first stage).",
    )
    group.add_argument(
        "--seq1f1b-segment-multiple", type=positive_int, default=None, metavar="N",
        help="Round segment lengths to multiples of N tokens (default: 64 on CUDA where the "
             "sequence allows it, for tensor cores; 1 on CPU). The layout's own multiple (the "
             "tensor-parallel size with --sequence-parallel, x8 with FP8) always applies.",
    )
    group.add_argument(
        "--seq1f1b-min-segment-length", type=positive_int, default=DEFAULT_MIN_SEGMENT, metavar="T",
        help=f"With --seq1f1b-splits auto: shortest segment a plan may use (tokens; default "
             f"{DEFAULT_MIN_SEGMENT}).",
    )
    return parser


def extra_args_provider(other: Optional[ArgsProvider] = None) -> ArgsProvider:
    """An ``extra_args_provider`` for ``pretrain()`` that runs `other` (e.g. ModelOpt's) too.

    pretrain() takes a single provider and pretrain_gpt.py already passes one,
    so ours chains instead of replacing it.
    """

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if other is not None:
            result = other(parser)
            parser = result if result is not None else parser
        return add_arguments(parser)

    provider.seq1f1b_chained = other
    return provider


def splits_value(text: str) -> int | str:
    """``--seq1f1b-splits``: a positive integer, or ``auto`` (the planner decides)."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or {AUTO!r}, got {text!r}")
    return value


def split_lengths_value(text: str) -> tuple[int, ...]:
    """``--seq1f1b-split-lengths``: positive token counts separated by commas."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"must be positive token counts separated by commas (e.g. 2048,1024,1024), "
            f"got {text!r}")
    return values


def _flag(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def segment_splits(args: Any, longest: Optional[int] = None) -> int | str:
    """What ``--seq1f1b-splits`` means with these flags: its value where given; unset,
    :data:`DEFAULT_SPLITS`, or with ``--seq1f1b-segment-tokens T`` no cap.

    No cap is ``ceil(longest / T)`` (``longest``: the longest micro-batch, ``--seq-length`` by
    default), which no micro-batch of at most ``longest`` tokens exceeds; at least 2, since a
    cap of 1 cuts nothing. (A fixed default of 4 would silently cap a budget meant to cut a
    long micro-batch finer.) Without a usable length, a cap no micro-batch reaches.
    """
    splits = _flag(args, "seq1f1b_splits")
    if splits is not None:
        return splits
    lengths = _flag(args, "seq1f1b_split_lengths")
    if lengths:
        return len(lengths)
    budget = _flag(args, "seq1f1b_segment_tokens")
    if budget is None or segment_tokens_problems(budget):
        return DEFAULT_SPLITS
    longest = _flag(args, "seq_length") if longest is None else longest
    if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
        return NO_CAP
    return max(2, math.ceil(longest / budget))


#: ``--seq1f1b-segment-tokens`` without ``--seq1f1b-splits`` where no length is known.
NO_CAP = 1 << 20


def _needs_seq1f1b(flag: str) -> list[str]:
    """A flag that cuts segments, given without ``--seq1f1b``."""
    return [f"{flag} needs --seq1f1b (without it Megatron-Core's own schedule runs whole "
            "micro-batches); add --seq1f1b, or leave the flag out"]


def segment_tokens_flag_problems(args: Any) -> list[str]:
    """``--seq1f1b-segment-tokens``: only with ``--seq1f1b``, a positive integer, and with a
    cap that cuts (not ``--seq1f1b-splits 1``) and is not the planner's (``auto``)."""
    budget = _flag(args, "seq1f1b_segment_tokens")
    if budget is None:
        return []
    if not _flag(args, "seq1f1b", False):
        return _needs_seq1f1b("--seq1f1b-segment-tokens")
    problems = segment_tokens_problems(budget)
    splits = _flag(args, "seq1f1b_splits")
    if splits == AUTO:
        problems.append("--seq1f1b-segment-tokens with --seq1f1b-splits auto: the planner "
                        "chooses the segments itself; give one of them (--seq1f1b-splits N "
                        "with a budget is a cap)")
    elif splits == 1:
        problems.append("--seq1f1b-splits 1 with --seq1f1b-segment-tokens: --seq1f1b-splits "
                        "is the most segments a micro-batch gets, so nothing would be cut; "
                        "leave --seq1f1b-splits out (no cap) or give a larger cap")
    return problems


def split_lengths_flag_problems(args: Any, seq_length: Optional[int] = None) -> list[str]:
    """``--seq1f1b-split-lengths``: only with ``--seq1f1b``, one cut for micro-batches of
    ``seq_length`` tokens (default ``--seq-length``) that no other flag cuts otherwise, each
    segment a multiple of the layout's multiple."""
    lengths = _flag(args, "seq1f1b_split_lengths")
    if lengths is None:
        return []
    if not _flag(args, "seq1f1b", False):
        return _needs_seq1f1b("--seq1f1b-split-lengths")
    problems = []
    splits = _flag(args, "seq1f1b_splits")
    if splits == AUTO:
        problems.append("--seq1f1b-split-lengths with --seq1f1b-splits auto: the planner "
                        "chooses the segments itself; give one of them")
    elif splits is not None and splits != len(lengths):
        problems.append(f"--seq1f1b-split-lengths gives {len(lengths)} segments but "
                        f"--seq1f1b-splits is {splits}: leave --seq1f1b-splits out (the "
                        "lengths set it), or make the two agree")
    if _flag(args, "seq1f1b_segment_tokens") is not None:
        problems.append("--seq1f1b-split-lengths with --seq1f1b-segment-tokens: the lengths "
                        "fix one cut, the budget cuts each micro-batch by its length; give one")
    if _flag(args, "seq1f1b_partition", DEFAULT_PARTITION) == "documents":
        problems.append("--seq1f1b-split-lengths with --seq1f1b-partition documents: that "
                        "partition cuts each micro-batch by its own documents; give one")
    if _flag(args, "variable_seq_lengths"):
        problems.append("--seq1f1b-split-lengths with micro-batches of different lengths: one "
                        "cut cannot fit them all; use --seq1f1b-segment-tokens")
    seq_length = _flag(args, "seq_length") if seq_length is None else seq_length
    if isinstance(seq_length, int) and sum(lengths) != seq_length:
        problems.append(f"--seq1f1b-split-lengths sum to {sum(lengths)} tokens, not the "
                        f"--seq-length {seq_length}")
    requested = _flag(args, "seq1f1b_segment_multiple")
    multiple = segment_multiple(args)  # TP with SP, 2 x CP chunks, x8 with FP8
    if isinstance(requested, int) and requested > 0:
        multiple = math.lcm(multiple, requested)
    uneven = [n for n in lengths if n % multiple]
    if uneven:
        problems.append(f"--seq1f1b-split-lengths {','.join(map(str, uneven))}: every segment "
                        f"must be a multiple of {multiple} tokens (--tensor-model-parallel-size "
                        "with --sequence-parallel, 2 x --context-parallel-size chunks, times 8 "
                        "with --fp8-format, and --seq1f1b-segment-multiple)")
    return problems


def backward_by_documents_flag_problems(args: Any) -> list[str]:
    """``--seq1f1b-backward-by-documents``: only with ``--seq1f1b`` and per-token loss (the rest
    of what it needs the executor checks, before any message)."""
    if not _flag(args, "seq1f1b_backward_by_documents", False):
        return []
    if not _flag(args, "seq1f1b", False):
        return ["--seq1f1b-backward-by-documents needs --seq1f1b; add it, or leave the flag out"]
    problems = []
    if not _flag(args, "calculate_per_token_loss", False):
        problems.append("--seq1f1b-backward-by-documents needs --calculate-per-token-loss: a "
                        "micro-batch's token count is known only after its first runs went "
                        "backward")
    if _flag(args, "seq1f1b_splits") == AUTO:
        problems.append("--seq1f1b-backward-by-documents with --seq1f1b-splits auto: the planner "
                        "plans whole micro-batches; give --seq1f1b-segment-tokens (and "
                        "--seq1f1b-partition documents) instead of auto")
    return problems


def window_problems(args: Any) -> list[str]:
    """``--window-size (w, r)`` under ``--seq1f1b``: a window may look back, not ahead (the
    patched Megatron-LM scripts and this project's trainer share the rule)."""
    window = _flag(args, "window_size")
    if window is None or (len(window) == 2 and window[0] >= 0 and window[1] == 0):
        return []
    return [f"--window-size {tuple(window)}: under --seq1f1b a window looks back w >= 0 tokens "
            "and not ahead (a later segment's keys do not exist when an earlier one runs); use "
            "--window-size '(w, 0)'"]


def auto_flag_problems(args: Any) -> list[str]:
    """The flags that steer ``--seq1f1b-splits auto``: only with it, and positive."""
    problems = []
    gib = _flag(args, "seq1f1b_memory_budget")
    microbatches = _flag(args, "seq1f1b_memory_budget_microbatches")
    shortest = _flag(args, "seq1f1b_min_segment_length", DEFAULT_MIN_SEGMENT)
    steered = gib is not None or microbatches is not None or shortest != DEFAULT_MIN_SEGMENT
    missing = [flag for flag, given in (
        ("--seq1f1b", _flag(args, "seq1f1b", False)),
        ("--seq1f1b-splits auto", _flag(args, "seq1f1b_splits", DEFAULT_SPLITS) == AUTO))
        if not given]
    if steered and missing:  # say only what is missing
        problems.append("--seq1f1b-memory-budget(-microbatches) / --seq1f1b-min-segment-length "
                        f"steer --seq1f1b-splits auto; add {' '.join(missing)}")
    if gib is not None and not gib > 0:
        problems.append(f"--seq1f1b-memory-budget must be > 0 (GiB), got {gib}")
    if microbatches is not None and not microbatches > 0:
        problems.append("--seq1f1b-memory-budget-microbatches must be > 0 (micro-batches of a "
                        f"stage), got {microbatches}")
    if shortest is not None and shortest < 1:
        problems.append(f"--seq1f1b-min-segment-length must be >= 1, got {shortest}")
    return problems


def args_problems(args: Any) -> list[str]:
    """Every reason Seq1F1B cannot run with these Megatron-LM arguments (empty if fine).

    `args` is Megatron-LM's namespace (any object with its attribute names);
    messages name the flag to change. Without ``--seq1f1b`` only that no
    ``--seq1f1b-segment-tokens`` is given (it would be ignored).
    """
    if not _flag(args, "seq1f1b", False):  # flags of ours that need --seq1f1b
        return (segment_tokens_flag_problems(args) + backward_by_documents_flag_problems(args)
                + split_lengths_flag_problems(args))
    problems: list[str] = backward_by_documents_flag_problems(args)
    problems += split_lengths_flag_problems(args)
    if _flag(args, "seq1f1b_backward_by_documents", False) and documents_source(args) is None:
        problems.append("--seq1f1b-backward-by-documents runs a micro-batch's documents apart, "
                        "but no documents reach the schedule: add --sft or "
                        "--dataloader-inter-document-masking (packed batches), or "
                        "--reset-attention-mask with --attention-backend flash")
    splits = segment_splits(args)
    budget = _flag(args, "seq1f1b_segment_tokens")
    if segment_tokens_problems(budget):
        budget = None  # said below
    problems += auto_flag_problems(args)
    problems += segment_tokens_flag_problems(args)
    if splits == AUTO:
        splits = None
    elif isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        problems.append(f"--seq1f1b-splits must be a positive integer, got {splits!r}")
        splits = None
    partition = _flag(args, "seq1f1b_partition", DEFAULT_PARTITION)
    if partition == "measured":
        problems.append(
            "--seq1f1b-partition measured needs calibrated costs, which flags cannot pass; "
            "give its cut as --seq1f1b-split-lengths (python -m megatron_seq1f1b.planner prints "
            "it), or use balanced"
        )
    elif partition not in METHODS:
        problems.append(
            f"--seq1f1b-partition {partition!r} is unknown; choose one of "
            f"{', '.join(FLAG_PARTITIONS)}"
        )
    schedule = _flag(args, "seq1f1b_schedule", DEFAULT_SCHEDULE)
    if schedule not in SCHEDULES:
        problems.append(
            f"--seq1f1b-schedule {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}"
        )
    interleaved = _flag(args, "virtual_pipeline_model_parallel_size") is not None
    if schedule == "zb-h2" and interleaved:
        problems.append(f"--seq1f1b-schedule zb-h2 with virtual pipelining: {ZB_H2_PROBLEM}")
    if schedule in VARIANTS and _flag(args, "transformer_impl", "local") == "transformer_engine":
        problems.append(
            f"--seq1f1b-schedule {schedule} with --transformer-impl transformer_engine needs "
            "Transformer Engine layers built with delayed weight gradients, which Megatron-LM "
            "allows only together with --overlap-moe-expert-parallel-comm (not supported with "
            "--seq1f1b); use --transformer-impl local, or --seq1f1b-schedule 1f1b (Megatron-Core "
            "users: see docs/design.md, 'Transformer Engine layers')"
        )

    # Parallelism that cuts or reorders the sequence itself.
    problems += context_parallel_problems(args)
    if _flag(args, "hybrid_context_parallel", False):
        problems.append("--hybrid-context-parallel is not supported with --seq1f1b; remove it")
    if _flag(args, "rl_use_sequence_packing", False):
        problems.append(
            "--rl-use-sequence-packing packs RL rollouts into bins with their own micro-batch "
            "count per step (Megatron-LM's RL loop, not pretrain_gpt.py's packed batches); use "
            "--no-rl-use-sequence-packing"
        )
    seq_length = _flag(args, "seq_length")
    decoder_seq_length = _flag(args, "decoder_seq_length")
    if decoder_seq_length is not None and decoder_seq_length != seq_length:
        problems.append(
            f"--decoder-seq-length {decoder_seq_length} differs from --seq-length {seq_length}: "
            "GPT models have no separate decoder length; remove --decoder-seq-length"
        )

    if flash_attention_requested(args):
        problems += flash_attention_problems(args)
    problems += document_problems(args)

    # Model features without a per-segment implementation.
    if _flag(args, "use_legacy_models", False):
        problems.append(
            "--use-legacy-models: Seq1F1B prepares Megatron-Core GPTModel only; remove the flag"
        )
    if _flag(args, "num_experts"):
        problems += moe_flag_problems(args)
    if _flag(args, "overlap_moe_expert_parallel_comm", False):
        problems.append(
            "--overlap-moe-expert-parallel-comm (combined 1F1B schedule) is not supported; "
            "remove it"
        )
    if _flag(args, "mtp_num_layers"):
        problems += _mtp_problems(args)
    if _flag(args, "multi_latent_attention", False):
        if _flag(args, "rope_type") in (None, "yarn") and _flag(args, "apply_rope_fusion", False):
            problems.append(
                "--multi-latent-attention with YaRN (--rope-type yarn, the default): the fused "
                "RoPE reads cos/sin cached from position 0, not the segment's offset; add "
                "--no-rope-fusion"
            )
        if _flag(args, "mla_down_proj_fusion", False):
            problems.append(
                "--mla-down-proj-fusion: the fused MLA applies RoPE without a position offset; "
                "remove it"
            )
    if _flag(args, "experimental_attention_variant") is not None:
        problems.append(
            f"--experimental-attention-variant {_flag(args, 'experimental_attention_variant')!r}"
            " has no segment key/value cache; remove it"
        )
    problems += window_problems(args)
    position = _flag(args, "position_embedding_type", "learned_absolute")
    if position not in SUPPORTED_POSITIONS:
        problems.append(
            f"--position-embedding-type {position}: use one of {', '.join(SUPPORTED_POSITIONS)}"
        )

    # Execution features that assume one fixed shape or own the activations.
    if (_flag(args, "cuda_graph_impl", "none") or "none") != "none":
        problems.append(
            f"--cuda-graph-impl {_flag(args, 'cuda_graph_impl')}: CUDA graphs capture one "
            "shape, segments differ in length; use --cuda-graph-impl none"
        )
    if _flag(args, "enable_cuda_graph", False) or _flag(args, "external_cuda_graph", False):
        problems.append(
            "--enable-cuda-graph / --external-cuda-graph: CUDA graphs capture one shape, "
            "segments differ in length; remove them"
        )
    if _flag(args, "fine_grained_activation_offloading", False):
        problems.append(
            "--fine-grained-activation-offloading frees activations the segment key/value "
            "cache shares; remove it"
        )
    if _flag(args, "overlap_p2p_comm", False) and _flag(
        args, "virtual_pipeline_model_parallel_size"
    ) is None:
        problems.append(
            "overlap of pipeline communication needs virtual pipelining (as in Megatron): "
            "add --no-overlap-p2p-communication, or interleave with "
            "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"
        )
    if _flag(args, "tp_comm_overlap", False):
        problems.append(
            "--tp-comm-overlap sizes Transformer Engine's userbuffers for the whole sequence; "
            "segments are shorter; remove it"
        )
    for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if _flag(args, name, False):
            flag = "--" + name.replace("_", "-")
            problems.append(
                f"{flag} is untested with bottom-right causal masks over a K/V prefix; "
                "remove it (FP8 linear layers with --fp8-format are fine)"
            )
    for name in ("logits_load_dir", "logits_save_dir"):
        if _flag(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            problems.append(
                f"{flag}: cached-logits distillation reads and writes the logits of whole "
                "micro-batches, Seq1F1B computes them one segment at a time; remove it"
            )
    if _flag(args, "modelopt_enabled", False) or _flag(args, "export_kd_teacher_load"):
        problems.append(
            "ModelOpt models (--modelopt-enabled, a ModelOpt checkpoint in --load, or "
            "distillation with --export-kd-teacher-load) are not supported with --seq1f1b"
        )

    # Segment lengths: with sequence parallelism each one must divide by the TP size, and by
    # --seq1f1b-segment-multiple if given.
    requested = _flag(args, "seq1f1b_segment_multiple")
    problems += segment_multiple_problems(requested)
    if splits is not None and isinstance(seq_length, int) and not segment_multiple_problems(
            requested) and _flag(args, "seq1f1b_split_lengths") is None:  # those said above
        multiple = (rounding_multiple(args, seq_length, splits, requested, on_cuda=False)
                    if requested is not None else segment_multiple(args))  # args: config names
        count = splits if budget is None else segment_count(seq_length, splits, budget, multiple)
        try:
            split_sequence(seq_length, count, "uniform", multiple_of=multiple)
        except ValueError:
            problems.append(_cut_problem(seq_length, splits, budget, multiple, requested))
    return problems


def _cut_problem(seq_length: int, splits: int, budget: Optional[int], multiple: int,
                 requested: Optional[int]) -> str:
    """Why ``--seq-length`` cannot be cut into the flags' segments (one line, the fix)."""
    if budget is not None:  # the count is never more than the length allows: it divides not
        return (f"--seq-length {seq_length} cannot be cut into segments of "
                f"--seq1f1b-segment-tokens {budget}: every segment must be a multiple of "
                f"{multiple} tokens; use a --seq-length divisible by {multiple}")
    if multiple > 1:
        where = (f"every segment must be a multiple of {multiple} tokens "
                 "(--tensor-model-parallel-size with --sequence-parallel, 2 x "
                 "--context-parallel-size chunks with context parallelism, times 8 "
                 "with --fp8-format" + (f"; --seq1f1b-segment-multiple {requested}"
                                        if requested is not None else "") + ")")
        fix = (f"use --seq1f1b-splits <= {seq_length // multiple} and a --seq-length "
               f"divisible by {multiple}")
    else:
        where = "every segment needs at least one token"
        fix = f"use --seq1f1b-splits <= {seq_length}"
    return (f"--seq-length {seq_length} cannot be cut into --seq1f1b-splits {splits} "
            f"segments: {where}; {fix}")


#: ``--cp-comm-type`` values segments run (they all-gather each segment's keys and values).
CP_COMM_TYPES = ("p2p", "all_gather")


def context_parallel_problems(args: Any) -> list[str]:
    """``--context-parallel-size`` > 1 under ``--seq1f1b``: what runs and what does not.

    Each segment is cut into ``2 x cp`` chunks over the CP group, which gathers its keys and
    values (:mod:`megatron_seq1f1b.attention.context_parallel`), with Megatron's local attention or
    the flash one (``--transformer-impl local``). Refused: Transformer Engine's attention
    (its CP path is not wired into segments yet), ``--cp-comm-type`` a2a / a2a+p2p, packed
    (THD) documents, and multi-latent attention without the flash attention. Hybrid CP is
    refused on its own.
    """
    cp = _flag(args, "context_parallel_size", 1) or 1
    if cp <= 1:
        return []
    flag = f"--context-parallel-size {cp}"
    problems = []
    if _flag(args, "transformer_impl", "transformer_engine") != "local":
        problems.append(
            f"{flag} with --transformer-impl {_flag(args, 'transformer_impl', 'transformer_engine')}"
            ": Transformer Engine's context-parallel attention does not run inside Seq1F1B "
            "segments yet; use --transformer-impl local (Megatron's local attention, or "
            "--attention-backend flash --no-create-attention-mask-in-dataloader)")
    kinds = _flag(args, "cp_comm_type", None)
    kinds = kinds if isinstance(kinds, (list, tuple)) else [kinds]
    odd = [str(k) for k in kinds if k is not None and k not in CP_COMM_TYPES]
    if odd:
        problems.append(
            f"--cp-comm-type {' '.join(dict.fromkeys(odd))}: Seq1F1B's segments all-gather "
            "their keys and values over the context-parallel group; use --cp-comm-type p2p "
            "(the default) or all_gather")
    packed = packed_documents_flag(args)
    if packed is not None:
        problems.append(
            f"{flag} with {packed}: packed (THD) batches would need each document cut over "
            "the context-parallel group; use --context-parallel-size 1, or keep documents "
            "apart with --reset-attention-mask (end-of-document tokens)")
    if _flag(args, "multi_latent_attention", False) and not flash_attention_requested(args):
        problems.append(f"{flag} with --multi-latent-attention needs --attention-backend flash "
                        "(Seq1F1B's core attention that takes MLA's key and value widths)")
    return problems


def moe_flag_problems(args: Any) -> list[str]:
    """MoE flags whose result depends on how many tokens share a forward (see checks.moe_problems)."""
    problems = []
    if _flag(args, "moe_expert_capacity_factor") is not None:
        problems.append(
            f"--moe-expert-capacity-factor {_flag(args, 'moe_expert_capacity_factor')}: token "
            "dropping fills each expert's capacity per forward, so a segment would drop other "
            "tokens than the full sequence; remove it (dropless MoE)"
        )
    if _flag(args, "moe_expert_rank_capacity_factor") is not None:
        problems.append(
            "--moe-expert-rank-capacity-factor: Megatron-LM wraps the schedule in "
            "PagedStashRunner, which caps tokens per expert rank per forward (a segment would "
            "overflow differently than the full sequence); remove it"
        )
    coeff = _flag(args, "moe_aux_loss_coeff", 0) or 0
    coeffs = coeff if isinstance(coeff, (list, tuple)) else [coeff]
    losses = bool(_flag(args, "moe_z_loss_coeff")) or any(float(c) > 0 for c in coeffs)
    recompute = _flag(args, "recompute_granularity")
    if losses and (recompute == "full" or (
            recompute == "selective" and "moe" in (_flag(args, "recompute_modules") or []))):
        problems.append(
            f"--recompute-granularity {recompute} recomputes MoE layers, whose router losses "
            "then run inside the backward, after later segments' counts are needed; recompute "
            "other modules (--recompute-modules without moe)"
        )
    return problems


def flash_attention_requested(args: Any) -> bool:
    """``--attention-backend flash --transformer-impl local``: our SDPA flash attention.

    Megatron-LM's ``--attention-backend`` only steers Transformer Engine (its
    ``NVTE_*`` variables); with ``--transformer-impl local`` it still builds
    the unfused ``DotProductAttention``. Patched checkouts give that request
    :class:`~megatron_seq1f1b.attention.flash.FlashDotProductAttention`
    (with or without ``--seq1f1b``).
    """
    backend = _flag(args, "attention_backend")
    return (getattr(backend, "name", backend) == "flash"
            and _flag(args, "transformer_impl", "transformer_engine") == "local")


def flash_attention_problems(args: Any) -> list[str]:
    """What the flash core attention cannot take: a dense attention mask from the data, and
    documents by end-of-document tokens outside Seq1F1B's schedule (which knows them)."""
    problems = []
    if _flag(args, "reset_attention_mask", False) and not _flag(args, "seq1f1b", False):
        problems.append(
            "--reset-attention-mask with --attention-backend flash --transformer-impl local: "
            "the flash attention takes no dense [s, s] mask; it keeps documents apart only "
            "under --seq1f1b (which reads them from the end-of-document tokens); add --seq1f1b, "
            "or use --attention-backend local"
        )
    if _flag(args, "create_attention_mask_in_dataloader", True):
        problems.append(
            "--attention-backend flash with --transformer-impl local computes the causal mask "
            "itself and takes no [b, 1, s, s] mask from the data (that mask is what flash "
            "attention avoids); add --no-create-attention-mask-in-dataloader"
        )
    return problems


#: Documents source passed to the schedule for ``--reset-attention-mask``: the tokenizer's
#: end-of-document id, read when the model is prepared (:func:`end_of_document_id`).
EOD = "eod"


def _mtp_problems(args: Any) -> list[str]:
    """--mtp-num-layers under Seq1F1B: the next tokens of later segments are served per
    segment (megatron_seq1f1b.segments.mtp), except with these."""
    problems = []
    cp = _flag(args, "context_parallel_size", 1) or 1
    if cp > 1:
        problems.append(f"--mtp-num-layers with --context-parallel-size {cp}: Megatron's MTP "
                        "roll exchanges borders of its own zig-zag split, not of Seq1F1B's "
                        "segments; use --context-parallel-size 1")
    if _flag(args, "mtp_use_repeated_layer", False):
        problems.append("--mtp-use-repeated-layer: one MTP layer at every depth would share "
                        "one K/V carry-over between depths; remove it")
    return problems


def packed_documents_flag(args: Any) -> Optional[str]:
    """The flag that makes pretrain_gpt.py's batches packed (THD, ``cu_seqlens``), or None.

    ``--sft`` (every tag) and ``--dataloader-inter-document-masking`` (core_v0.19)
    give every micro-batch ``cu_seqlens`` (``cu_seqlens_padded``, ``max_seqlen``).
    """
    for name in ("sft", "dataloader_inter_document_masking"):
        if _flag(args, name, False):
            return "--" + name.replace("_", "-")
    return None


def documents_source(args: Any) -> Optional[str]:
    """Where the schedule finds each micro-batch's documents with these flags (or None).

    * ``"cu_seqlens"``: packed batches (:func:`packed_documents_flag`);
    * :data:`EOD`: ``--reset-attention-mask`` where the documents must be known to the
      schedule: without a dense mask from the data (the flash attention, or
      ``--no-create-attention-mask-in-dataloader``, where Megatron's local attention
      would be causal across documents) or with ``--seq1f1b-partition documents``.
      Elsewhere the dataset's dense ``[b, 1, s, s]`` mask, cut per segment, keeps
      documents apart as it always did;
    * None: no documents (one per sequence).
    """
    if packed_documents_flag(args) is not None:
        return "cu_seqlens"
    if _flag(args, "reset_attention_mask", False) and (
            flash_attention_requested(args)
            or not _flag(args, "create_attention_mask_in_dataloader", True)
            or _flag(args, "seq1f1b_partition", DEFAULT_PARTITION) == "documents"):
        return EOD
    return None


def document_problems(args: Any) -> list[str]:
    """Documents under ``--seq1f1b``: what carries them must reach every segment's attention."""
    problems = []
    source = documents_source(args)
    packed = packed_documents_flag(args)
    te = _flag(args, "transformer_impl", "transformer_engine") == "transformer_engine"
    reset = _flag(args, "reset_attention_mask", False)
    if reset and te and packed is None:
        problems.append(
            "--reset-attention-mask with --transformer-impl transformer_engine: Transformer "
            "Engine's flash and fused attention ignore the dense [b, 1, s, s] document mask it "
            "makes (only the unfused backend applies it), so documents would attend to each "
            "other; keep documents apart with --dataloader-inter-document-masking (core_v0.19: "
            "packed THD batches that Transformer Engine honours), or use --transformer-impl "
            "local (--attention-backend flash --no-create-attention-mask-in-dataloader for "
            "long sequences)"
        )
    elif (_flag(args, "seq1f1b_partition", DEFAULT_PARTITION) == "documents"
          and source is None):
        problems.append(
            "--seq1f1b-partition documents cuts every micro-batch at its documents' ends, but "
            "these flags give no documents; add --sft, --dataloader-inter-document-masking "
            "(core_v0.19) or --reset-attention-mask, or use --seq1f1b-partition balanced"
        )
    if source is None:
        return problems
    if packed is None:
        return problems
    for name in ("micro_batch_size", "eval_micro_batch_size"):
        size = _flag(args, name)
        if name == "eval_micro_batch_size" and size == _flag(args, "micro_batch_size"):
            continue  # Megatron-LM copies --micro-batch-size there: reported once
        if isinstance(size, int) and size > 1:
            problems.append(
                f"--{name.replace('_', '-')} {size} with {packed}: packed (THD) batches hold "
                "one sample per micro-batch under Seq1F1B (Megatron-LM flattens b samples into "
                f"one sequence of b x --seq-length tokens, which the segments do not describe); "
                f"use --{name.replace('_', '-')} 1"
            )
    if (_flag(args, "apply_rope_fusion", False)
            and _flag(args, "position_embedding_type") == "rope"):
        problems.append(
            f"{packed} with fused RoPE: the fused THD RoPE kernel starts every document piece "
            "of a segment at position 0, also the part of a document that crossed from earlier "
            "segments; add --no-rope-fusion"
        )
    if _flag(args, "multi_latent_attention", False) and _flag(args, "rope_type") in (None,
                                                                                       "yarn"):
        problems.append(
            f"{packed} with --multi-latent-attention and YaRN RoPE (--rope-type yarn, the "
            "default): its rotary table cannot be read per document position in a segment; "
            "use --rope-type rope"
        )
    return problems
