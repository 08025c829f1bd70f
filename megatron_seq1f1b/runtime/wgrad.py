"""Deferred weight gradients: the W half of a backward, for zero-bubble schedules.

A zero-bubble schedule splits each unit's backward into B (gradients of the
inputs and activations, which the previous stage waits for) and W (gradients
of the weights, which nobody waits for), and runs W later, in idle time.

How: layer-level deferral. In a zero-bubble iteration (:func:`deferring`)
Megatron's tensor-parallel linear layers (``ColumnParallelLinear`` /
``RowParallelLinear``, which carry nearly all the weight-gradient FLOPs: QKV,
attention projection, MLP, output layer) put their weight into the autograd
graph detached. Their backward, inside :meth:`WeightGradStore.input_grads_only`
(the executor's B), computes the input gradient and its tensor-parallel
reduction as usual, keeps ``(input, grad_output)``, and leaves the weight GEMM
to :meth:`WeightGradStore.run` (the executor's W). Everything else (biases,
norms, embeddings, the router) keeps its weight gradient in B: small, and not
worth the memory.

Why not split the autograd graph (as ``torch.distributed.pipelining`` does)?
Autograd cannot skip the weight GEMM inside a custom ``Function`` such as
Megatron's linear, so a graph split would compute W twice or capture
intermediate gradients of every layer; deferring inside the linear layer
keeps exactly the two tensors the GEMM needs and no graph.

Exactly once, in time. W delivers each weight gradient through the
parameter's own ``AccumulateGrad`` node (``torch.autograd.backward`` on a view
of the weight), so ``param.grad`` accumulation, Megatron DDP's gradient hooks
(``main_grad``, bucket readiness for overlapped reduction) and any tensor
hooks see it as if it came from the original backward; B, which never reaches
the weight, fires none of them. With
``gradient_accumulation_fusion`` the GEMM accumulates straight into
``main_grad`` and a dummy gradient marks ``grad_added_to_main_grad``, as
Megatron's own backward does. Outside :func:`deferring` the layers run
Megatron's forward and backward unchanged.

Transformer Engine layers defer their own weight GEMMs when built with
``delay_wgrad_compute=True``; the store learns each chunk's such layers and a
unit's W calls their ``backward_dw()`` (:mod:`megatron_seq1f1b.runtime.te_wgrad`).

:func:`install` swaps Megatron's linear ``autograd.Function`` for a subclass
(same forward, same saved tensors); it is idempotent and changes nothing
until a store collects.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_seq1f1b.runtime import te_wgrad

_collecting: "deque | None" = None  # the open unit's queue, only inside input_grads_only()
_deferring = False  # only inside deferring(): a zero-bubble iteration


class WeightGradStore:
    """Weight-gradient work of one iteration, queued per unit in backward order."""

    def __init__(self, chunks: Sequence[torch.nn.Module] = (), te_layers=None) -> None:
        self._pending: dict[tuple, deque] = {}
        # the chunks' delayed TE layers, if any (``te_layers``: found before, te_wgrad.delayed_layers)
        self._te = te_wgrad.DelayedLayers(chunks, te_layers)

    @contextlib.contextmanager
    def input_grads_only(self, unit: tuple) -> Iterator[None]:
        """Run a unit's B inside: linear layers queue their weight GEMMs under `unit`."""
        global _collecting
        if unit in self._pending:
            raise RuntimeError(f"Seq1F1B: weight gradients of unit {unit} collected twice")
        outer = _collecting
        _collecting = work = self._pending[unit] = deque()
        te_before = self._te.snapshot(unit)
        try:
            yield
        finally:
            _collecting = outer
        work.extend(self._te.queued_by(unit, te_before))

    def run(self, unit: tuple) -> int:
        """The unit's W: compute and deliver its weight gradients; returns how many."""
        try:
            work = self._pending.pop(unit)
        except KeyError:
            raise RuntimeError(f"Seq1F1B: W of unit {unit} before its B") from None
        count = len(work)
        while work:
            work.popleft()()
        return count

    def pending_units(self) -> list[tuple]:
        return list(self._pending)

    def close(self) -> None:
        """End of iteration: every collected unit must have run its W, every TE queue drained."""
        left, te_left = self.pending_units(), self._te.leftovers()
        self._pending.clear()
        self._te.clear()
        if left:
            raise RuntimeError(f"Seq1F1B: weight gradients of units {left} were never computed")
        if te_left:
            raise RuntimeError(
                "Seq1F1B: Transformer Engine layers kept delayed weight gradients that no W "
                f"computed ({'; '.join(te_left)}): a layer ran backward more than once in a unit, "
                "or outside the schedule's B"
            )


def collecting() -> bool:
    """True inside a B whose weight gradients are deferred."""
    return _collecting is not None


