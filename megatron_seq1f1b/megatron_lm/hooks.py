"""Megatron-LM integration: everything the patch hunks in a Megatron-LM checkout call.

The patches (``megatron_seq1f1b/megatron_lm/patches/megatron-lm/<tag>/``, applied by
:mod:`megatron_seq1f1b.megatron_lm.patch`) only add calls into this module,
so that the logic lives, and is tested, here:

* ``pretrain_gpt.py``: :func:`extra_args_provider` adds the ``--seq1f1b``
  flags (chained with ModelOpt's provider); every model chunk is prepared
  right after it is built (:func:`prepare_model`: validate,
  :func:`~megatron_seq1f1b.enable`, :func:`~megatron_seq1f1b.install`, which
  makes training and evaluation use the Seq1F1B schedule); the batch that
  ``get_batch`` returns is cut to the current segment, after the
  tensor-parallel broadcast of the full micro-batch.
* ``megatron/training/arguments.py``: ``validate_args`` ends with
  :func:`validate_args`, so bad combinations fail before anything is built.
* Context parallelism (``--context-parallel-size``): the GPT builder
  (``gpt_builders.py``; core_v0.19: ``megatron/training/models/gpt.py``) passes
  its layer spec through :func:`layer_spec`, and ``pretrain_gpt.py`` rebinds
  ``get_batch_on_this_cp_rank`` to :func:`context_parallel_cut`, so that
  ``get_batch`` keeps the whole sequence for the segment cut.

The flags and the checks on them are :mod:`megatron_seq1f1b.megatron_lm.arguments`
(re-exported here). Megatron-LM changed two of these places between tags; each change has a small
adapter here, and all adapters share one code path:

=================  ===========================  ==============================
tag                model chunks prepared by     segment batch cut by
=================  ===========================  ==============================
core_v0.16/0.17    :func:`wrap_model_provider`  :func:`slice_gpt_batch` (6-tuple)
core_v0.18         :func:`wrap_model_provider`  :func:`slice_gpt_batch_fields`
core_v0.19         :func:`add_post_wrap_hook`   :func:`slice_gpt_batch_fields`
=================  ===========================  ==============================

Packed documents (``--sft``; core_v0.19's ``--dataloader-inter-document-masking``)
reach the schedule as ``documents="cu_seqlens"`` and each segment's batch
carries its own document pieces; ``--reset-attention-mask`` without a dense
mask from the data (the flash attention) or with ``--seq1f1b-partition
documents`` gives the schedule the tokenizer's end-of-document id
(:func:`documents_source`).

Without ``--seq1f1b`` every function here is a no-op (or the identity).
Importing this module does not import torch or Megatron.
``python -m megatron_seq1f1b.megatron_lm`` prints the flags' help without a checkout (an
unpatched ``pretrain_gpt.py --help`` fails in core_v0.18.2 and core_v0.19.0; a patched one
lists these flags with Megatron's own, :func:`help_with_flags`).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from typing import Any, Callable, Optional

from megatron_seq1f1b.base.checks import raise_if
# The flags and their checks live in megatron_lm.arguments; the hunks call them through here.
from megatron_seq1f1b.megatron_lm.arguments import (
    AUTO, CP_COMM_TYPES, DEFAULT_MIN_SEGMENT, DEFAULT_PARTITION, DEFAULT_SCHEDULE,
    DEFAULT_SPLITS, EOD, FLAG_PARTITIONS, GROUP_TITLE, NO_CAP, _flag, add_arguments,
    args_problems, auto_flag_problems, context_parallel_problems, document_problems,
    documents_source, extra_args_provider, flash_attention_problems, flash_attention_requested,
    moe_flag_problems, packed_documents_flag, segment_splits, segment_tokens_flag_problems,
    splits_value,
)

__all__ = [
    # the flags (megatron_lm.arguments)
    "AUTO", "CP_COMM_TYPES", "DEFAULT_MIN_SEGMENT", "DEFAULT_PARTITION", "DEFAULT_SCHEDULE",
    "DEFAULT_SPLITS", "EOD", "FLAG_PARTITIONS", "GROUP_TITLE", "NO_CAP", "add_arguments",
    "args_problems", "auto_flag_problems", "context_parallel_problems", "document_problems",
    "documents_source", "extra_args_provider", "flash_attention_problems",
    "flash_attention_requested", "moe_flag_problems", "packed_documents_flag", "segment_splits",
    "segment_tokens_flag_problems", "splits_value",
    # what the hunks call, and the batch cut
    "layer_spec", "context_parallel_cut", "validate_args", "help_with_flags", "prepare_model",
    "wrap_model_provider", "add_post_wrap_hook", "end_of_document_id", "use_flash_attention",
    "GPT_BATCH_KEYS", "slice_gpt_batch", "slice_gpt_batch_fields", "flags_parser", "main",
]

def _megatron_args_if_set() -> Any:
    """Megatron-LM's parsed arguments, or None where they are not set (a builder used
    outside Megatron-LM's training scripts)."""
    try:
        return _megatron_args()
    except (AssertionError, ImportError):
        return None


