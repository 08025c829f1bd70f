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
