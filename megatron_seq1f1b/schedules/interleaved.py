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

Deadlock freedom is not argued by hand: the schedule is replayed with
rendezvous point-to-point semantics (a send waits for its receive, as on
NCCL) by :mod:`megatron_seq1f1b.schedules.validate`, exhaustively for p in 2..8,
v in 2..4, k in 1..6 and m in 1..16 in the test suite.

Requirements: pipeline size >= 2 and m >= 1 micro-batches; unlike
Megatron's own interleaved schedule, m need not be a multiple of p.
"""

from __future__ import annotations

import math

from megatron_seq1f1b.schedules.actions import Action, B, F


def microbatch_groups(num_stages: int, num_microbatches: int, num_splits: int) -> list[list[int]]:
    """Consecutive micro-batches per group: each has >= ceil(p/k) of them (if m allows)."""
    per_group = max(1, math.ceil(num_stages / num_splits))
    count = max(1, num_microbatches // per_group)
    base, extra = divmod(num_microbatches, count)
    groups, start = [], 0
    for i in range(count):
        size = base + (i < extra)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def warmup_forwards(num_stages: int, num_microbatches: int, num_splits: int,
                    num_model_chunks: int, rank: int) -> int:
    """Forwards before the first backward on `rank` (interleaved)."""
    first_group = len(microbatch_groups(num_stages, num_microbatches, num_splits)[0]) * num_splits
    warmup = (num_model_chunks - 1) * first_group + 2 * (num_stages - rank - 1) + num_splits - 1
    return min(warmup, num_microbatches * num_splits * num_model_chunks)


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


def interleaved_orders(num_stages: int, num_microbatches: int, num_splits: int,
                       num_model_chunks: int) -> tuple[list[Action], list[Action]]:
    """The forward and the backward order of units, the same on every rank."""
    p, m, k, v = num_stages, num_microbatches, num_splits, num_model_chunks
    if p < 2:
        raise ValueError("interleaving (several model chunks) needs pipeline size >= 2")
    forwards, backwards = [], []
    for group in microbatch_groups(p, m, k):
        forward_units = [(mb, s) for mb in group for s in range(k)]
        backward_units = [(mb, s) for mb in group for s in reversed(range(k))]
        for chunk in range(v):
            forwards += [F(mb, s, chunk) for mb, s in forward_units]
        for chunk in reversed(range(v)):
            backwards += [B(mb, s, chunk) for mb, s in backward_units]
    return forwards, backwards