def layer_spec(spec: Any, args: Any = None) -> Any:
    """The layer (or block) spec Megatron-LM's GPT builder is about to build, made buildable
    with ``--seq1f1b`` and ``--context-parallel-size`` > 1; otherwise `spec` itself.

    Megatron's local ``DotProductAttention`` asserts CP 1 when it is built (it has no CP
    exchange); under Seq1F1B the segments make the exchange, so its core attention becomes
    :func:`megatron_seq1f1b.attention.context_parallel.local_attention_class` (built as for one CP
    rank, refusing to run outside Seq1F1B's schedule), or, with ``--attention-backend flash
    --transformer-impl local``, :class:`~megatron_seq1f1b.attention.flash.FlashDotProductAttention`
    (which takes CP). No parameters change. Called by the patch hunks in ``gpt_builders.py``
    (core_v0.16-0.18) and ``megatron/training/models/gpt.py`` (core_v0.19) right before the
    model is built.
    """
    if args is None:
        args = _megatron_args_if_set()
    if spec is None or args is None or not _flag(args, "seq1f1b", False) \
            or (_flag(args, "context_parallel_size", 1) or 1) <= 1:
        return spec
    if flash_attention_requested(args):
        from megatron_seq1f1b.attention.flash import flash_layer_spec

        return flash_layer_spec(spec)
    from megatron_seq1f1b.attention.context_parallel import context_parallel_layer_spec

    return context_parallel_layer_spec(spec)


def context_parallel_cut(cut: Callable) -> Callable:
    """``pretrain_gpt.py``'s ``get_batch_on_this_cp_rank``, which keeps the whole micro-batch
    inside a Seq1F1B segment with context parallelism.

    Megatron-LM's ``get_batch`` cuts the whole sequence into ``2 x cp`` chunks and keeps this
    CP rank's two; under ``--seq1f1b`` the segment must be cut first and then this rank's part
    of it (the patched ``forward_step`` does both, :func:`slice_gpt_batch`), so inside a
    segment whose run has CP > 1 the batch passes unchanged. Elsewhere (no ``--seq1f1b``,
    CP 1) `cut` runs as before. The patch rebinds the name in ``pretrain_gpt.py`` once, after
    its imports; ``get_batch`` looks it up at call time.
    """
    if getattr(cut, "seq1f1b_cut", None) is not None:
        return cut

    def get_batch_on_this_cp_rank(batch, *args, **kwargs):
        from megatron_seq1f1b.segments.run import active

        current = active()
        if current is not None and current.run.cp_size > 1:
            return batch
        return cut(batch, *args, **kwargs)

    get_batch_on_this_cp_rank.seq1f1b_cut = cut
    get_batch_on_this_cp_rank.__doc__ = context_parallel_cut.__doc__
    return get_batch_on_this_cp_rank


def validate_args(args: Any) -> None:
    """Raise :class:`~megatron_seq1f1b.ConfigError` listing every unsupported option.

    Called at the end of Megatron-LM's ``validate_args`` (after it derived the
    virtual pipeline size and reset ``overlap_p2p_comm``). No-op without ``--seq1f1b``.
    """
    raise_if(args_problems(args))


def help_with_flags(other: Optional[Callable] = None) -> None:
    """Answer ``-h`` / ``--help`` with the ``--seq1f1b`` flags listed; otherwise nothing.

    ``pretrain_gpt.py`` wraps ``pretrain`` for in-process restarts first, and the wrapper
    parses the command line without the extra arguments ``pretrain()`` adds later, so
    argparse answers ``--help`` there, without ours. This parses it first, with them
    (``other``: the script's own provider, ModelOpt's, chained as in ``pretrain()``).
    """
    if not {"-h", "--help"} & set(sys.argv[1:]):
        return
    from megatron.training.arguments import parse_args

    provider = extra_args_provider(other)

    def with_printable_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = provider(parser)
        for action in parser._actions:
            if action.help and "%" in action.help:
                action.help = _printable_help(action.help)
        return parser

    parse_args(extra_args_provider=with_printable_help, ignore_unknown_args=True)


