"""Import Megatron-Bridge where Transformer Engine is absent (a CPU machine: conversion, tests).

Megatron-Bridge 0.6 declares Python 3.12 and Transformer Engine; its conversion path runs on
3.11 without either (docs/bridge.md, "Install"). Two things stand in the way of its import:

* ``typing.override`` (Python 3.12) is used by ``megatron.training.models`` (which Bridge's
  configuration imports): on an older Python it is given ``typing_extensions.override``, or a
  decorator that returns the function (what ``override`` does at run time).
* ``megatron.bridge.peft.lora_layers`` imports ``transformer_engine.pytorch`` unconditionally (for
  its fused LoRA layers, never built on this path); ``AutoBridge`` reaches it through its PEFT
  mapping. While ``megatron.bridge`` is imported, and only then, a stand-in module answers that
  import (every attribute a distinct empty class, so its ``isinstance`` checks are false); it is
  taken out of ``sys.modules`` afterwards. Megatron-Core decides at import time whether it has
  Transformer Engine, so every Megatron-Core module that asks is imported before the stand-in
  exists (``megatron.training`` first, as Bridge itself imports it), and a Megatron-Core module
  that decided otherwise in the window is an error, not a silent TE path.

Where Transformer Engine is installed (a GPU machine) nothing is stood in for.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

#: what ``pip install megatron-seq1f1b[bridge]`` brings (setup.py), for messages
INSTALL_HINT = ("install Megatron-Bridge: bash scripts/setup_bridge.sh (or pip install "
                "--no-deps --ignore-requires-python megatron-bridge==0.6.2 and the packages "
                "docs/bridge.md lists)")

# Megatron-Core modules that test for Transformer Engine at import time and that Bridge's import
# reaches: imported before the stand-in exists, so they decide on the real answer.
_DECIDE_FIRST = (
    "megatron.training",
    "megatron.core.models.vision.clip_vit_model",
    "megatron.core.models.multimodal.llava_model",
)
_STAND_IN = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")


def bridge_missing_reason() -> str | None:
    """Why Megatron-Bridge cannot be imported here (one line), or None when it can be."""
    try:
        found = importlib.util.find_spec("megatron.bridge")
    except ModuleNotFoundError:
        found = None
    if found is None:
        return f"Megatron-Bridge (megatron.bridge) is not installed; {INSTALL_HINT}"
    return None


def _give_typing_override() -> None:
    import typing

    if hasattr(typing, "override"):
        return
    try:
        from typing_extensions import override
    except ImportError:  # pragma: no cover - typing_extensions comes with torch
        def override(method):
            return method
    typing.override = override


def _stand_in_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__seq1f1b_stand_in__ = True
    made: dict[str, type] = {}

    def attribute(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in made:
            made[attr] = type(attr, (), {"__module__": name})
        return made[attr]

    module.__getattr__ = attribute
    return module


def load_bridge() -> types.ModuleType:
    """``megatron.bridge``, imported as module docstring says; raises ImportError naming what
    to install when Bridge is absent."""
    if "megatron.bridge" in sys.modules and "megatron.bridge.models" in sys.modules:
        return sys.modules["megatron.bridge"]
    missing = bridge_missing_reason()
    if missing:
        raise ImportError(missing)
    _give_typing_override()
    if importlib.util.find_spec("transformer_engine") is not None:
        return importlib.import_module("megatron.bridge")
    for name in _DECIDE_FIRST:
        importlib.import_module(name)
    before = set(sys.modules)
    stand_ins = {name: _stand_in_module(name) for name in _STAND_IN}
    stand_ins["transformer_engine"].pytorch = stand_ins["transformer_engine.pytorch"]
    stand_ins["transformer_engine.pytorch"].ops = stand_ins["transformer_engine.pytorch.ops"]
    sys.modules.update(stand_ins)
    try:
        bridge = importlib.import_module("megatron.bridge")
    finally:
        for name in _STAND_IN:
            if sys.modules.get(name) is stand_ins[name]:
                del sys.modules[name]
    misled = sorted(name for name in set(sys.modules) - before
                    if name.startswith("megatron.core.")
                    and getattr(sys.modules[name], "HAVE_TE", False))
    if misled:
        raise ImportError(f"Megatron-Core modules took the Transformer Engine stand-in for the "
                          f"real one while Megatron-Bridge was imported: {misled}; import them "
                          "before megatron_seq1f1b.bridge.load_bridge() (loading._DECIDE_FIRST)")
    return bridge
