"""What a recurrent layer hands the next segment: its final state, and the state's gradient back.

Attention's carry-over (:mod:`~megatron_seq1f1b.segments.kv_cache`) holds keys and values
that grow with the prefix. A recurrent sequence mixer (Mamba-2's scan, a gated delta
net, a causal convolution's window) leaves a state of fixed size instead: segment
``j + 1`` starts from segment ``j``'s final state and, in the backward (segments of a
micro-batch in reverse order), hands the gradient of that state back to segment ``j``.
Both carry-overs follow one contract, per (micro-batch, model chunk, layer, name):

* **what crosses**: attention the prefix's K/V rows; a recurrent layer its final state;
* **how the next segment consumes it**: attention attends over the rows; a recurrent
  layer passes the state as its kernel's initial state (:func:`initial`);
* **how the gradient flows back**: attention's key gradients are added into the carry-over
  and taken by their owner's backward; a recurrent layer's state gradient is left by the
  consumer's backward (:class:`_StateIn`) and injected into the producer's final state by
  its backward (:func:`handed_on` attaches it to the layer's output, :class:`_StateOut`).

A later segment's backward never runs through an earlier segment's graph: the consumer
gets a detached copy (a leaf) of the state. Both happen in B (zero-bubble schedules keep
W free of them). A state is dropped when its consumer's backward ends (or, forward-only,
when the consumer's forward ends); recomputation (activation checkpointing) re-runs a
forward inside its backward and gets the same initial state, without storing again.

Documents: where a document starts exactly at the cut, the next segment starts from zeros
(for that sample); a document crossing the cut carries its state. (Documents starting
inside a segment are the kernel's business: its ``seq_idx`` / ``cu_seqlens``.)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from megatron_seq1f1b.segments import active as segments


class StateCarry:
    """The states of one iteration: ``(micro-batch, chunk, layer id, name, segment)`` -> the
    segment's final state (detached), and the gradients consumers left for them."""

    def __init__(self) -> None:
        self._states: dict[tuple, torch.Tensor] = {}
        self._grads: dict[tuple, torch.Tensor] = {}

    def put(self, key: tuple, state: torch.Tensor) -> None:
        self._states[key] = state.detach()

    def get(self, key: tuple) -> torch.Tensor | None:
        return self._states.get(key)

    def leave_gradient(self, key: tuple, grad: torch.Tensor) -> None:
        held = self._grads.get(key)
        self._grads[key] = grad if held is None else held + grad

    def take_gradient(self, key: tuple) -> torch.Tensor | None:
        return self._grads.pop(key, None)

    def release(self, microbatch: int, chunk: int, consumer: int | None = None) -> None:
        """Drop the states a segment consumed (``consumer``: its index; the gradients it
        left stay for their producers), or all of a micro-batch's (``None``: its first
        segment's backward, or forward-only end)."""
        for key in [k for k in self._states if k[0] == microbatch and k[1] == chunk
                    and (consumer is None or k[4] == consumer - 1)]:
            del self._states[key]
        if consumer is None:
            for key in [k for k in self._grads if k[0] == microbatch and k[1] == chunk]:
                del self._grads[key]

    def live(self) -> int:
        """States and gradients still held (for leak checks)."""
        return len(self._states) + len(self._grads)

    def clear(self) -> None:
        self._states.clear()
        self._grads.clear()


def _key(unit, layer: Any, name: str, segment: int) -> tuple:
    return (unit.info.microbatch, unit.info.chunk, id(layer), name, segment)


def _older_documents(unit, state: torch.Tensor, window_axis: int | None) -> torch.Tensor:
    """``state`` with what belongs to documents before the one crossing into this segment
    zeroed, per sample: all of it where a document starts at the cut; of a window (the last
    ``n`` positions before the cut along ``window_axis``) the positions before the crossing
    document's start."""
    documents = unit.run.documents_of(unit.info.microbatch)
    if documents is None:
        return state
    cut = unit.info.start
    kept = state
    for sample in range(len(documents.starts)):
        latest = documents.document_start(sample, cut)  # a bisection, not a scan
        if window_axis is None:
            drop = slice(None) if latest == cut else slice(0, 0)
        else:
            n = state.shape[window_axis]
            drop = slice(0, max(0, min(n, latest - (cut - n))))
        if drop.stop == 0:
            continue
        if kept is state:
            kept = state.clone()
        index = [sample] + [slice(None)] * (state.dim() - 1)
        if window_axis is not None:
            index[window_axis] = drop
        kept[tuple(index)] = 0
    return kept


class _StateIn(torch.autograd.Function):
    """The consumer's initial state (a leaf copy); its gradient is left for the producer."""

    @staticmethod
    def forward(ctx, state, carry, key):
        ctx.carry, ctx.key = weakref.ref(carry), key
        return state.view_as(state)

    @staticmethod
    def backward(ctx, grad):
        carry = ctx.carry()
        if carry is None:
            raise RuntimeError(f"Seq1F1B: backward of {ctx.key} after its iteration ended "
                               "(its state carry-over is gone)")
        carry.leave_gradient(ctx.key, grad)
        return None, None, None


class _StateOut(torch.autograd.Function):
    """The layer's output, unchanged; its backward injects the gradient the next segment
    left for this segment's final state."""

    @staticmethod
    def forward(ctx, output, final_state, carry, key):
        ctx.carry, ctx.key = weakref.ref(carry), key
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        carry = ctx.carry()
        owed = None if carry is None else carry.take_gradient(ctx.key)
        return grad_output, owed, None, None


def initial(layer: Any, name: str, window_axis: int | None = None,
            restart_documents: bool = True) -> torch.Tensor | None:
    """The initial state of ``layer``'s ``name`` for the running segment: the previous
    segment's final state, or None (the first segment, or outside segments): the kernel
    then starts from zeros. With documents, what belongs to earlier documents is zeroed per
    sample (``window_axis``: the state is the last inputs before the cut along that axis,
    batch first, e.g. a causal convolution's window; else a recurrence's summary state),
    unless ``restart_documents`` is False (a layer that, as Megatron's recurrent mixers on
    unpacked batches, does not see the documents: its state runs on across them)."""
    unit = segments.active()
    if unit is None or unit.info.index == 0:
        return None
    carry = unit.run.states
    previous = carry.get(_key(unit, layer, name, unit.info.index - 1))
    if previous is None:
        raise RuntimeError(
            f"Seq1F1B: segment {unit.info.index} of micro-batch {unit.info.microbatch} found no "
            f"state {name!r} of segment {unit.info.index - 1} (forwards out of order?)")
    leaf = previous.detach().requires_grad_(torch.is_grad_enabled())
    state = leaf if not leaf.requires_grad else \
        _StateIn.apply(leaf, carry, _key(unit, layer, name, unit.info.index - 1))
    # zeroed after the hand-over: those entries' gradient is zero too
    return _older_documents(unit, state, window_axis) if restart_documents else state


def handed_on(layer: Any, name: str, output: torch.Tensor,
              final_state: torch.Tensor) -> torch.Tensor:
    """Keep the running segment's ``final_state`` for the next segment and return
    ``output`` tied to it, so that the next segment's state gradient reaches this segment's
    backward. Outside segments, or for the last segment: ``output`` as it is."""
    unit = segments.active()
    if unit is None or unit.info.is_last:
        return output
    carry = unit.run.states
    key = _key(unit, layer, name, unit.info.index)
    if unit.phase == segments.FORWARD:
        carry.put(key, final_state)
    if not (torch.is_grad_enabled() and final_state.requires_grad):
        return output
    return _StateOut.apply(output, final_state, carry, key)
