"""Every module's name from before the package had rooms, still importable and runnable.

Until the package was split into subpackages every module sat at its top
(``megatron_seq1f1b.executor``, ``megatron_seq1f1b.planner_costs``, ...). Those names keep
working, so that scripts, notebooks and command lines written for them do not break:
importing an earlier name gives the module where it lives now (the same module object,
not a copy), and ``python -m`` with an earlier name runs that module. The documented command
lines use such names on purpose (:data:`DOCUMENTED`); importing any other earlier name warns
once with its new home (``DeprecationWarning``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

PACKAGE = "megatron_seq1f1b"

#: earlier name -> where the module lives now. Four earlier names are rooms now and not
#: listed: ``planner`` re-exports what the module held, ``megatron_lm`` forwards every name of
#: its ``hooks``, ``segments`` serves the public ``SegmentInfo``, ``current_segment`` and
#: ``slice_batch``; the old ``attention`` module held nothing public.
MOVED = {
    "context_parallel": "attention.context_parallel",
    "flash_attention": "attention.flash",
    "prefix_attention": "attention.prefix",
    "varlen": "attention.varlen",
    "checks": "base.checks",
    "compat": "base.compat",
    "flags": "base.flags",
    "megatron_lm_flags": "megatron_lm.arguments",
    "patch": "megatron_lm.patch",
    "auto": "planner.auto",
    "planner_choice": "planner.choice",
    "planner_costs": "planner.costs",
    "fit": "planner.fit",
    "footprint": "planner.footprint",
    "measure": "planner.measure",
    "planner_memory": "planner.memory_model",
    "memory": "planner.peak_memory",
    "rehearse": "planner.rehearse",
    "planner_search": "planner.search",
    "timing": "planner.timing",
    "cpu": "runtime.cpu",
    "executor": "runtime.executor",
    "executor_setup": "runtime.executor_setup",
    "model": "runtime.model_hooks",
    "p2p": "runtime.p2p",
    "te_wgrad": "runtime.te_wgrad",
    "trace": "runtime.trace",
    "wgrad": "runtime.wgrad",
    "actions": "schedules.actions",
    "draw": "schedules.draw",
    "interleaved": "schedules.interleaved",
    "partition": "schedules.partition",
    "plan": "schedules.plan",
    "replay": "schedules.replay",
    "schedule": "schedules.schedule",
    "simulate": "schedules.simulate",
    "validate": "schedules.validate",
    "zero_bubble": "schedules.zero_bubble",
    "document_plan": "segments.document_plan",
    "documents": "segments.documents",
    "kv_cache": "segments.kv_cache",
    "loss": "segments.loss",
    "moe": "segments.moe",
}

#: earlier names that stay the documented short ones: command lines
#: (``python -m megatron_seq1f1b.simulate``) and the modules the public API names
#: (``s1.schedule.build_schedule``, ``s1.simulate.simulate``, ``s1.cpu.enable()``)
DOCUMENTED = frozenset({"simulate", "rehearse", "patch", "schedule", "validate", "draw", "cpu",
                        "partition"})


class _Alias(importlib.abc.Loader):
    """Loads an earlier name as the module it names now."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        # The import system reads sys.modules[name] back after this: the real module.
        sys.modules[module.__name__] = importlib.import_module(self.target)

    def get_code(self, fullname: str):
        """For ``python -m`` (runpy runs the code it returns as ``__main__``)."""
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != PACKAGE or name not in MOVED:
            return None
        new = f"{PACKAGE}.{MOVED[name]}"
        if name not in DOCUMENTED:
            warnings.warn(f"{fullname} moved to {new}; import it from there",
                          DeprecationWarning, stacklevel=2)
        origin = importlib.util.find_spec(new).origin
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), origin=origin)


def install() -> None:
    """Let the earlier names be found (after every real module: a real one always wins)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())
