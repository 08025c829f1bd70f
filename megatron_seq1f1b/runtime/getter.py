"""Where Megatron-Core's ``get_forward_backward_func`` is held, for :func:`megatron_seq1f1b.install`.

``from megatron.core.pipeline_parallel import get_forward_backward_func`` copies the function
into the importing module, so replacing the attribute of ``megatron.core.pipeline_parallel``
misses every module that imported it before: a user's ``__main__``, Megatron-LM's
``megatron.training.training``, Megatron-Bridge's ``megatron.bridge.training.train`` and
``eval``. :func:`replace` therefore scans the loaded modules for the original getter by
identity and rebinds each. A reference it cannot reach (a local variable, an object's
attribute, a ``partial``) would silently run Megatron's own schedule: while installed, the
original function itself raises, one line naming ``install()`` (:func:`guard`), and
:func:`restore` undoes both.
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable

NAME = "get_forward_backward_func"
#: marks the getters install() makes, so a second install() or uninstall() finds them
MARK = "seq1f1b"

STALE_CALL = (
    "Seq1F1B: Megatron-Core's own get_forward_backward_func was called while "
    "megatron_seq1f1b.install() is in force, through a reference install() cannot replace (a "
    "local variable or an attribute taken before install()); it would run Megatron's schedule, "
    "not Seq1F1B's: look the getter up after install() (megatron.core.pipeline_parallel."
    "get_forward_backward_func), use the function install() returned, or call "
    "megatron_seq1f1b.uninstall() first for Megatron's own schedule")


class StaleGetterError(RuntimeError):
    """Megatron's original getter was called while Seq1F1B is installed."""


def is_ours(value) -> bool:
    return callable(value) and hasattr(value, MARK)


def _namespaces():
    """(module name, module) of every loaded module (any object in ``sys.modules``) that has a
    namespace; read through ``__dict__`` so that lazy modules load nothing."""
    for name, module in list(sys.modules.items()):
        try:
            namespace = vars(module)
        except TypeError:
            continue
        yield name, module, namespace


def replace(original: Callable, getter: Callable) -> list[str]:
    """Rebind the getter in every loaded module holding ``original`` or an earlier getter of
    ours; returns the modules' names."""
    reached = []
    for name, module, namespace in _namespaces():
        value = namespace.get(NAME)
        if value is original or is_ours(value):
            setattr(module, NAME, getter)
            reached.append(name)
    return reached


def restore(original: Callable) -> list[str]:
    """Put ``original`` back wherever a getter of ours is held; returns the modules' names."""
    restored = []
    for name, module, namespace in _namespaces():
        if is_ours(namespace.get(NAME)):
            setattr(module, NAME, original)
            restored.append(name)
    return restored


def _stale_call(*args, _seq1f1b_refuse=None, **kwargs):
    """The body the original getter runs while guarded (no closure: it takes the original's
    place, whose globals are Megatron's)."""
    return _seq1f1b_refuse(*args, **kwargs)


def _refuse(*args, **kwargs):
    raise StaleGetterError(STALE_CALL)


_GUARDED = "_seq1f1b_guarded"


def guard(original: Callable) -> None:
    """Make ``original`` raise :class:`StaleGetterError` when called (idempotent). Its code is
    swapped, since the references to guard are unknown; its signature is kept for
    ``inspect``."""
    if hasattr(original, _GUARDED):
        return
    signature = inspect.signature(original)
    setattr(original, _GUARDED, (original.__code__, original.__defaults__,
                                 original.__kwdefaults__))
    original.__signature__ = signature
    original.__code__ = _stale_call.__code__
    original.__defaults__ = None
    original.__kwdefaults__ = {"_seq1f1b_refuse": _refuse}


def unguard(original: Callable) -> None:
    """Give ``original`` its own code back (nothing if it is not guarded)."""
    saved = getattr(original, _GUARDED, None)
    if saved is None:
        return
    original.__code__, original.__defaults__, original.__kwdefaults__ = saved
    del original.__signature__
    delattr(original, _GUARDED)
