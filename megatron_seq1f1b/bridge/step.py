"""Megatron-Bridge's GPT forward step, one Seq1F1B segment at a time.

Bridge's ``gpt_step.forward_step`` reads a micro-batch (``get_batch``: to the device, the keys
its pipeline stage needs, packed-sequence metadata), counts its FLOPs, runs the model and
returns Bridge's masked next-token loss. :func:`forward_step` does the same through Bridge's own
functions, with three differences under Seq1F1B:

* the micro-batch is cut to the running segment (:func:`megatron_seq1f1b.slice_batch`): every
  segment's ``next()`` gets the same micro-batch, moved to the device once;
* a packed batch's metadata, in either of Bridge's forms (``cu_seqlens_q`` / ``_kv`` with their
  ``_padded`` variants and ``max_seqlen_q`` / ``_kv``; or the older ``cu_seqlens`` padded with
  ``-1`` with ``cu_seqlens_argmin`` and ``max_seqlen``), becomes the segment's own: its document
  pieces and their longest, from the schedule's plan data (no host-device sync per segment);
* FLOPs are counted once per micro-batch, on its first segment, for the whole micro-batch
  (Bridge's counter adds the configured ``seq_length`` per call: once per segment would count
  ``num_splits`` times).

Outside a segmented step (Megatron's own schedule, e.g. ``num_splits=1`` drop-in) it is Bridge's
forward step unchanged.
"""

from __future__ import annotations

from typing import Iterable

import torch

from megatron_seq1f1b.base.checks import ConfigError
from megatron_seq1f1b.bridge.loading import load_bridge
from megatron_seq1f1b.segments.documents import Documents
from megatron_seq1f1b.segments.run import current_segment, slice_batch

load_bridge()
from megatron.bridge.training import gpt_step  # noqa: E402 - after load_bridge
from megatron.bridge.training.losses import create_masked_next_token_loss_function  # noqa: E402
from megatron.bridge.training.utils.flop_utils import (  # noqa: E402
    accumulate_flops_metadata,
    get_model_chunk_vp_stage,
)
from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params  # noqa: E402
from megatron.bridge.training.utils.pg_utils import get_pg_collection  # noqa: E402
from megatron.core.utils import get_model_config  # noqa: E402

_SEQUENCE = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def _trimmed(row: list[int], argmin) -> list[int]:
    """A legacy ``cu_seqlens`` row without its ``-1`` padding."""
    if argmin is not None:
        return row[: int(argmin)]
    negative = [i for i, value in enumerate(row) if value < 0]
    return row[: negative[0]] if negative else row


def packed_documents(batch: dict, seq_length: int) -> Documents:
    """A packed Bridge micro-batch's documents (a ``documents=`` source for the schedule).

    Reads the host batch as Bridge's data loader gives it: ``cu_seqlens_q`` (or its padded
    variant), or the legacy ``cu_seqlens`` without its ``-1`` padding. Refuses documents padded
    apart (a padded variant that differs from the real lengths: context-parallel padding), and
    a pack that does not fill the sequence is given one more piece for its padding.
    """
    if batch.get("cu_seqlens_q") is not None:
        real = batch["cu_seqlens_q"].reshape(-1).tolist()
        padded = batch.get("cu_seqlens_q_padded")
    elif batch.get("cu_seqlens") is not None:
        real = _trimmed(batch["cu_seqlens"].reshape(-1).tolist(), batch.get("cu_seqlens_argmin"))
        padded = batch.get("cu_seqlens_unpadded")  # legacy: cu_seqlens is the padded one
        if padded is not None:
            padded = _trimmed(padded.reshape(-1).tolist(), batch.get("cu_seqlens_unpadded_argmin"))
    else:
        raise KeyError("documents='packed': the micro-batch has neither cu_seqlens_q nor "
                       "cu_seqlens (Bridge's packed-sequence metadata)")
    if padded is not None:
        padded = padded.reshape(-1).tolist() if hasattr(padded, "reshape") else list(padded)
        if padded != real:
            raise ConfigError([
                "packed documents padded apart (cu_seqlens padded for context parallelism "
                "differ from the real lengths): Seq1F1B cuts documents by their real lengths; "
                "pack without per-document padding (pad_seq_to_mult=1)"])
    if real and real[-1] < seq_length:
        real = real + [seq_length]
    return Documents.from_cu_seqlens([real], seq_length)


