"""Seq1F1B: sequence-level 1F1B pipeline parallelism for Megatron-Core.

Public API (see README and docs/design.md)::

    import megatron_seq1f1b as s1

    s1.enable(model)                                  # K/V carry-over attention, RoPE offsets
    fwd_bwd = s1.get_forward_backward_func(4, "balanced")
    s1.install(4, "balanced") / s1.uninstall()        # or patch Megatron-Core's getter
    s1.current_segment(), s1.slice_batch(batch)       # inside forward_step_func
    s1.split_sequence(seq_length, num_splits, ...)
    s1.choose_plan(seq_length, pp, m, calibration=...)  # k, partition, schedule from costs
    s1.schedule.build_schedule(...), s1.simulate.simulate(...)
    s1.cpu.enable()                                   # Megatron-Core on CPU with gloo

Attributes load lazily, so the schedule tools work without importing
Megatron-Core. The package is split into rooms by responsibility, bottom floor
first: ``base``, ``schedules``, ``segments``, ``attention``, ``runtime``, ``api``,
``planner``, ``megatron_lm``, ``bridge``, ``trainer``, ``bench`` (:data:`ROOMS`; docs/design.md,
"The package's rooms"); every module name from before the rooms still imports
(:mod:`megatron_seq1f1b.moved`).
"""

from __future__ import annotations

import importlib

from megatron_seq1f1b import moved

__version__ = "0.1.0"

_LAZY = {
    "split_sequence": ("megatron_seq1f1b.schedules.partition", "split_sequence"),
    "SegmentInfo": ("megatron_seq1f1b.segments.run", "SegmentInfo"),
    "current_segment": ("megatron_seq1f1b.segments.run", "current_segment"),
    "slice_batch": ("megatron_seq1f1b.segments.run", "slice_batch"),
    "enable": ("megatron_seq1f1b.runtime.model_hooks", "enable"),
    "get_forward_backward_func": ("megatron_seq1f1b.api", "get_forward_backward_func"),
    "install": ("megatron_seq1f1b.api", "install"),
    "uninstall": ("megatron_seq1f1b.api", "uninstall"),
    "ConfigError": ("megatron_seq1f1b.base.checks", "ConfigError"),
    "choose_plan": ("megatron_seq1f1b.planner", "choose_plan"),
    "Calibration": ("megatron_seq1f1b.planner", "Calibration"),
    "load_calibration": ("megatron_seq1f1b.planner", "load_calibration"),
    "save_calibration": ("megatron_seq1f1b.planner", "save_calibration"),
}
#: the rooms, bottom floor first (docs/design.md, "The package's rooms")
ROOMS = ("base", "schedules", "segments", "attention", "runtime", "api", "planner",
         "megatron_lm", "bridge", "trainer", "bench")
#: submodules reachable as attributes: the rooms, and every earlier module name (the public
#: API's ``s1.schedule.build_schedule``, ``s1.cpu.enable()``, ...) through moved
_SUBMODULES = set(ROOMS) | set(moved.MOVED)

__all__ = sorted(_LAZY) + sorted(ROOMS)

moved.install()


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"megatron_seq1f1b.{name}")
    else:
        raise AttributeError(f"module 'megatron_seq1f1b' has no attribute {name!r}")
    globals()[name] = value
    return value
