"""The K/V cache's gradient bookkeeping, without a model: gradient goes where it belongs and
each owner takes it once; a window keeps out-of-reach segments out; without a window the
work per segment does not grow with the number of segments."""

import pytest
import torch

from megatron_seq1f1b.kv_cache import KVAppend, KVStore
from megatron_seq1f1b.segments import SegmentInfo


def _run(lengths, window):
    """Each segment's 'attention' is sum(weights * K/V view); returns grads and pending log."""
    torch.manual_seed(0)
    seq = sum(lengths)
    keys = torch.randn(seq, 2, 3, requires_grad=True)
    values = torch.randn(seq, 2, 3, requires_grad=True)
    weights = torch.randn(seq, 2, 3)
    store, outputs, start = KVStore(), [], 0
    entry = None
    for index, length in enumerate(lengths):
        info = SegmentInfo(0, index, len(lengths), start, start + length, tuple(lengths))
        k, v = keys[start:start + length], values[start:start + length]
        if entry is None:
            entry = store.create(0, 0, "layer", k, v, seq)
        first = 0 if window is None else max(0, start - window)
        view_k, view_v = KVAppend.apply(k, v, store, entry, info, True, first)
        assert view_k.shape[0] == start + length - first
        outputs.append((view_k * weights[first:start + length]).sum()
                       + (view_v * weights[first:start + length] ** 2).sum())
        start += length
    pending = []
    for out in reversed(outputs):
        out.backward()
        pending.append(sorted(entry.owed))
    assert store.live_entries() == 0
    return keys.grad, values.grad, pending


@pytest.mark.parametrize("window", [None, 0, 5, 19])
def test_gradients_equal_direct_autograd(window):
    lengths = (8, 8, 8, 8)
    grad_k, grad_v, _ = _run(lengths, window)
    torch.manual_seed(0)  # the same tensors, straight through autograd
    keys = torch.randn(32, 2, 3, requires_grad=True)
    values = torch.randn(32, 2, 3, requires_grad=True)
    weights = torch.randn(32, 2, 3)
    total, start = 0, 0
    for length in lengths:
        first = 0 if window is None else max(0, start - window)
        total = total + (keys[first:start + length] * weights[first:start + length]).sum() \
            + (values[first:start + length] * weights[first:start + length] ** 2).sum()
        start += length
    total.backward()
    torch.testing.assert_close(grad_k, keys.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_v, values.grad, rtol=1e-6, atol=0)


def test_a_window_keeps_pending_gradient_to_segments_in_reach():
    # Segments of 8; backward of segment 3, 2, 1, 0 in turn.
    _, _, full = _run((8, 8, 8, 8), None)
    _, _, windowed = _run((8, 8, 8, 8), 5)
    assert full == [[0, 1, 2], [0, 1], [0], []]
    assert windowed == [[2], [1], [0], []]


def test_without_a_window_a_backward_costs_the_same_operations_whatever_k():
    """One prefix buffer: each segment's backward adds what it owes with one operation per
    tensor, not one per earlier segment (the host dispatches every operation on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def last_backward_ops(k):
        store, seq = KVStore(), 8 * k
        keys = torch.randn(seq, 2, 3, requires_grad=True)
        entry, outputs, start = None, [], 0
        for index in range(k):
            info = SegmentInfo(0, index, k, start, start + 8, (8,) * k)
            k_seg = keys[start:start + 8]
            if entry is None:
                entry = store.create(0, 0, "layer", k_seg, k_seg, seq)
            view_k, view_v = KVAppend.apply(k_seg, k_seg, store, entry, info, True, 0)
            outputs.append(view_k.sum() + view_v.sum())
            start += 8
        with Count() as count:
            outputs[-1].backward()
        assert entry.prefix is not None and not entry.pending
        return count.ops

    assert last_backward_ops(8) == last_backward_ops(2)
