"""Small named adapters over the Megatron-Core API changes from 0.16.1 to 0.19.x.

The rest of the package calls these and never asks for a version. Each
adapter decides by what the installed Megatron-Core offers (a signature, an
attribute), not by its version string, so a patch release that backports a
change needs nothing here.

============================  =========================  ==========================
what                          0.16.1                     0.17.0 and later
============================  =========================  ==========================
``schedules.backward_step``   ``(..., model_type,        ``(..., config)``
                              config)``
``get_forward_backward_func`` ``(pp_size, vp_size)``     0.19: also
                                                         ``schedule_pg_collection``
GPT dataset document          none                       0.19: ``GPTDatasetConfig``
boundaries (``cu_seqlens``)   (:func:`with_document_     ``.inter_document_masking``
                              boundaries` adds them)
per-token MoE router losses   by the rank's tokens       0.19: times the TP x CP
(``calculate_per_token_       (inexact under CP)         group's size
loss``)
language model classes        ``GPTModel``               0.18: also ``HybridModel``
                                                         (:func:`language_models`)
============================  =========================  ==========================
"""

from __future__ import annotations

import functools
import importlib.util
import inspect


@functools.lru_cache(maxsize=None)
def language_models() -> tuple[type, ...]:
    """The model classes :func:`megatron_seq1f1b.enable` takes: ``GPTModel``, and
    ``HybridModel`` where Megatron-Core has it (0.18 on; 0.16-0.17's ``MambaModel`` is
    another class, not taken)."""
    from megatron.core.models.gpt import GPTModel

    if importlib.util.find_spec("megatron.core.models.hybrid") is None:
        return (GPTModel,)
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    return (GPTModel, HybridModel)


@functools.lru_cache(maxsize=None)
def _backward_step_takes_model_type() -> bool:
    from megatron.core.pipeline_parallel.schedules import backward_step

    return "model_type" in inspect.signature(backward_step).parameters


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """Megatron-Core's ``backward_step``; 0.16.1 also wants the (only) model type."""
    from megatron.core.pipeline_parallel import schedules

    if _backward_step_takes_model_type():
        from megatron.core.enums import ModelType

        return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad,
                                       ModelType.encoder_or_decoder, config)
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


@functools.lru_cache(maxsize=None)
def per_token_router_losses_count_context_parallel() -> bool:
    """Whether the router scales its per-token losses by the TP x CP group's size.

    With ``calculate_per_token_loss`` the gradients are divided by every rank's loss tokens;
    a router loss must be multiplied by the tokens it stands for. Before 0.19 the router
    multiplies by its own rank's tokens only, so under context parallelism its gradients are
    ``1/cp`` of the full sequence's (0.19 adds the group's size).
    """
    from megatron.core.transformer.moe.router import TopKRouter

    try:
        source = inspect.getsource(TopKRouter.attach_and_log_load_balancing_loss)
    except (OSError, TypeError):  # no sources installed: 0.19 also brought moe_logging
        return importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is not None
    return "tp_cp_group.size()" in source


def packed_total_tokens(total: int) -> dict:
    """``PackedSeqParams``' ``total_tokens`` keyword (not in Megatron-Core 0.16; Mamba's
    ``seq_idx`` follows), or nothing where the dataclass has no such field."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    names = {field.name for field in dataclasses.fields(PackedSeqParams)}
    return {"total_tokens": total} if "total_tokens" in names else {}


def megatron_core_version() -> str:
    """The installed Megatron-Core's version, e.g. ``"0.19.2"``."""
    from megatron.core.package_info import __version__

    return __version__


__all__ = ["backward_step", "megatron_core_version"]


def moe_loss_tracker() -> dict:
    """Megatron's per-layer MoE loss tracker as {name: (values, reduce_group, avg_group)}.

    0.19 keeps it in ``moe_logging.get_moe_metrics_tracker()``; earlier
    versions in a dict from ``moe_utils.get_moe_layer_wise_logging_tracker()``.
    """
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return {n: (e["values"], e.get("reduce_group"), e.get("avg_group"))
                for n, e in get_moe_layer_wise_logging_tracker().items()}
    return {n: (e.values, e.reduce_group, e.avg_group)
            for n, e in get_moe_metrics_tracker().metrics.items()}


