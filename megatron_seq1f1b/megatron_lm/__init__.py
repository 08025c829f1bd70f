"""The Megatron-LM integration: the patches, the applier, and everything the patch hunks call.

* :mod:`~megatron_seq1f1b.megatron_lm.hooks`: the functions the patched ``pretrain_gpt.py``,
  ``arguments.py`` and model builders call (``from megatron_seq1f1b import megatron_lm``;
  ``megatron_lm.prepare_model(...)``): every public name of ``hooks`` is an attribute of this
  package, looked up on each access, so the shipped patches of every tag keep their imports;
* :mod:`~.arguments`: the ``--seq1f1b`` flags and their checks (``validate_args``);
* :mod:`~.patch`: the applier (``python -m megatron_seq1f1b.patch``, ``seq1f1b-patch``);
* ``patches/megatron-lm/<tag>/``: the patches themselves, shipped with the package.

May import: every floor below it (:mod:`megatron_seq1f1b.api`,
:mod:`~megatron_seq1f1b.planner` and down); importing this package imports nothing.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    hooks = importlib.import_module("megatron_seq1f1b.megatron_lm.hooks")
    try:
        return getattr(hooks, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