def segment_packed_metadata(metadata: dict) -> dict:
    """The running segment's packed metadata in Bridge's current form (``cu_seqlens_q`` ...),
    from a micro-batch's in either form; the pieces come from the schedule's plan data."""
    current = metadata.get("cu_seqlens_q") is not None
    cu = metadata["cu_seqlens_q" if current else "cu_seqlens"]
    longest = metadata.get("max_seqlen_q" if current else "max_seqlen")
    cut = slice_batch({"cu_seqlens": cu, **({"max_seqlen": longest} if longest is not None
                                            else {})})
    out = {"cu_seqlens_q": cut["cu_seqlens"], "cu_seqlens_kv": cut["cu_seqlens"]}
    if "max_seqlen" in cut:
        out["max_seqlen_q"] = out["max_seqlen_kv"] = cut["max_seqlen"]
    return out


def _count_flops(state, tokens, metadata, config, vp_stage, cp_size: int) -> None:
    """Bridge's FLOPs accumulation for a whole micro-batch (as ``gpt_step`` calls it)."""
    found = dict(cu_seqlens=None, cu_seqlens_argmin=None, cu_seqlens_unpadded=None,
                 cu_seqlens_unpadded_argmin=None)
    if metadata is not None and cp_size == 1:
        if metadata.get("cu_seqlens_q") is not None:
            padded = metadata.get("cu_seqlens_q_padded")
            found["cu_seqlens"] = padded if padded is not None else metadata["cu_seqlens_q"]
            found["cu_seqlens_unpadded"] = metadata["cu_seqlens_q"] if padded is not None else None
        else:
            for key in found:
                found[key] = metadata.get(key)
    accumulate_flops_metadata(state, tokens, vp_stage=vp_stage,
                              config_seq_len=getattr(config, "seq_length", None), **found)


def forward_step(state, data_iterator: Iterable, model, return_schedule_plan: bool = False):
    """Bridge's GPT forward step on this segment of the micro-batch (module docstring).

    ``state`` is Bridge's ``GlobalState`` (Bridge passes it: the first parameter is named
    ``state``). Returns ``(output, loss_function)``, the loss function Bridge's own.
    """
    info = current_segment()
    if info is None:
        return gpt_step.forward_step(state, data_iterator, model, return_schedule_plan)
    if return_schedule_plan:
        raise ConfigError(["return_schedule_plan (overlap_moe_expert_parallel_comm): Megatron's "
                           "combined schedule plans do not run in Seq1F1B's segments"])
    config = get_model_config(model)
    pg_collection = get_pg_collection(model)
    use_mtp = (getattr(config, "mtp_num_layers", None) or 0) > 0
    vp_stage = get_model_chunk_vp_stage(model)

    state.timers("batch-generator", log_level=2).start()
    with state.straggler_timer(bdata=True):
        tokens, labels, loss_mask, attention_mask, position_ids, metadata = gpt_step.get_batch(
            data_iterator, state.cfg, use_mtp, pg_collection=pg_collection, vp_stage=vp_stage)
    state.timers("batch-generator").stop()
    if info.index == 0:
        _count_flops(state, tokens, metadata, config, vp_stage, pg_collection.cp.size())

    batch = slice_batch(dict(zip(_SEQUENCE, (tokens, labels, loss_mask, position_ids,
                                             attention_mask))))
    forward_args = {"input_ids": batch["tokens"], "position_ids": batch["position_ids"],
                    "attention_mask": batch["attention_mask"], "labels": batch["labels"]}
    if metadata is not None:
        packed = segment_packed_metadata(metadata)
        if getattr(config, "is_hybrid_model", False):
            packed["total_tokens"] = info.length
        forward_args["packed_seq_params"] = get_packed_seq_params(packed)
    with state.straggler_timer:
        output = model(**forward_args)
    rerun = state.cfg.rerun_state_machine
    return output, create_masked_next_token_loss_function(
        batch["loss_mask"], check_for_nan_in_loss=rerun.check_for_nan_in_loss,
        check_for_spiky_loss=rerun.check_for_spiky_loss)
