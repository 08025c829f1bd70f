"""Transformer Engine layers' own delayed weight gradients, driven by zero-bubble ``W``.

A Transformer Engine (TE >= 2.3) linear layer built with
``delay_wgrad_compute=True`` does not compute its weight GEMM in backward: each
backward call queues the GEMM's operands in the layer's own first-in-first-out
queue (``layer.wgrad_store``), and ``layer.backward_dw()`` later pops one
backward's worth, computes it, and (TE >= 2.7) calls the hooks registered with
``register_wgrad_accumulation_and_reduce_hooks``. Megatron DDP built with
``DistributedDataParallelConfig(delay_wgrad_compute=True)`` registers its
gradient hooks there instead of on the parameters' ``AccumulateGrad``, so they
fire when the gradient exists. TE fixes the flag at construction (only then
does it make the queue and mark the parameters for DDP), so the user builds
the model with it; we never switch it.

The ``W`` of a unit calls ``backward_dw()`` once on every delayed layer of its
chunk whose queue grew during the unit's ``B``. That pops the unit's own entry
because a rank runs its ``W`` in the order of its ``B`` (the validator's rule,
checked again here per layer), and a layer the unit never reached is not
called. Everything that would pop the wrong entry, or leave one behind, raises.

Pure bookkeeping around TE's public methods plus one read of its queue length
(``wgrad_store.context.qsize()``, the same in TE 2.3-2.18). TE is never imported:
layers are recognised by their class hierarchy, so TE stays optional.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Sequence

import torch

# TE's weight-GEMM modules: the layers whose weight gradients TE can delay.
TE_GEMM_CLASSES = frozenset({"Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"})
TE_BASE_CLASS = "TransformerEngineBaseModule"
# Megatron's MLP on TE's operation fuser: runs fc1/fc2 weights outside the layers' queues.
TE_OP_FUSER_MLPS = frozenset({"TEFusedMLP", "TEFusedMLPWithGroupedLinear"})

Named = tuple[str, torch.nn.Module]


def is_te_linear(module: torch.nn.Module) -> bool:
    """A Transformer Engine weight-GEMM layer (or one of Megatron's ``TE*`` wrappers of it)."""
    names = {cls.__name__ for cls in type(module).__mro__}
    return TE_BASE_CLASS in names and not names.isdisjoint(TE_GEMM_CLASSES)


def te_linears(chunk: torch.nn.Module) -> list[Named]:
    """Every TE weight-GEMM layer of a chunk, in registration order."""
    return [(name, m) for name, m in chunk.named_modules() if is_te_linear(m)]


def delays(module: torch.nn.Module) -> bool:
    """TE's own flag: this layer queues its weight GEMM in backward."""
    store = getattr(module, "wgrad_store", None)
    return store is not None and bool(store.delay_wgrad_compute())


def te_delayed_modules(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The TE layers of a chunk whose weight gradients wait for ``backward_dw``, in order."""
    return [m for _, m in te_linears(chunk) if delays(m)]


def queued(module: torch.nn.Module) -> int:
    """Entries in the layer's queue: the weight GEMMs its backward calls left (TE's layout)."""
    return module.wgrad_store.context.qsize()


def _names(layers: Sequence[Named], limit: int = 3) -> str:
    shown = ", ".join(name or type(m).__name__ for name, m in layers[:limit])
    return shown + (f" and {len(layers) - limit} more" if len(layers) > limit else "")


def _ddp_config(chunk: torch.nn.Module):
    """Megatron DDP's config of a chunk, looking through ``.module`` wrappers; None if unwrapped."""
    inner = chunk
    while inner is not None:
        if hasattr(inner, "ddp_config"):
            return inner.ddp_config
        inner = getattr(inner, "module", None)
    return None


def _megatron_gate_open(module: torch.nn.Module) -> bool:
    """Megatron's TE wrappers run TE's backward_dw only while their delay flag is on."""
    own = getattr(module, "delay_wgrad_compute", None)  # TEGroupedLinear keeps its own
    if isinstance(own, bool):
        return own
    return bool(getattr(getattr(module, "config", None), "delay_wgrad_compute", True))


BUILD_WITH_DELAY = (
    "build the model with delayed weight gradients: set config.delay_wgrad_compute = True on "
    "the TransformerConfig after constructing it (its own check asks for "
    "overlap_moe_expert_parallel_comm, which only Megatron's combined-1F1B schedule uses) and "
    "before building the model, and wrap each chunk in DistributedDataParallel with "
    "DistributedDataParallelConfig(delay_wgrad_compute=True)"
)


def problems(chunks: Iterable[torch.nn.Module], num_splits: int | None = None) -> list[str]:
    """TE layers whose weight gradients a zero-bubble ``W`` cannot produce correctly
    (``num_splits``: segments per micro-batch; None if not known)."""
    found: list[str] = []
    for index, chunk in enumerate(chunks):
        where = f"model chunk {index}: " if index else ""
        found += [where + p for p in _chunk_problems(chunk, num_splits)]
    return found


def _chunk_problems(chunk: torch.nn.Module, num_splits: int | None) -> list[str]:
    layers = te_linears(chunk)
    fused_mlps = [(n, m) for n, m in chunk.named_modules()
                  if not TE_OP_FUSER_MLPS.isdisjoint(c.__name__ for c in type(m).__mro__)]
    if not layers and not fused_mlps:
        return []
    found = []
    old = [(n, m) for n, m in layers
           if not hasattr(m, "register_wgrad_accumulation_and_reduce_hooks")]
    if old:
        found.append(
            f"Transformer Engine layers ({_names(old)}) cannot delay their weight "
            "gradients for a zero-bubble W in a way Megatron DDP can follow: this needs "
            "Transformer Engine >= 2.7 (backward_dw, from 2.3, and "
            "register_wgrad_accumulation_and_reduce_hooks, from 2.7); upgrade it, or use "
            "schedule='1f1b'"
        )
        return found
    eager = [(n, m) for n, m in layers if not delays(m)]
    if eager:
        found.append(
            f"zero-bubble schedules compute weight gradients in W, but the Transformer Engine "
            f"layers {_names(eager)} were built without delay_wgrad_compute, so theirs would stay "
            f"in B: {BUILD_WITH_DELAY}; or use the local layer spec, or schedule='1f1b'"
        )
    delayed = [(n, m) for n, m in layers if delays(m)]
    gated = [(n, m) for n, m in delayed if not _megatron_gate_open(m)]
    if gated:
        found.append(
            f"config.delay_wgrad_compute is False for {_names(gated)}, which were built with it: "
            "Megatron's TE wrappers then skip backward_dw and the queued weight gradients are "
            "never computed; keep it True"
        )
    unqueued = [(n, m) for n, m in delayed
                if not hasattr(getattr(m.wgrad_store, "context", None), "qsize")]
    if unqueued:
        found.append(
            f"the Transformer Engine layers {_names(unqueued)} keep their delayed weight "
            "gradients in a store without a queue (wgrad_store.context, a queue.Queue in TE "
            "2.3-2.18); Seq1F1B cannot tell which unit queued what: use a supported Transformer "
            "Engine or schedule='1f1b'"
        )
    found += _ddp_problems(chunk, delayed)
    found += _overwrite_problems(delayed, num_splits)
    biased = [(n, m) for n, m in delayed if getattr(m, "use_bias", False)]
    if biased:
        found.append(
            f"the delayed Transformer Engine layers {_names(biased)} have biases: TE's "
            "backward_dw writes a bias gradient only into an empty param.grad, and a bias "
            "gradient that B already produced (skip_bias_add, row-parallel or FP8 layers) is "
            "then dropped or crashes once several units wait for W; build with "
            "add_bias_linear=False (and add_qkv_bias=False), or use schedule='1f1b'"
        )
    if fused_mlps:
        found.append(
            f"{_names(fused_mlps)} (use_te_op_fuser) runs fc1/fc2 through Transformer Engine "
            "operations that ignore delay_wgrad_compute, so the layers' delayed-gradient hooks "
            "would never fire; disable use_te_op_fuser for zero-bubble schedules"
        )
    return found


def _overwrite_problems(layers: Sequence[Named], num_splits: int | None) -> list[str]:
    overwriting = [(n, m) for n, m in layers if getattr(m, "fuse_wgrad_accumulation", False)
                   and getattr(m, "disable_parameter_transpose_cache", True) is False]
    if not overwriting or num_splits == 1:
        return []
    return [
        f"gradient_accumulation_fusion on {_names(overwriting)}: Megatron marks the first "
        "forward of an iteration (segment 0 of micro-batch 0) is_first_microbatch, and TE's "
        "weight GEMM for it overwrites main_grad instead of adding; its backward runs after "
        "those of the micro-batch's later segments, whose gradients it would erase; set "
        "disable_parameter_transpose_cache=True or gradient_accumulation_fusion=False"
    ]


def first_microbatch_problems(chunks: Iterable[torch.nn.Module], num_splits: int) -> list[str]:
    """Every schedule with segments: TE layers whose first-micro-batch GEMM overwrites."""
    return [p for chunk in chunks for p in _overwrite_problems(te_linears(chunk), num_splits)][:1]


def _ddp_problems(chunk: torch.nn.Module, delayed: list[Named]) -> list[str]:
    """Megatron DDP must take each delayed gradient from backward_dw, once and in time."""
    found = []
    ddp_config = _ddp_config(chunk)
    unhooked = [(n, m) for n, m in delayed if not m.wgrad_accumulation_and_reduce_hooks]
    if unhooked:
        why = ("its DistributedDataParallelConfig has delay_wgrad_compute=False"
               if ddp_config is not None else "the chunk is not wrapped in Megatron DDP")
        found.append(
            f"nothing takes the delayed weight gradients of {_names(unhooked)} ({why}): TE's "
            "backward_dw overwrites param.grad rather than adding to it, and only Megatron DDP "
            "built with DistributedDataParallelConfig(delay_wgrad_compute=True) registers the "
            "hooks (register_wgrad_accumulation_and_reduce_hooks) that move each into "
            "main_grad; wrap each chunk in DistributedDataParallel with that option"
        )
    fused = [(n, m) for n, m in delayed if getattr(m, "fuse_wgrad_accumulation", False)]
    if fused and ddp_config is not None and getattr(ddp_config, "overlap_grad_reduce", False):
        found.append(
            f"gradient_accumulation_fusion with overlap_grad_reduce on delayed Transformer "
            f"Engine layers ({_names(fused)}): with fused accumulation TE leaves param.grad only "
            "as B's placeholder, which the first W's DDP hook clears, and Megatron DDP's hook "
            "asserts param.grad in every later W; set overlap_grad_reduce=False or "
            "gradient_accumulation_fusion=False"
        )
    return found


def without_w_problems(chunks: Iterable[torch.nn.Module]) -> list[str]:
    """Schedules without ``W`` would leave delayed TE weight gradients queued forever."""
    delayed = [(n, m) for chunk in chunks for n, m in te_linears(chunk) if delays(m)]
    if not delayed:
        return []
    return [
        f"the Transformer Engine layers {_names(delayed)} were built with delay_wgrad_compute: "
        "their weight gradients wait for backward_dw, which only a zero-bubble schedule's W "
        "calls; use schedule='zb-h1' or 'zb-h2', or build without delay_wgrad_compute"
    ]


def delayed_layers(chunks: Sequence[torch.nn.Module]) -> list[list[Named]]:
    """Per chunk, its Transformer Engine layers with delayed weight gradients (a module walk:
    the executor does it once per configuration)."""
    return [[(n, m) for n, m in te_linears(chunk) if delays(m)] for chunk in chunks]


class DelayedLayers:
    """Which delayed TE layers each unit's ``B`` queued work in, and their ``W`` calls."""

    def __init__(self, chunks: Sequence[torch.nn.Module] = (),
                 layers: Sequence[Sequence[Named]] | None = None) -> None:
        self._layers = [list(chunk) for chunk in layers] if layers is not None \
            else delayed_layers(chunks)
        self._fifo: dict[int, deque] = {}  # id(layer) -> units whose entry it holds, oldest first

    def _of(self, unit: tuple) -> list[Named]:
        chunk = unit[2]  # units are (micro-batch, segment, chunk)
        return self._layers[chunk] if chunk < len(self._layers) else []

    def snapshot(self, unit: tuple) -> list[int]:
        """Queue lengths of the unit's chunk, taken before its ``B``."""
        return [queued(m) for _, m in self._of(unit)]

    def queued_by(self, unit: tuple, before: list[int]) -> list[Callable[[], None]]:
        """After ``B``: one ``backward_dw`` call for every layer whose queue grew."""
        work = []
        for (name, layer), count in zip(self._of(unit), before):
            if queued(layer) > count:
                self._fifo.setdefault(id(layer), deque()).append(unit)
                work.append(self._backward_dw(name, layer, unit))
        return work

    def _backward_dw(self, name: str, layer: torch.nn.Module, unit: tuple) -> Callable[[], None]:
        def weight_grad() -> None:
            fifo = self._fifo[id(layer)]
            if fifo[0] != unit:
                raise RuntimeError(
                    f"Seq1F1B: W of unit {unit} would take unit {fifo[0]}'s weight gradient from "
                    f"Transformer Engine layer {name}: TE queues them first-in-first-out, so a "
                    "rank must run its W in the order of its B"
                )
            fifo.popleft()
            held = queued(layer)
            layer.backward_dw()
            if queued(layer) >= held:
                raise RuntimeError(
                    f"Seq1F1B: backward_dw of Transformer Engine layer {name} computed nothing "
                    "(was config.delay_wgrad_compute switched off after building?); its weight "
                    "gradient would be lost"
                )

        return weight_grad

    def leftovers(self) -> list[str]:
        """End of iteration: layers still holding weight gradients nobody computed."""
        return [f"{name} holds {queued(m)}" for layers in self._layers for name, m in layers
                if queued(m)]

    def clear(self) -> None:
        self._fifo.clear()


__all__ = ["DelayedLayers", "delays", "is_te_linear", "problems", "queued", "te_delayed_modules",
           "te_linears", "without_w_problems"]