def _printable_help(text: str) -> str:
    """``text`` with every bare '%' doubled where argparse could not format it.

    core_v0.18.2+ has a help text with a bare '%' ('(e.g. 1.10 = 10%)'), on which argparse's
    ``--help`` stops with a ValueError; '%%' and '%(default)s' stay as they are.
    """
    try:
        text % collections.defaultdict(str)
        return text
    except (ValueError, TypeError):
        return re.sub(r"%%|%\([^)]*\)|%", lambda m: m.group(0) if len(m.group(0)) > 1 else "%%",
                      text)


def _megatron_args() -> Any:
    """Megatron-LM's parsed arguments (a separate function so tests can replace it)."""
    from megatron.training import get_args

    return get_args()


def prepare_model(model: Any, args: Any = None) -> Any:
    """Validate, ``enable(model)`` and ``install`` the Seq1F1B schedule (``--seq1f1b`` only).

    First, with ``--attention-backend flash --transformer-impl local`` (with or
    without ``--seq1f1b``), the core attention becomes the SDPA flash one
    (:func:`use_flash_attention`).

    `model` is what the model provider built (one chunk, core_v0.16-0.18), or
    the list of chunks a core_v0.19 builder passes to its post-wrap hooks;
    chunks may be wrapped (DDP, Float16Module). Installing replaces the
    ``get_forward_backward_func`` that ``megatron.training.training`` imported,
    which ``train()`` and ``evaluate()`` call after the model is built.
    Validation runs again here because ``get_model`` may turn on ModelOpt
    after ``validate_args``, and YAML configs skip ``validate_args``.

    The schedule is told where each micro-batch's documents are
    (:func:`documents_source`): ``cu_seqlens`` for packed batches (``--sft``,
    ``--dataloader-inter-document-masking``), the tokenizer's end-of-document
    id for ``--reset-attention-mask`` without a dense mask from the data (the
    flash attention) or with ``--seq1f1b-partition documents``.

    ``--seq1f1b-segment-tokens T`` installs a token budget per segment: every micro-batch
    (Megatron-LM's are all ``--seq-length`` long) gets ``ceil(S / T)`` segments, capped by
    ``--seq1f1b-splits`` where given (:func:`segment_splits`).
    """
    if args is None:
        args = _megatron_args()
    if flash_attention_requested(args):  # before enable(): it hooks the core attention
        use_flash_attention(model, args)
    if not _flag(args, "seq1f1b", False):
        return model
    validate_args(args)
    from megatron_seq1f1b.api import install
    from megatron_seq1f1b.runtime.model_hooks import enable

    enable(model)
    documents = documents_source(args)
    if documents == EOD:
        documents = end_of_document_id()
    splits = segment_splits(args)  # unset: 4, or no cap with --seq1f1b-segment-tokens
    if splits == AUTO:  # planned on the first forward-backward call
        from megatron_seq1f1b.planner.auto import auto_forward_backward_func

        install(auto_forward_backward_func(
            memory_budget_gib=_flag(args, "seq1f1b_memory_budget"),
            memory_budget_microbatches=_flag(args, "seq1f1b_memory_budget_microbatches"),
            min_segment_length=_flag(args, "seq1f1b_min_segment_length", DEFAULT_MIN_SEGMENT),
            segment_multiple=_flag(args, "seq1f1b_segment_multiple"), documents=documents))
    else:
        lengths = _flag(args, "seq1f1b_split_lengths")
        install(splits, args.seq1f1b_partition,
                split_lengths=None if lengths is None else list(lengths),
                schedule=_flag(args, "seq1f1b_schedule", DEFAULT_SCHEDULE),
                segment_multiple=_flag(args, "seq1f1b_segment_multiple"), documents=documents,
                segment_tokens=_flag(args, "seq1f1b_segment_tokens"),
                backward_by_documents=_flag(args, "seq1f1b_backward_by_documents", False))
    return model


def wrap_model_provider(model_provider: Callable) -> Callable:
    """`model_provider` followed by :func:`prepare_model` on every chunk it builds."""
    if getattr(model_provider, "seq1f1b_wrapped", None) is not None:
        return model_provider

    def provider(*args, **kwargs):
        return prepare_model(model_provider(*args, **kwargs))

    provider.seq1f1b_wrapped = model_provider
    provider.__name__ = getattr(model_provider, "__name__", "model_provider")
    provider.__doc__ = getattr(model_provider, "__doc__", None)
    return provider



