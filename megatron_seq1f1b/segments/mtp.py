"""Multi-token prediction (MTP) per segment: what crosses a cut is data, the next tokens.

Megatron's MTP depth ``d`` at position ``t`` combines the previous depth's hidden state
at ``t`` with the embedding of token ``t + d``, attends causally like any layer, and
predicts label ``t + d`` under loss mask ``t + d``; every depth rolls the micro-batch's
``input_ids``, ``position_ids``, ``labels`` and ``loss_mask`` once more to the left,
filling 0 past the sequence (``roll_tensor``). Rolled inside a segment those tensors
would lose the next segment's first ``d`` tokens and get zeros instead: silently wrong.
No hidden state of a later position is read, so a segment never waits for a later one;
the MTP layers' own attention carries K/V across segments like the decoder's
(:mod:`~megatron_seq1f1b.attention.segmented` hooks them with the rest).

Here, on the stage that holds the MTP block:

* the micro-batch's four tensors (from the batch :func:`~megatron_seq1f1b.segments.run.
  slice_batch` cut, keys ``tokens`` or ``input_ids``, ``position_ids``, ``labels``,
  ``loss_mask``) are rolled with Megatron's own ``roll_tensor`` over the whole sequence
  (per document for a packed THD batch, by its ``cu_seqlens``), once per micro-batch and
  depth (tiny ``[b, s]`` integer tensors), and each segment takes its columns: exactly
  Megatron's values, fill included;
* Megatron's code is kept: its calls to ``roll_tensor`` inside an MTP layer's
  ``_get_embeddings`` and inside the loss (``process_mtp_loss`` from 0.17, GPTModel's
  ``_postprocess`` in 0.16) are served those columns instead, in Megatron's order
  (labels, loss mask per depth), and the rolled loss mask's count is the micro-batch's,
  so each segment's share is normalized as the whole sequence is (per-token loss: the
  un-rolled mask's count too);
* the executor sets ``MTPLossAutoScaler``'s backward scale as Megatron's
  ``forward_step`` does.

Not served (refused by :func:`problems`): context parallelism (Megatron's MTP roll
exchanges borders of its own zig-zag split), one MTP layer repeated over the depths, and
an MTP stage before the last.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from megatron_seq1f1b.segments import run as segments
from megatron_seq1f1b.segments.loss import auxiliary_loss_scale

_INSTALLED = "_seq1f1b_mtp_depth"
_BATCH_KEYS = {"input_ids": ("tokens", "input_ids"), "position_ids": ("position_ids",),
               "labels": ("labels",), "loss_mask": ("loss_mask",)}


def mtp_layers(model) -> list:
    """The model's MultiTokenPredictionLayer modules, depth order (empty without MTP)."""
    block = getattr(model, "mtp", None) if getattr(model, "mtp_process", False) else None
    return list(getattr(block, "layers", ()) or ())


def problems(config, model) -> list[str]:
    """What the per-segment MTP does not compute exactly; empty without MTP."""
    depth = getattr(config, "mtp_num_layers", None)
    if not depth:
        return []
    found = []
    if (getattr(config, "context_parallel_size", 1) or 1) > 1:
        found.append("multi-token prediction (mtp_num_layers) with context parallelism: "
                     "Megatron's MTP roll exchanges borders of its own zig-zag split, not of "
                     "Seq1F1B's segments; use context_parallel_size=1")
    if getattr(config, "mtp_use_repeated_layer", False):
        found.append("mtp_use_repeated_layer: one MTP layer applied at every depth would "
                     "share one K/V carry-over between depths; disable it")
    if getattr(config, "mtp_standalone", False):
        found.append("multi-token prediction on a stage before the last (mtp_standalone, a "
                     "pipeline_model_parallel_layout placing MTP early): its stage sends "
                     "[(1 + depth) x segment] activations, which Seq1F1B's plan does not "
                     "size; place MTP on the last stage")
    layers = mtp_layers(model)
    if layers and len(layers) != depth:
        found.append(f"the MTP block holds {len(layers)} layers for mtp_num_layers={depth}: "
                     "Seq1F1B serves MTP blocks with one layer per depth")
    return found