def moe_losses(reset: bool = False) -> dict:
    """Each tracked MoE loss per layer, reduced as Megatron's report does (summed over its
    reduce group, averaged over its average group); with ``reset``, the tracker is emptied."""
    import torch

    out = {}
    tracker = moe_loss_tracker()
    for name in sorted(tracker):
        values, reduce_group, avg_group = tracker[name]
        values = values.detach().clone()
        if reduce_group is not None and reduce_group.size() > 1:
            torch.distributed.all_reduce(values, group=reduce_group)
        if avg_group is not None and avg_group.size() > 1:
            torch.distributed.all_reduce(values, group=avg_group)
            values /= avg_group.size()
        out[name] = values
    if reset:
        try:
            from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
        except ImportError:
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            get_moe_layer_wise_logging_tracker().clear()
        else:
            destroy_moe_metrics_tracker()
    return out


@functools.lru_cache(maxsize=None)
def dataset_has_inter_document_masking() -> bool:
    """Whether Megatron-Core's ``GPTDatasetConfig`` has ``inter_document_masking`` (0.19+)."""
    import dataclasses

    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return any(field.name == "inter_document_masking"
               for field in dataclasses.fields(GPTDatasetConfig))


def with_document_boundaries(dataset_class: type) -> type:
    """``dataset_class`` (``GPTDataset`` or ``MockGPTDataset``) whose samples carry the
    document boundaries, as 0.19's ``inter_document_masking`` gives them, for releases
    without it (see :func:`dataset_has_inter_document_masking`).

    Each sample gets ``cu_seqlens`` (int32 ``[sequence_length + 1]``: 0, the end of
    every document part in the sample, then copies of ``sequence_length``), ``max_seqlen``
    (the longest part, a 0-d int32 tensor) and position ids restarting at every part. The
    parts are where the dataset's documents are cut into the sample (its sample index),
    not where end-of-document tokens are: a document that holds the end-of-document id
    inside it stays one.
    """

    class WithDocumentBoundaries(dataset_class):
        def __getitem__(self, idx):
            sample = super().__getitem__(idx)
            sample.pop("attention_mask", None)
            parts = self._document_parts(0 if idx is None else idx)
            return _add_document_boundaries(sample, parts, self.config.sequence_length,
                                            int(self.config.add_extra_token_to_sequence))

        def _document_parts(self, idx: int) -> list[int]:
            """Tokens of each document in sample ``idx``, with the extra label token."""
            extra = int(self.config.add_extra_token_to_sequence)
            row = self.shuffle_index[idx]  # loaded by the base class's __getitem__
            first, first_offset = (int(v) for v in self.sample_index[row])
            last, last_offset = (int(v) for v in self.sample_index[row + 1])
            parts = []
            for position in range(first, last + 1):
                offset = first_offset if position == first else 0
                available = int(self.dataset.sequence_lengths[self.document_index[position]]) \
                    - offset
                wanted = last_offset + extra - offset if position == last else available
                parts.append(min(wanted, available))
            return parts

    WithDocumentBoundaries.__name__ = dataset_class.__name__  # same index cache names
    WithDocumentBoundaries.__qualname__ = dataset_class.__qualname__
    return WithDocumentBoundaries


def _add_document_boundaries(sample: dict, parts: list[int], sequence_length: int,
                             extra: int) -> dict:
    """cu_seqlens, max_seqlen and per-document position ids from the sample's parts (the
    last one holds the ``extra`` label token; a sample padded short folds its padding into
    the last document), as 0.19's dataset computes them."""
    import torch

    lengths = list(parts)
    if extra:  # the extra token belongs to the labels only
        lengths[-1] -= extra
        if lengths[-1] == 0:
            lengths.pop()
    shortfall = sequence_length - sum(lengths)
    if shortfall > 0:
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    positions = sample["position_ids"].clone()
    for start, end in zip(cu, cu[1:]):
        positions[start:end] = torch.arange(end - start, dtype=positions.dtype)
    padded = torch.full((sequence_length + 1,), sequence_length, dtype=torch.int32)
    padded[: len(cu)] = torch.tensor(cu, dtype=torch.int32)
    sample.update(position_ids=positions, cu_seqlens=padded,
                  max_seqlen=torch.tensor(max(lengths), dtype=torch.int32))
    return sample
