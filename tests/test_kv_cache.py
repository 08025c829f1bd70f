"""The K/V cache's gradient bookkeeping, without a model: gradient goes where it belongs and
each owner takes it once; a window keeps out-of-reach segments out; without a window the
work per segment does not grow with the number of segments."""

import pytest
import torch

from megatron_seq1f1b.attention.segmented import segment_kv
from megatron_seq1f1b.segments import run as segments
from megatron_seq1f1b.segments.kv_cache import KVAppend, KVStore
from megatron_seq1f1b.segments.run import SegmentInfo, SegmentRun


def _run(lengths, window, documents=None):
    """Each segment's 'attention' is sum(weights * K/V it sees); returns grads and pending log.

    Segments go through the model hooks' own path (``attention.segment_kv``) in a SegmentRun.
    """
    torch.manual_seed(0)
    seq = sum(lengths)
    keys = torch.randn(seq, 2, 3, requires_grad=True)
    values = torch.randn(seq, 2, 3, requires_grad=True)
    weights = torch.randn(seq, 2, 3)
    run = SegmentRun(lengths, documents=None if documents is None else [documents])
    outputs = []
    for index in range(len(lengths)):
        with run.forward(0, index) as info:
            k, v = keys[info.start:info.end], values[info.start:info.end]
            view_k, view_v, view, _ = segment_kv("layer", k, v, segments.active(), window)
            first = view.key_start if view_k.shape[0] != info.length else info.start
            assert view_k.shape[0] == info.end - first
            outputs.append((view_k * weights[first:info.end]).sum()
                           + (view_v * weights[first:info.end] ** 2).sum())
    pending = []
    for index, out in reversed(list(enumerate(outputs))):
        with run.backward(0, index):
            entries = list(run.kv._entries.values())
            out.backward()
        pending.append(sorted(i for entry in entries for i in entry.owed))
    assert run.kv.live_entries() == 0
    run.close()
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
        starts = tuple(range(0, seq, 8))
        keys = torch.randn(seq, 2, 3, requires_grad=True)
        entry, outputs, start = None, [], 0
        for index in range(k):
            info = SegmentInfo(0, index, k, start, start + 8, (8,) * k)
            k_seg = keys[start:start + 8]
            if entry is None:
                entry = store.create(0, 0, "layer", k_seg, k_seg, end=seq, starts=starts,
                                     lengths=(8,) * k)
            view_k, view_v = KVAppend.apply(k_seg, k_seg, store, entry, info, True, 0)
            outputs.append(view_k.sum() + view_v.sum())
            start += 8
        with Count() as count:
            outputs[-1].backward()
        assert entry.prefix is not None and not entry.pending
        return count.ops

    assert last_backward_ops(8) == last_backward_ops(2)


def _direct(lengths, ranges):
    """The same 'attention' straight through autograd, each segment over keys ``ranges[j]``."""
    torch.manual_seed(0)
    seq = sum(lengths)
    keys = torch.randn(seq, 2, 3, requires_grad=True)
    values = torch.randn(seq, 2, 3, requires_grad=True)
    weights = torch.randn(seq, 2, 3)
    total = 0
    for first, end in ranges:
        total = total + (keys[first:end] * weights[first:end]).sum() \
            + (values[first:end] * weights[first:end] ** 2).sum()
    total.backward()
    return keys.grad, values.grad


@pytest.mark.parametrize("starts, window, ranges", [
    ((0, 5, 20), None, [(0, 8), (5, 16), (5, 24), (20, 32)]),   # one chain from row 5
    ((0, 8, 20), None, [(0, 8), (8, 16), (8, 24), (20, 32)]),   # segment 0 alone
    ((0, 8, 16, 24), None, [(0, 8), (8, 16), (16, 24), (24, 32)]),  # every cut at a document end
    ((0, 3), 4, [(0, 8), (4, 16), (12, 24), (20, 32)]),          # a window inside one document
])
def test_documents_carry_only_the_crossing_document(starts, window, ranges):
    from megatron_seq1f1b.segments.documents import Documents

    lengths = (8, 8, 8, 8)
    documents = Documents((starts,), 32)
    grad_k, grad_v, _ = _run(lengths, window, documents)
    expected_k, expected_v = _direct(lengths, ranges)
    torch.testing.assert_close(grad_k, expected_k, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_v, expected_v, rtol=1e-6, atol=0)