def install(model) -> bool:
    """Serve the MTP layers of a GPTModel / HybridModel chunk per segment; False without MTP."""
    layers = mtp_layers(model)
    if not layers:
        return False
    for depth, layer in enumerate(layers, start=1):
        if getattr(layer, _INSTALLED, None) is None:
            layer._get_embeddings = _embeddings_wrapper(layer._get_embeddings, depth)
            setattr(layer, _INSTALLED, depth)
    _install_loss_hooks(model)
    return True


# --------------------------------------------------------------- the rolled columns


def _megatron_roll() -> Callable:
    from megatron.core.transformer import multi_token_prediction

    return getattr(multi_token_prediction, "_seq1f1b_original_roll",
                   multi_token_prediction.roll_tensor)


def _rolled(name: str, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the segment's columns of ``name`` rolled ``depth`` times, the rolled whole
    micro-batch's sum) for the running segment; depth 0 is the tensor itself. Rolled once
    per micro-batch (the run keeps them until its last backward)."""
    unit = segments.active()
    rolls = unit.run.mtp_rolls.setdefault((unit.info.microbatch, unit.info.chunk, name), [])
    if not rolls:
        full = _full(unit, name)
        rolls.append((full, full.sum()))
    while len(rolls) <= depth:
        rolls.append(_megatron_roll()(rolls[-1][0], shifts=-1, dims=-1,
                                      packed_seq_params=_whole_documents(unit)))
    full, total = rolls[depth]
    return full[..., unit.info.start:unit.info.end], total


def _whole_documents(unit):
    """A packed (THD) micro-batch's documents for Megatron's per-document roll (the padded
    bounds where the batch has them, as Megatron-LM's forward_step gives the model), or None."""
    batch = unit.batch or {}
    bounds = batch.get("cu_seqlens_padded")
    if bounds is None:
        bounds = batch.get("cu_seqlens")
    if bounds is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = bounds.reshape(-1)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds)


def _full(unit, name: str) -> torch.Tensor:
    batch = unit.batch
    if batch is None:
        raise RuntimeError(
            "Seq1F1B: multi-token prediction needs the whole micro-batch: call "
            "megatron_seq1f1b.slice_batch(batch) in forward_step (as for every segmented model)")
    if name == "all_tokens":  # the model was given no loss mask: Megatron counts every token
        return torch.ones_like(_full(unit, "labels"))
    for key in _BATCH_KEYS[name]:
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            return value
    raise RuntimeError(f"Seq1F1B: multi-token prediction reads the micro-batch's {name} "
                       f"(batch key {' or '.join(_BATCH_KEYS[name])}); the batch given to "
                       "slice_batch has none")


@contextlib.contextmanager
def _serving(module: Any, answer: Callable[[torch.Tensor], Any]) -> Iterator[None]:
    """``module.roll_tensor`` answers from ``answer`` (Megatron's own roll elsewhere)."""
    from megatron.core.transformer import multi_token_prediction

    if not hasattr(multi_token_prediction, "_seq1f1b_original_roll"):
        multi_token_prediction._seq1f1b_original_roll = multi_token_prediction.roll_tensor
    saved = module.roll_tensor

    def roll_tensor(tensor, *args, **kwargs):
        return answer(tensor)

    module.roll_tensor = roll_tensor
    try:
        yield
    finally:
        module.roll_tensor = saved


def _forward_unit():
    unit = segments.active()
    return unit if unit is not None and unit.phase == segments.FORWARD else None


def _embeddings_wrapper(original: Callable, depth: int) -> Callable:
    """A depth's embedding of token t + depth: Megatron's ``_get_embeddings`` given the
    previous depth's columns, its roll answered with this depth's."""
    from megatron.core.transformer import multi_token_prediction

    @functools.wraps(original)
    def get_embeddings(input_ids, position_ids, *args, **kwargs):
        unit = _forward_unit()
        if unit is None:
            return original(input_ids, position_ids, *args, **kwargs)
        if kwargs.get("padding_mask") is not None:
            raise RuntimeError("Seq1F1B: multi-token prediction with a padding_mask is not "
                               "supported")
        answers = {}
        given = []
        for name, value in (("input_ids", input_ids), ("position_ids", position_ids)):
            before = None
            if value is not None:  # (position ids may be None: RoPE alone places tokens)
                before, _ = _rolled(name, depth - 1)
                answers[id(before)] = _rolled(name, depth)
            given.append(before)

        def answer(tensor):
            if id(tensor) not in answers:
                raise RuntimeError("Seq1F1B: an MTP layer rolled a tensor other than its token "
                                   "and position ids; this Megatron-Core is not served")
            return answers[id(tensor)]

        with _serving(multi_token_prediction, answer):
            return original(given[0], given[1], *args, **kwargs)

    return get_embeddings


# --------------------------------------------------------------- the loss


def _loss_answer(depths: int, mask: str) -> Callable:
    """Megatron's loss loop rolls labels then loss mask, once per depth: each call gets the
    segment's columns of that roll; the loss mask's count is the micro-batch's. ``mask``:
    ``"loss_mask"`` (the micro-batch's, where the model was given one) or ``"all_tokens"``."""
    plan = []
    for depth in range(1, depths + 1):
        plan.append(_rolled("labels", depth))
        plan.append(_rolled(mask, depth))
    calls = iter(plan)

    def answer(tensor):
        try:
            return next(calls)
        except StopIteration:
            raise RuntimeError("Seq1F1B: Megatron's MTP loss rolled more tensors than two per "
                               "depth; this Megatron-Core is not served") from None

    return answer


def _install_loss_hooks(model) -> None:
    """0.17+: wrap ``process_mtp_loss`` where the model classes call it; 0.16: the inline
    loss of ``GPTModel._postprocess`` (this chunk's method)."""
    import importlib

    for name in ("megatron.core.models.gpt.gpt_model", "megatron.core.models.hybrid.hybrid_model"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        loss = getattr(module, "process_mtp_loss", None)
        if loss is not None and not getattr(loss, "seq1f1b", False):
            module.process_mtp_loss = _process_mtp_loss_wrapper(loss)
    if not hasattr(importlib.import_module("megatron.core.models.gpt.gpt_model"),
                   "process_mtp_loss") and not getattr(model._postprocess, "seq1f1b", False):
        model._postprocess = _postprocess_wrapper(model._postprocess,
                                                  model.config.mtp_num_layers)


def _process_mtp_loss_wrapper(original: Callable) -> Callable:
    import inspect

    from megatron.core.transformer import multi_token_prediction

    signature = inspect.signature(original)

    @functools.wraps(original)
    def process_mtp_loss(hidden_states, labels, loss_mask, *args, **kwargs):
        if _forward_unit() is None:
            return original(hidden_states, labels, loss_mask, *args, **kwargs)
        if labels is None:
            raise RuntimeError("Seq1F1B: multi-token prediction without labels (derived from "
                               "input_ids) is not supported; pass labels")
        config = signature.bind(hidden_states, labels, loss_mask, *args, **kwargs) \
            .arguments["config"]
        # Megatron counts the un-rolled mask for per-token loss, and passes the mask on only
        # to roll it: the micro-batch's mask gives the micro-batch's count.
        mask = "all_tokens" if loss_mask is None else "loss_mask"
        whole_mask = _full(segments.active(), mask)
        with _serving(multi_token_prediction, _loss_answer(config.mtp_num_layers, mask)):
            return original(hidden_states, labels, whole_mask, *args, **kwargs)

    process_mtp_loss.seq1f1b = True
    return process_mtp_loss


def _postprocess_wrapper(original: Callable, depths: int) -> Callable:
    import inspect

    from megatron.core.models.gpt import gpt_model

    signature = inspect.signature(original)

    @functools.wraps(original)
    def postprocess(*args, **kwargs):
        unit = _forward_unit()
        if unit is None:
            return original(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        mask = "all_tokens" if given.get("loss_mask") is None else "loss_mask"
        with _serving(gpt_model, _loss_answer(depths, mask)):
            return original(*args, **kwargs)

    postprocess.seq1f1b = True
    return postprocess


def set_loss_scale(config, num_microbatches: int) -> None:
    """What Megatron's forward step does for MTP: the MTP losses' backward scale
    (``mtp_grad_scale_func`` where it exists, else ``grad_scale_func``) over the number of
    micro-batches, or unscaled with per-token loss; no context-parallel factor."""
    if not getattr(config, "mtp_num_layers", None):
        return
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    scale = auxiliary_loss_scale(config, "mtp_grad_scale_func", num_microbatches,
                                 context_parallel=False)
    MTPLossAutoScaler.set_loss_scale(scale)
