"""The recurrent state carry-over (segments/state_carry.py), driven by hand: a toy layer with
a diagonal linear recurrence and a causal convolution window, run over segments (forwards in
order, backwards in reverse), equals the whole sequence, forward and every gradient (fp64)."""

import pytest
import torch

from megatron_seq1f1b.segments import state_carry
from megatron_seq1f1b.segments.documents import Documents
from megatron_seq1f1b.segments.run import SegmentRun

WIDTH = 3  # the convolution window


class ToyMixer(torch.nn.Module):
    """y = scan(conv(x)): ``conv`` a causal depthwise convolution of WIDTH taps, ``scan``
    h_t = a * h_{t-1} + u_t; both take an initial state and return their final one, as
    Mamba's kernels do. Under segments the states cross cuts through state_carry; a
    document start (per sample) restarts both."""

    def __init__(self, channels: int):
        super().__init__()
        self.taps = torch.nn.Parameter(torch.randn(channels, WIDTH, dtype=torch.float64))
        self.decay = torch.nn.Parameter(torch.rand(channels, dtype=torch.float64))

    @staticmethod
    def conv(x, taps, window=None, resets=()):
        """x [b, l, c]; window [b, WIDTH - 1, c] (the inputs before x); returns (y, window)."""
        b, _, c = x.shape
        if window is None:
            window = x.new_zeros(b, WIDTH - 1, c)
        padded = torch.cat([window, x], dim=1)
        rows = []
        for t in range(x.shape[1]):
            recent = padded[:, t:t + WIDTH]
            keep = torch.ones(b, WIDTH, 1, dtype=x.dtype)
            for sample, start in resets:  # a document start at t: nothing before it counts
                if start <= t:
                    keep[sample, : max(0, WIDTH - 1 - (t - start))] = 0
            rows.append((recent * keep * taps.t().unsqueeze(0)).sum(1))
        return torch.stack(rows, 1), padded[:, -(WIDTH - 1):]

    @staticmethod
    def scan(u, decay, state=None, resets=()):
        h = u.new_zeros(u.shape[0], u.shape[2]) if state is None else state
        out = []
        for t in range(u.shape[1]):
            for sample, start in resets:
                if start == t:
                    h = torch.cat([h[:sample], torch.zeros_like(h[sample:sample + 1]),
                                   h[sample + 1:]])
            h = decay * h + u[:, t]
            out.append(h)
        return torch.stack(out, 1), h

    def forward(self, x, resets=()):
        window = state_carry.initial(self, "conv", window_axis=1)
        u, window_out = self.conv(x, self.taps, window, resets)
        state = state_carry.initial(self, "scan")
        y, final = self.scan(u, self.decay, state, resets)
        y = state_carry.handed_on(self, "scan", y, final)
        return state_carry.handed_on(self, "conv", y, window_out)


def _resets(documents, start, end):
    """(sample, position in the segment) of document starts inside [start, end), not at 0
    of the sequence (the kernel's own seq_idx / cu_seqlens resets)."""
    return [(sample, s - start) for sample, starts in enumerate(documents)
            for s in starts if start <= s < end and s > 0]


def _run(lengths, documents=None, microbatches=2, batch=2, recompute=False):
    torch.manual_seed(0)
    seq = sum(lengths)
    mixer = ToyMixer(4)
    inputs = [torch.randn(batch, seq, 4, dtype=torch.float64, requires_grad=True)
              for _ in range(microbatches)]
    weights = [torch.randn(batch, seq, 4, dtype=torch.float64) for _ in range(microbatches)]
    starts = documents or ((0,),) * batch
    leaves = [*inputs, *mixer.parameters()]
    # the whole sequence
    whole = sum((mixer(x, _resets(starts, 0, seq)) * w).sum() for x, w in zip(inputs, weights))
    whole.backward()
    expected = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    # segments: all forwards in order, backwards in reverse
    docs = None if documents is None else [Documents(documents, seq)] * microbatches
    run = SegmentRun(lengths, documents=docs)
    outputs = {}
    for mb, (x, w) in enumerate(zip(inputs, weights)):
        for j in range(len(lengths)):
            with run.forward(mb, j) as info:
                part = x[:, info.start:info.end]
                resets = _resets(starts, info.start, info.end)
                if recompute:  # activation checkpointing re-runs the forward in the backward
                    y = torch.utils.checkpoint.checkpoint(mixer, part, resets, use_reentrant=False)
                else:
                    y = mixer(part, resets)
                outputs[mb, j] = (y * w[:, info.start:info.end]).sum()
    # (backward() as the executor runs it: every leaf's path, the carried states' too)
    for mb in range(microbatches):
        for j in reversed(range(len(lengths))):
            with run.backward(mb, j):
                outputs[mb, j].backward()
    grads = [t.grad for t in leaves]
    assert run.states.live() == 0
    run.close()
    return torch.stack([o.detach() for o in outputs.values()]).sum(), whole.detach(), grads, \
        expected


@pytest.mark.parametrize("lengths", [(8,), (3, 5), (1, 2, 1, 4), (2, 2, 2, 2)],
                         ids=["k1", "k2", "shorter-than-window", "k4"])
def test_segments_equal_the_whole_sequence(lengths):
    got, whole, grads, expected = _run(lengths)
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("documents", [((0, 3), (0, 5)), ((0, 2, 6), (0,)), ((0, 4), (0, 1, 7))],
                         ids=["at-cuts", "inside", "mixed"])
def test_documents_restart_the_state(documents):
    """Cuts at 3 and 6: a document starting at a cut restarts its sample's state there; one
    starting inside a segment is the kernel's reset; one crossing carries its state, and of
    the convolution window only its own inputs (a start 1 before a cut: the window's older
    input is another document's)."""
    got, whole, grads, expected = _run((3, 3, 2), documents=documents)
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_recomputation_gets_the_same_initial_state():
    got, whole, grads, expected = _run((3, 2, 3), recompute=True)
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_without_the_carry_segments_differ():
    """The test can fail: with every segment starting from zeros the results differ."""
    saved = state_carry.initial
    state_carry.initial = lambda layer, name, window_axis=None: None
    try:
        got, whole, _, _ = _run((3, 5))
    finally:
        state_carry.initial = saved
    assert not torch.allclose(got, whole)
