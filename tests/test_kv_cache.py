"""The K/V cache's gradient bookkeeping, without a model: shares go where they belong and
leave as soon as their owner takes them; a window keeps out-of-reach segments out."""

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
        pending.append(sorted(entry.pending))
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
