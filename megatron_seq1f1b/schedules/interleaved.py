"""Interleaved Seq1F1B: v model chunks per rank, any number of segments.

Units are (micro-batch, segment, chunk). The forward of chunk c on rank r
needs chunk c on rank r-1 (chunk c-1 on the last rank for the first rank);
the backward runs the other way, and within a micro-batch and chunk segments
are backwarded in reverse order.

Order. Micro-batches are grouped so that a group holds whole micro-batches
and at least ``p`` units: ``g = ceil(p / k)`` micro-batches per group
(``m // g`` groups, sizes as even as possible, larger first). Whole
micro-batches matter: a micro-batch's last segment must be backwarded first,
so forward and backward must agree on which units form a group (the original
Seq1F1B-I cut groups of ``p`` units and broke when ``p % k != 0``). Per group,
forwards run chunk 0 for all its units, then chunk 1, ...; backwards run
chunk v-1 first, units in backward order (micro-batches first-in-first-out,
segments last-in-first-out). For ``k == 1`` and ``m % p == 0`` this is
exactly Megatron's interleaved table.

Warm-up. Rank ``r`` runs ``W_r = (v-1)*G + 2*(p-r-1) + (k-1)`` forwards
(``G`` = units in the first group) before its first backward, then pairs one
forward with one backward, then drains. ``(v-1)*G`` lets the last rank hold
every chunk but the last of the first group; ``2*(p-r-1)`` is Megatron's
allowance for the backward wave to come back; ``k-1`` is the wait for a
micro-batch's last segment, whose backward comes first.

Variable segment counts (one per micro-batch, variable-length micro-batches):
groups take the fewest next whole micro-batches that reach ``p`` units, and a rank
runs as many forwards before each backward as
:mod:`megatron_seq1f1b.schedules.order` says (the rule above, with extra forwards
where a micro-batch has more segments than the one before); equal counts give
exactly the schedule above.

Deadlock freedom is not argued by hand: the schedule is replayed with
rendezvous point-to-point semantics (a send waits for its receive, as on
NCCL) by :mod:`megatron_seq1f1b.schedules.validate`, exhaustively for p in 2..8,
v in 2..4, k in 1..6 and m in 1..16 in the test suite, and on random counts per
micro-batch.

Requirements: pipeline size >= 2 and m >= 1 micro-batches; unlike
Megatron's own interleaved schedule, m need not be a multiple of p.
"""

from __future__ import annotations

import math

from megatron_seq1f1b.schedules.actions import Action, B, F
from megatron_seq1f1b.schedules.order import (
    SegmentCounts, forward_needs, forwards_before, segment_counts, uniform, warmup_of,
)