def add_post_wrap_hook(model_config: Any, args: Any = None) -> Any:
    """Have Megatron-LM's model builder call :func:`prepare_model` (``--seq1f1b`` only).

    From core_v0.19, pretrain_gpt.py builds the model from a ``GPTModelConfig``
    (``gpt_config_from_args``) instead of a model provider; its builder runs
    ``model_config.post_wrap_hooks`` on the list of chunks once they are
    built and wrapped (DDP, Float16Module), before the optimizer is created
    and a checkpoint is loaded. This appends :func:`prepare_model` there
    (once). Returns `model_config`; unchanged without ``--seq1f1b`` (or the flash attention
    of :func:`flash_attention_requested`).
    """
    if args is None:
        args = _megatron_args()
    if not (_flag(args, "seq1f1b", False) or flash_attention_requested(args)):
        return model_config
    hooks = model_config.post_wrap_hooks
    if prepare_model not in hooks:
        hooks.append(prepare_model)
    return model_config



def end_of_document_id() -> int:
    """The end-of-document token id (Megatron-LM's tokenizer's ``eod``): where the GPT dataset
    resets attention masks and position ids."""
    from megatron.training import get_tokenizer

    return int(get_tokenizer().eod)


def use_flash_attention(model: Any, args: Any) -> Any:
    """Swap the built chunks' ``DotProductAttention`` for the SDPA flash attention.

    Megatron-LM builds the layer spec itself, so the (parameter-free) core
    attention is replaced after the build: parameters, ``state_dict`` keys and
    checkpoints are unchanged. Raises ``ConfigError`` for a mask from the data.
    """
    raise_if(flash_attention_problems(args))
    from megatron_seq1f1b.attention.flash import FlashDotProductAttention
    from megatron_seq1f1b.attention.flash import use_flash_attention as swap

    swap(model)
    # (with context parallelism the layer spec built them already: layer_spec)
    count = sum(isinstance(module, FlashDotProductAttention)
                for chunk in (model if isinstance(model, (list, tuple)) else [model])
                for module in chunk.modules())
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"Seq1F1B: --attention-backend flash --transformer-impl local: {count} core "
              "attention(s) run megatron_seq1f1b.attention.flash (PyTorch SDPA)", flush=True)
    return model


#: Megatron-LM core_v0.18+: what pretrain_gpt.get_batch returns, in this order
#: (its ``BATCH_KEYS``).
GPT_BATCH_KEYS = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group",
                  "labels", "local_cp_size", "loss_mask", "max_seqlen", "position_ids", "tokens")
#: Fields that only hybrid context parallelism sets (refused inside a segment).
_HYBRID_CP_KEYS = ("hybrid_cp_group", "local_cp_size")


def _slice_fields(fields: dict) -> dict:
    """The one slicing path behind both adapters: `fields` by name, cut to this segment.

    ``[b, s]`` tensors are cut to ``[:, start:end]``, a ``[b, 1, s, s]`` mask
    to rows ``start:end`` and columns ``:end`` (contiguous copies), None stays
    None, other fields pass unchanged. A packed (THD) batch's ``cu_seqlens``,
    ``cu_seqlens_padded`` and ``max_seqlen``, and the ``packed_seq_params``
    core_v0.16/0.17 build from them, become the segment's document pieces
    (:func:`megatron_seq1f1b.slice_batch`, from the documents the schedule was
    given). Identity outside a segmented step; hybrid context parallelism
    (:data:`_HYBRID_CP_KEYS`) is refused inside one.
    """
    from megatron_seq1f1b.segments.run import current_segment, slice_batch

    if current_segment() is None:
        return fields
    params = fields.get("packed_seq_params")
    hybrid = [key for key in _HYBRID_CP_KEYS if fields.get(key) is not None
              or getattr(params, key, None) is not None]
    if params is not None and getattr(params, "cp_group", None) is not None:
        hybrid.append("cp_group")
    if hybrid:
        raise_if([
            f"hybrid context parallelism ({', '.join(hybrid)} in the batch) spreads a "
            "micro-batch's sequences over ranks of their own and cannot be cut into segments; "
            "remove --hybrid-context-parallel"
        ])
    out = slice_batch(fields)
    if params is not None:
        out["packed_seq_params"] = _segment_packed_seq_params(params)
    return out