def deliver(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate `grad` into `param` through its AccumulateGrad node (hooks fire as usual)."""
    torch.autograd.backward(param.view_as(param), grad)


def _linear_weight_grad(ctx, input_, weight, grad_output) -> Callable[[], None]:
    """The deferred weight GEMM of one Megatron linear backward (see the module docstring)."""
    sequence_parallel, tp_group = ctx.sequence_parallel, ctx.tp_group
    fused, main_grad = ctx.gradient_accumulation_fusion, ctx.main_grad

    def weight_grad() -> None:
        from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

        with torch.no_grad():  # plain tensor work; only deliver() goes through autograd
            total_input = input_
            if sequence_parallel:
                size = list(input_.size())
                size[0] *= tp_group.size()
                total_input = torch.empty(size, dtype=input_.dtype, device=input_.device)
                dist.all_gather_into_tensor(total_input, input_.contiguous(), group=tp_group)
            grad_2d, input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
            if fused:
                weight.main_grad = main_grad
                _fused_accumulate(input_2d, grad_2d, main_grad)
                grad = None
                if hasattr(weight, "grad_added_to_main_grad"):
                    # a placeholder for DDP's hook, which takes main_grad and drops it: zeroed
                    # only where asked (zero_out_wgrad), as Megatron's own backward
                    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
                    grad = make(main_grad.shape, dtype=input_.dtype, device=input_.device)
                    weight.grad_added_to_main_grad = True
            else:
                grad = grad_2d.t().matmul(input_2d)
        if grad is not None:
            deliver(weight, grad)

    return weight_grad


def _fused_accumulate(input_2d, grad_2d, main_grad) -> None:
    """main_grad += grad^T @ input, with the kernel Megatron's backward uses."""
    import fused_weight_gradient_mlp_cuda  # apex / TE; present wherever the fusion is enabled

    if main_grad.dtype == torch.float32:
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input_2d, grad_2d, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(input_2d, grad_2d, main_grad)
    else:
        raise RuntimeError(f"unsupported main_grad dtype {main_grad.dtype} for gradient fusion")


class _RealWeight:
    """Carries the parameter past autograd: the graph sees only its detached alias."""

    __slots__ = ("param",)

    def __init__(self, param: torch.Tensor):
        self.param = param


def _deferrable_linear_class():
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication

    base = LinearWithGradAccumulationAndAsyncCommunication

    class DeferrableLinear(base):
        """Megatron's linear Function whose weight gradient can wait for W (module docstring)."""

        @classmethod
        def apply(cls, *args):
            # args: input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
            # sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group[, gtp]
            weight = args[1]
            megatron_defers_it = args[6] is not None  # the output layer's own deferral
            remat = len(args) > 9 and isinstance(args[9], int) and args[9] > 1
            if not _deferring or megatron_defers_it or remat or not weight.requires_grad:
                return super().apply(*args)
            # The weight enters the graph detached: B never reaches its AccumulateGrad (so no
            # gradient hook fires there); W delivers the gradient to the parameter itself.
            return super().apply(args[0], weight.detach(), *args[2:], _RealWeight(weight))

        @staticmethod
        def forward(ctx, *args):
            real = args[-1].param if args and isinstance(args[-1], _RealWeight) else None
            ctx.seq1f1b_weight, ctx.seq1f1b_num_inputs = real, len(args)
            output = base.forward(ctx, *(args[:-1] if real is not None else args))
            if real is not None:  # base.forward saw the detached alias, without main_grad
                ctx.main_grad = getattr(real, "main_grad", None) \
                    if ctx.gradient_accumulation_fusion else None
            return output

        @staticmethod
        def backward(ctx, grad_output):
            weight = ctx.seq1f1b_weight
            if weight is None:
                return base.backward(ctx, grad_output)
            if _collecting is None:
                raise RuntimeError(
                    "Seq1F1B: a linear layer forwarded for a zero-bubble schedule ran its "
                    "backward outside the schedule's B step; its weight gradient would be lost"
                )
            input_, alias = ctx.saved_tensors
            grad_input = grad_output.matmul(alias)
            if ctx.allreduce_dgrad:
                dist.all_reduce(grad_input, group=ctx.tp_group)
            if ctx.sequence_parallel:
                scattered = torch.empty(input_.size(), dtype=input_.dtype, device=input_.device)
                dist.reduce_scatter_tensor(scattered, grad_input.contiguous(), group=ctx.tp_group)
                grad_input = scattered
            grad_bias = (grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
                         if ctx.use_bias else None)
            _collecting.append(_linear_weight_grad(ctx, input_, weight, grad_output))
            return (grad_input, None, grad_bias) + (None,) * (ctx.seq1f1b_num_inputs - 3)

    DeferrableLinear.__qualname__ = DeferrableLinear.__name__ = "Seq1F1B" + base.__name__
    return DeferrableLinear


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """A zero-bubble iteration: linear layers forwarded inside defer their weight gradients."""
    global _deferring
    outer, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = outer


def deferral_problems(chunks, num_splits: int | None = None) -> list[str]:
    """Layers whose weight gradients a zero-bubble schedule cannot defer correctly."""
    return te_wgrad.problems(chunks, num_splits)


def without_w_problems(chunks) -> list[str]:
    """Layers that defer their weight gradients although the schedule has no W."""
    return te_wgrad.without_w_problems(chunks)


def install() -> None:
    """Make Megatron's linear layers deferrable (idempotent; inert outside deferring())."""
    from megatron.core.tensor_parallel import layers

    current = layers.LinearWithGradAccumulationAndAsyncCommunication
    if getattr(current, "_seq1f1b_deferrable", False):
        return
    cls = _deferrable_linear_class()
    cls._seq1f1b_deferrable = True
    layers.LinearWithGradAccumulationAndAsyncCommunication = cls


def uninstall() -> None:
    """Give Megatron back its own linear Function (benchmarks: rows after a zero-bubble
    measurement run what a plain Megatron run would)."""
    from megatron.core.tensor_parallel import layers

    current = layers.LinearWithGradAccumulationAndAsyncCommunication
    if getattr(current, "_seq1f1b_deferrable", False):
        layers.LinearWithGradAccumulationAndAsyncCommunication = current.__mro__[1]


__all__ = ["WeightGradStore", "collecting", "deferral_problems", "deferring", "deliver",
           "install", "uninstall", "without_w_problems"]