def microbatch_groups(num_stages: int, num_microbatches: int,
                      num_splits: SegmentCounts) -> list[list[int]]:
    """Consecutive whole micro-batches per group, each group at least ``p`` units (if m allows).

    Equal counts ``k``: ``ceil(p/k)`` micro-batches per group, sizes as even as possible,
    larger first (Megatron's table for ``k == 1``). Counts that differ: each group takes the
    fewest next micro-batches that reach ``p`` units; a shorter tail joins the last group.
    """
    counts = segment_counts(num_microbatches, num_splits)
    if uniform(counts):
        per_group = max(1, math.ceil(num_stages / counts[0]))
        count = max(1, num_microbatches // per_group)
        base, extra = divmod(num_microbatches, count)
        groups, start = [], 0
        for i in range(count):
            size = base + (i < extra)
            groups.append(list(range(start, start + size)))
            start += size
        return groups
    groups, current, units = [], [], 0
    for mb, k in enumerate(counts):
        current.append(mb)
        units += k
        if units >= num_stages:
            groups.append(current)
            current, units = [], 0
    if current:
        if groups:
            groups[-1] += current
        else:
            groups.append(current)
    return groups


def _lead(num_stages: int, rank: int) -> int:
    return 2 * (num_stages - rank - 1)


def warmup_forwards(num_stages: int, num_microbatches: int, num_splits: SegmentCounts,
                    num_model_chunks: int, rank: int) -> int:
    """Forwards before the first backward on `rank` (interleaved; ``W_r`` of the docstring,
    for any counts: :func:`~megatron_seq1f1b.schedules.order.warmup_of`)."""
    return warmups(num_stages, num_microbatches, num_splits, num_model_chunks)[rank]


def warmups(num_stages: int, num_microbatches: int, num_splits: SegmentCounts,
            num_model_chunks: int) -> list[int]:
    """:func:`warmup_forwards` of every rank."""
    forwards, backwards = interleaved_orders(num_stages, num_microbatches, num_splits,
                                             num_model_chunks)
    needs = forward_needs(forwards, backwards, num_model_chunks - 1)
    return [warmup_of(needs, _lead(num_stages, r), len(forwards)) for r in range(num_stages)]


def unpaired_backwards(num_stages: int, num_microbatches: int, num_splits: SegmentCounts,
                       num_model_chunks: int) -> list[frozenset[Action]]:
    """Per rank, the steady-state backwards that must not share a slot (one exchange) with
    the forward right before them.

    A slot pairs a forward with the next backward when the forward runs ``lead`` ahead
    of what the backward waits for. Where the forwards ran out first (the order's
    ``before[j]`` capped at the total), the forward before a backward can be one its
    gradient waits for through the pipeline: one exchange for both would wait forever.
    Equal counts never leave such a pair (a capped backward has no forward before it).
    """
    counts = segment_counts(num_microbatches, num_splits)
    if uniform(counts):
        return [frozenset()] * num_stages
    forwards, backwards = interleaved_orders(num_stages, num_microbatches, counts,
                                             num_model_chunks)
    needs = forward_needs(forwards, backwards, num_model_chunks - 1)
    out = []
    for rank in range(num_stages):
        lead = _lead(num_stages, rank)
        before = forwards_before(needs, lead, len(forwards))
        out.append(frozenset(
            backward for j, (backward, count) in enumerate(zip(backwards, before))
            if count < needs[j] + lead and count > (before[j - 1] if j else 0)))
    return out


def forwards_before_backwards(num_stages: int, num_microbatches: int,
                              num_splits: SegmentCounts, num_model_chunks: int,
                              lead_extra: int = 0) -> list[list[int]]:
    """Per rank, forwards before each backward (:mod:`megatron_seq1f1b.schedules.order`);
    ``lead_extra`` more on rank ``r`` times ``p-1-r`` (zero-bubble H2's longer warm-up)."""
    forwards, backwards = interleaved_orders(num_stages, num_microbatches, num_splits,
                                             num_model_chunks)
    needs = forward_needs(forwards, backwards, num_model_chunks - 1)
    return [forwards_before(needs, _lead(num_stages, r) + lead_extra * (num_stages - r - 1),
                            len(forwards))
            for r in range(num_stages)]


ZB_H2_PROBLEM = (
    "zb-h2 has no interleaved form: its longer warm-up makes the first rank forward chunk c+1 "
    "of a micro-batch whose chunk-c backward it must first pass on (a cycle through the "
    "pipeline's wrap-around link); use zb-h1, which interleaves"
)


def interleaved_problems(num_stages: int, num_microbatches: int, num_splits: int,
                         num_model_chunks: int, schedule: str = "1f1b",
                         forward_only: bool = False) -> list[str]:
    problems = []
    if num_stages < 2:
        problems.append("interleaving (several model chunks) needs pipeline size >= 2")
    if schedule == "zb-h2" and not forward_only:
        problems.append(f"schedule='zb-h2' with model chunks: {ZB_H2_PROBLEM}")
    return problems


def interleaved_orders(num_stages: int, num_microbatches: int, num_splits: SegmentCounts,
                       num_model_chunks: int) -> tuple[list[Action], list[Action]]:
    """The forward and the backward order of units, the same on every rank."""
    p, m, v = num_stages, num_microbatches, num_model_chunks
    if p < 2:
        raise ValueError("interleaving (several model chunks) needs pipeline size >= 2")
    counts = segment_counts(m, num_splits)
    forwards, backwards = [], []
    for group in microbatch_groups(p, m, counts):
        forward_units = [(mb, s) for mb in group for s in range(counts[mb])]
        backward_units = [(mb, s) for mb in group for s in reversed(range(counts[mb]))]
        for chunk in range(v):
            forwards += [F(mb, s, chunk) for mb, s in forward_units]
        for chunk in reversed(range(v)):
            backwards += [B(mb, s, chunk) for mb, s in backward_units]
    return forwards, backwards
