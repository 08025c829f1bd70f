"""Megatron-Bridge's loop modules on a CPU test machine: what is stood in for, and why.

Conversion needs only :func:`megatron_seq1f1b.bridge.load_bridge`. Bridge's training-loop modules
(``gpt_step``, ``train``, ``eval``, their configuration) also import, unconditionally, packages
that this path never calls and that CI does not install (each is large, and one breaks
Megatron-Core's import: nvidia-resiliency-ext 0.4, the newest for Python 3.11, has no
``__version__``, which Megatron-Core's checkpointing reads):

* ``modelopt`` (NVIDIA Model Optimizer; distillation, quantization): ``gpt_step`` imports
  ``modelopt.torch.distill`` for its ModelOpt forward step, ``train`` / ``eval`` import
  ``get_tensor_shapes_adjust_fn_for_distillation`` and call it every step: the stand-in answers
  None, which is what ModelOpt answers for a model that is not a ``DistillationModel``;
* ``nvidia_resiliency_ext`` (in-process restart, fault tolerance): imported by ``pretrain``;
* ``datasets`` (Hugging Face datasets): imported by Bridge's SFT dataset module, which its
  configuration imports;
* ``megatron.energon`` (multimodal data loading): Bridge's data package imports its data module;
* ``torch.utils.tensorboard`` (needs the ``tensorboard`` package): ``state`` imports
  ``SummaryWriter``, created only when a TensorBoard directory is configured.

Each stand-in is installed only where the real package is absent; its attributes are empty
classes (``isinstance`` checks are false), so a code path that really used one fails loudly.
"""

from __future__ import annotations

import importlib.util
import sys
import types

STOOD_IN = ("modelopt", "nvidia_resiliency_ext", "datasets", "torch.utils.tensorboard",
            "megatron.energon")

_MODULES = {
    "modelopt": ("modelopt.torch", "modelopt.torch.distill", "modelopt.torch.distill.plugins",
                 "modelopt.torch.distill.plugins.megatron", "modelopt.torch.opt",
                 "modelopt.torch.opt.plugins"),
    "nvidia_resiliency_ext": ("nvidia_resiliency_ext.inprocess",),
    "datasets": (),
    "torch.utils.tensorboard": ("torch.utils.tensorboard.writer",),
    "megatron.energon": (),
}


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ModuleNotFoundError, ValueError):
        return True


def _module(name: str) -> types.ModuleType:
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


def _tensorboard_present() -> bool:
    return not _absent("tensorboard")


def stand_in() -> list[str]:
    """Install the stand-ins this machine needs; returns the packages stood in for."""
    installed = []
    for root, children in _MODULES.items():
        if root in sys.modules and not getattr(sys.modules[root], "__seq1f1b_stand_in__", False):
            continue
        absent = not _tensorboard_present() if root == "torch.utils.tensorboard" else _absent(root)
        if not absent:
            continue
        for name in (root,) + children:
            module = sys.modules.get(name) or _module(name)
            sys.modules[name] = module
            parent, _, leaf = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], leaf, module)
        installed.append(root)
    megatron_plugin = sys.modules.get("modelopt.torch.distill.plugins.megatron")
    if getattr(megatron_plugin, "__seq1f1b_stand_in__", False):
        megatron_plugin.get_tensor_shapes_adjust_fn_for_distillation = lambda *a, **k: None
    return installed


def load_loop():
    """Bridge's loop modules (gpt_step, train, eval, callbacks), importable on this machine."""
    from megatron_seq1f1b.bridge import load_bridge

    load_bridge()
    stand_in()
    from megatron.bridge.training import callbacks, eval as bridge_eval, gpt_step, train

    return types.SimpleNamespace(callbacks=callbacks, eval=bridge_eval, gpt_step=gpt_step,
                                 train=train)