def test_a_chain_buffer_holds_only_its_own_segments_rows():
    from megatron_seq1f1b.segments.documents import Documents

    run = SegmentRun((8, 8, 8, 8), documents=[Documents(((0, 5, 20),), 32)])
    keys = torch.randn(32, 1, 2, 3)
    for index in range(4):
        with run.forward(0, index) as info:
            segment_kv("layer", keys[info.start:info.end], keys[info.start:info.end],
                       segments.active(), None)
    (entry,) = run.kv._entries.values()
    assert (entry.base, entry.end, entry.keys.shape[0]) == (0, 32, 32)  # one chain, 0..32
    run = SegmentRun((8, 8, 8, 8), documents=[Documents(((0, 8, 20),), 32)])
    for index in range(4):
        with run.forward(0, index) as info:
            segment_kv("layer", keys[info.start:info.end], keys[info.start:info.end],
                       segments.active(), None)
    (entry,) = run.kv._entries.values()  # segment 0 alone: its rows are in no buffer
    assert (entry.base, entry.end, entry.keys.shape[0]) == (8, 32, 24)
    run = SegmentRun((8, 8, 8, 8), documents=[Documents(((0, 8, 16, 24),), 32)])
    for index in range(4):
        with run.forward(0, index) as info:
            segment_kv("layer", keys[info.start:info.end], keys[info.start:info.end],
                       segments.active(), None)
    assert run.kv.live_entries() == 0  # every segment starts a document: nothing carried


def _attend(view_k, view_v, query, extra=None):
    """Bottom-right causal attention over the segment's keys, the sink on, as the flash core
    attention calls it; ``extra``: a second use of the keys."""
    from megatron_seq1f1b.attention.prefix import bottom_right_causal

    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, view_k, view_v))
    out = bottom_right_causal(q, k, v, scale=0.5, sink=view_k.seq1f1b_grad_sink).sum()
    return out if extra is None else out + extra(view_k)


def _sinking_run(lengths, extra=None):
    torch.manual_seed(0)
    seq = sum(lengths)
    keys, values, queries = (torch.randn(seq, 1, 2, 4, dtype=torch.float64, requires_grad=True)
                             for _ in range(3))
    run = SegmentRun(lengths)
    outputs = []
    for index in range(len(lengths)):
        with run.forward(0, index) as info:
            k, v = keys[info.start:info.end], values[info.start:info.end]
            view_k, view_v, _, _ = segment_kv("layer", k, v, segments.active())
            outputs.append(_attend(view_k, view_v, queries[info.start:info.end], extra))
    for index, out in reversed(list(enumerate(outputs))):
        with run.backward(0, index):
            out.backward()
    run.close()
    return [t.grad for t in (keys, values, queries)]


def test_attention_adds_key_gradients_into_the_carry_over_exactly(monkeypatch):
    """The CPU flash attention adds its key/value gradients into the carry-over's buffer
    (no gradient as large as its keys; the first contributor writes a fresh one): equal
    to the whole sequence's causal attention."""
    from megatron_seq1f1b.segments.kv_cache import KVEntry

    sunk, take_sunk = [], KVEntry.take_sunk
    monkeypatch.setattr(KVEntry, "take_sunk",
                        lambda self, index, *a: sunk.append(index) or take_sunk(self, index, *a))
    lengths = (5, 7, 6, 4)
    got = _sinking_run(lengths)
    assert sunk == [3, 2, 1]  # the last segment's is made for it; the first has no prefix
    torch.manual_seed(0)
    keys, values, queries = (torch.randn(22, 1, 2, 4, dtype=torch.float64, requires_grad=True)
                             for _ in range(3))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (queries, keys, values))
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5).sum() \
        .backward()
    for name, g, e in zip(("keys", "values", "queries"), got, (keys.grad, values.grad,
                                                                queries.grad)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=name)