def _segment_packed_seq_params(params: Any) -> Any:
    """The segment's ``PackedSeqParams`` (core_v0.16/0.17 build it inside ``get_batch``).

    Its ``cu_seqlens`` (and padded ones) become the segment's document pieces, 1-D as
    PackedSeqParams and Transformer Engine expect, and ``max_seqlen`` the longest piece;
    the rest is kept.
    """
    import dataclasses

    from megatron_seq1f1b.segments.run import current_segment, slice_batch

    if getattr(params, "qkv_format", None) != "thd" or params.cu_seqlens_q is None:
        raise_if([f"packed_seq_params with qkv_format={getattr(params, 'qkv_format', None)!r}: "
                  "segments take packed documents as THD (qkv_format='thd') batches with "
                  "cu_seqlens"])
    cut = slice_batch({"cu_seqlens": params.cu_seqlens_q,
                       "cu_seqlens_padded": params.cu_seqlens_q_padded,
                       "max_seqlen": params.max_seqlen_q})
    cu = cut["cu_seqlens"].reshape(-1)
    padded = cut["cu_seqlens_padded"]
    padded = padded.reshape(-1) if padded is not None else None
    longest = cut["max_seqlen"]
    changes = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                   cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)
    if getattr(params, "total_tokens", None) is not None:  # (Mamba's seq_idx follows from it)
        changes["total_tokens"] = current_segment().length
    return dataclasses.replace(params, **changes)


def slice_gpt_batch(tokens: Any, labels: Any, loss_mask: Any, attention_mask: Any,
                    position_ids: Any, packed_seq_params: Any) -> tuple:
    """The current segment's part of pretrain_gpt.py's ``get_batch`` tuple (core_v0.16/0.17).

    Same order in and out: ``(tokens, labels, loss_mask, attention_mask,
    position_ids, packed_seq_params)``; cut as :func:`_slice_fields` does,
    ``packed_seq_params`` (``--sft``: built from the whole micro-batch's
    ``cu_seqlens``; on middle pipeline stages core_v0.17 returns it alone,
    core_v0.16 returns None) rebuilt from the segment's document pieces.
    Identity outside a segmented step.
    """
    names = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids",
             "packed_seq_params")
    batch = _slice_fields(dict(zip(names, (tokens, labels, loss_mask, attention_mask,
                                           position_ids, packed_seq_params))))
    return tuple(batch[n] for n in names)


def slice_gpt_batch_fields(*values: Any) -> tuple:
    """The current segment's part of pretrain_gpt.py's ``get_batch`` result (core_v0.18+).

    `values` are the ten fields in :data:`GPT_BATCH_KEYS` order (Megatron's
    ``BATCH_KEYS``, alphabetical); the same order comes back, cut as
    :func:`_slice_fields` does: packed batches' ``cu_seqlens``,
    ``cu_seqlens_padded`` (``[1, n]``, as get_batch returns them) and
    ``max_seqlen`` describe the segment's document pieces, from which
    forward_step builds its ``PackedSeqParams``. Identity outside a segmented step.
    """
    if len(values) != len(GPT_BATCH_KEYS):
        raise TypeError(f"slice_gpt_batch_fields takes the {len(GPT_BATCH_KEYS)} fields "
                        f"{', '.join(GPT_BATCH_KEYS)}; got {len(values)}")
    batch = _slice_fields(dict(zip(GPT_BATCH_KEYS, values)))
    return tuple(batch[n] for n in GPT_BATCH_KEYS)


FLAGS_PROG = "python -m megatron_seq1f1b.megatron_lm"


def flags_parser() -> argparse.ArgumentParser:
    """A parser holding only the flags a patched ``pretrain_gpt.py`` adds (for their help)."""
    parser = argparse.ArgumentParser(  # the description's lines as written (a flag unbroken)
        prog=FLAGS_PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The flags that the Seq1F1B patches add to Megatron-LM's pretrain_gpt.py\n"
                    "(the same function adds them there), listed without a checkout. A patched\n"
                    "'pretrain_gpt.py --help' lists them with Megatron's own; an unpatched one\n"
                    "stops in core_v0.18.2 and core_v0.19.0 on a bare '%' in the help of\n"
                    "--moe-paged-stash-buffer-size-factor-cuda (upstream). Given flags are\n"
                    "parsed as pretrain_gpt.py would parse them.")
    return add_arguments(parser)


def main(argv: Optional[list] = None) -> int:
    """``python -m megatron_seq1f1b.megatron_lm [FLAGS]``: the ``--seq1f1b`` flags' help, and
    the values FLAGS give them. Needs neither torch nor Megatron."""
    parser = flags_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)  # -h/--help prints the help and exits
    parser.print_help()
    if argv:
        print("\nvalues: " + " ".join(f"{k}={v!r}" for k, v in sorted(vars(args).items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
