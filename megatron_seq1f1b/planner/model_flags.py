"""The model flags the command lines share: a HybridModel's layer pattern and the sizes of its
recurrent layers, read and checked as Megatron-LM reads them.

The planner, the stage rehearsal, our trainer and the benchmarks take Megatron-LM's
``--hybrid-layer-pattern`` and its ``--mamba-*`` / ``--linear-*`` flags: one reading here, so
that they refuse and derive (``--num-layers``, ``--mtp-num-layers``) alike.
"""

from __future__ import annotations

import argparse

from megatron_seq1f1b.base.flags import ArgumentParser, positive_int
from megatron_seq1f1b.planner.footprint import ModelShape
from megatron_seq1f1b.planner.recurrent import gdn_sizes, mamba_sizes

__all__ = ["RECURRENT_FLAGS", "pattern_stages", "read_hybrid_pattern", "add_recurrent_arguments",
           "recurrent_fields"]


def pattern_stages(args: argparse.Namespace) -> int:
    """The '|' stages of --hybrid-layer-pattern (0 without '|' or without a pattern)."""
    if args.hybrid_layer_pattern is None or "|" not in args.hybrid_layer_pattern:
        return 0
    return len(args.hybrid_layer_pattern.split("/")[0].split("|"))


def read_hybrid_pattern(parser: ArgumentParser, args: argparse.Namespace, pp: int,
                        tool: str) -> tuple[str, str]:
    """--hybrid-layer-pattern as Megatron-LM reads it: --num-layers and --mtp-num-layers from
    the pattern (one pipeline stage: without its '|'); ``tool`` says what takes the layers
    ("the planner costs"); (the pattern, its main part). Errors go through ``parser``."""
    pattern = args.hybrid_layer_pattern
    if pp == 1:  # one stage holds every layer (as Megatron-LM's builders take it)
        pattern = args.hybrid_layer_pattern = pattern.replace("|", "")
    other = sorted(set(pattern) - set("*-EMG|/"))
    if other:
        parser.error(f"--hybrid-layer-pattern {pattern!r}: {tool} attention (*), MLP (-), MoE "
                     f"(E), Mamba-2 (M) and gated delta net (G) layers and MTP depths (/); not "
                     f"{' '.join(other)}")
    main, *depths = pattern.split("/")
    if depths and args.mtp_num_layers not in (None, len(depths)):
        parser.error(f"--mtp-num-layers {args.mtp_num_layers} with a pattern of {len(depths)} "
                     "MTP depths ('/' parts); give one of them")
    if not depths and args.mtp_num_layers:
        parser.error("--mtp-num-layers with --hybrid-layer-pattern: give the MTP depths as '/' "
                     "parts of the pattern (e.g. '*-*-/*-/*-' for two)")
    args.mtp_num_layers = len(depths) or None
    layers = len(main.replace("|", ""))
    if args.num_layers not in (None, layers):
        parser.error(f"--num-layers {args.num_layers}: --hybrid-layer-pattern {pattern!r} has "
                     f"{layers} layers; drop --num-layers")
    args.num_layers = layers
    if "E" in pattern and not args.num_experts:
        parser.error("--hybrid-layer-pattern with MoE layers (E) needs --num-experts")
    _check_recurrent(parser, args, pattern)
    return pattern, main


#: Megatron-LM's flags that size Mamba-2 and gated-delta-net layers (default: Megatron's).
RECURRENT_FLAGS = {
    "mamba_state_dim": "Mamba-2 SSM state per head (d_state; default 128)",
    "mamba_head_dim": "Mamba-2 head width (default 64)",
    "mamba_num_groups": "Mamba-2 groups of B and C (default 8)",
    "mamba_num_heads": "Mamba-2 heads (default 2 x --hidden-size / --mamba-head-dim)",
    "linear_conv_kernel_dim": "gated delta net convolution width (default 4)",
    "linear_key_head_dim": "gated delta net key head width (default 128)",
    "linear_value_head_dim": "gated delta net value head width (default 128)",
    "linear_num_key_heads": "gated delta net key heads (default 16)",
    "linear_num_value_heads": "gated delta net value heads (default 32)",
}


def add_recurrent_arguments(group) -> None:
    """The ``--mamba-*`` and ``--linear-*`` flags (:data:`RECURRENT_FLAGS`)."""
    for name, text in RECURRENT_FLAGS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=None,
                           metavar="N", help=text)


def recurrent_fields(args: argparse.Namespace) -> dict:
    """The recurrent sizes given on the command line, as ``TransformerConfig`` / ``ModelShape``
    fields (the rest keep Megatron's defaults)."""
    return {name: getattr(args, name) for name in RECURRENT_FLAGS
            if getattr(args, name, None) is not None}


def _check_recurrent(parser: ArgumentParser, args: argparse.Namespace, pattern: str) -> None:
    """The M and G layers' sizes as Megatron checks them (heads over groups and TP ranks)."""
    if args.hidden_size is None or not set(pattern) & set("MG"):
        return
    shape = ModelShape(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=1,
                       vocab_size=1, **recurrent_fields(args))
    tp = getattr(args, "tensor_model_parallel_size", 1)
    try:
        if "M" in pattern:
            mamba_sizes(shape, tp)
        if "G" in pattern:
            gdn_sizes(shape, tp)
    except ValueError as exc:
        parser.error(f"--hybrid-layer-pattern {pattern!r}: {exc} (--mamba-* / --linear-* "
                     "flags)")
