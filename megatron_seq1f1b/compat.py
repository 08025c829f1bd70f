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
============================  =========================  ==========================
"""

from __future__ import annotations

import functools
import inspect


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