def test_keys_used_beyond_the_sinking_attention_are_refused():
    with pytest.raises(RuntimeError, match="another gradient reached the keys"):
        _sinking_run((5, 7, 6, 4), extra=lambda view_k: view_k.sum())


def test_a_micro_batchs_rolled_mtp_columns_go_with_its_last_backward():
    """Multi-token prediction's rolled columns live from a micro-batch's first forward to its
    last backward (segment 0), not to the end of the iteration (m micro-batches of them)."""
    run = SegmentRun((8, 8))
    for microbatch in (0, 1):
        with run.forward(microbatch, 0):
            run.mtp_rolls[(microbatch, 0, "labels")] = ["rolled"]
    for index in (1, 0):
        with run.backward(0, index):
            assert (0, 0, "labels") in run.mtp_rolls
    assert list(run.mtp_rolls) == [(1, 0, "labels")]


def test_prefetched_micro_batches_reach_the_device_one_at_a_time(monkeypatch):
    """Variable lengths and documents read every micro-batch ahead (plan data); each goes to
    the device when its first segment asks, not all m at the iteration's start."""
    from megatron_seq1f1b.segments import run as run_module

    moved = []
    monkeypatch.setattr(run_module, "to_device", lambda batch, device: moved.append(batch) or batch)
    data = run_module.SegmentData(iter([{"mb": 0}, {"mb": 1}, {"mb": 2}]))
    assert data.prefetch(3) == [{"mb": 0}, {"mb": 1}, {"mb": 2}] and moved == []
    run = SegmentRun((8, 8))
    with run.forward(0, 0):
        assert next(data) == {"mb": 0}
    with run.forward(0, 1):
        assert next(data) == {"mb": 0}
    with run.forward(1, 0):
        assert next(data) == {"mb": 1}
    assert moved == [{"mb": 0}, {"mb": 1}]


def test_shared_masks_go_with_their_micro_batch_where_lengths_vary():
    """A mask that depends on a segment's shape alone is shared by the layers, and by the
    micro-batches where their segments repeat shapes; with lengths of their own it goes with
    its micro-batch's last backward (kept, m x k of them would wait for the iteration's end)."""
    def mask():
        return torch.ones(2, 2, dtype=torch.bool)

    fixed = SegmentRun((8, 8))
    with fixed.forward(0, 0) as info:
        shared = fixed.shared_mask(info, ("window", 8, 8), mask)
    with fixed.forward(1, 0) as info:
        assert fixed.shared_mask(info, ("window", 8, 8), mask) is shared
    varying = SegmentRun(None, microbatch_lengths=[(8, 8), (6, 10)])
    with varying.forward(0, 0) as info:
        first = varying.shared_mask(info, ("window", 8, 8), mask)
        assert varying.shared_mask(info, ("window", 8, 8), mask) is first  # the layers share
    for index in (1, 0):
        with varying.backward(0, index):
            pass
    with varying.forward(0, 0) as info:  # gone with micro-batch 0: made again
        assert varying.shared_mask(info, ("window", 8, 8), mask) is not first


def test_a_micro_batchs_chunks_keep_what_they_share_until_chunk_0_goes_back():
    """Interleaved: a micro-batch's model chunks share its masks and index tensors; chunk 0's
    last backward comes last on every rank, so only it drops them (chunk 1's dropped them
    for chunk 0, which then made them again)."""
    run = SegmentRun((8, 8))
    for chunk in (0, 1):
        with run.forward(0, 0, chunk):
            run.mtp_rolls[(0, chunk, "labels")] = ["rolled"]
    for chunk in (1, 0):
        for index in (1, 0):
            with run.backward(0, index, chunk):
                pass
        assert bool(run.mtp_rolls) == (chunk == 1), (chunk, run.mtp_rolls)
