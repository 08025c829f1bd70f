"""How many forwards a rank runs before each backward, for any segments per micro-batch.

Every 1F1B-style order here (Seq1F1B's, interleaved, zero-bubble) keeps one list of
forwards and one of backwards, the same on every rank, and differs between ranks only in
how far the forwards run ahead of the backwards. With ``k`` segments in every micro-batch
that is a warm-up count followed by one forward per backward. With a different number of
segments per micro-batch (variable-length micro-batches cut by a token budget) a fixed
warm-up is not enough: the last stage can start a micro-batch's backward (its last
segment first) only once every segment of it is forwarded, so a micro-batch with more
segments than the one before needs more forwards in flight. One rule covers both::

    before[j] = min(total, max(before[j - 1] + 1, need[j] + lead))

``need[j]``: the forwards, counted in forward order, up to the one whose loss the ``j``-th
backward waits for on the last (virtual) stage (the forward of its micro-batch's last
segment on the last model chunk; 0 for backwards of earlier chunks, which wait for the
wave coming back instead). ``lead``: how far a rank runs ahead of the last stage,
``p-1-r`` on rank ``r`` without interleaving and ``2(p-1-r)`` with it (Megatron's
allowance for the backward wave to come back). For equal counts ``before[j]`` is the old
warm-up plus ``j + 1`` (tests pin the equality), and deadlock freedom is checked by
rendezvous replay (:mod:`megatron_seq1f1b.schedules.validate`), as for every schedule.

Pure Python; imports only the action vocabulary.
"""

from __future__ import annotations

from typing import Sequence, Union

from megatron_seq1f1b.schedules.actions import Action

#: Segments per micro-batch: one count for all, or one per micro-batch.
SegmentCounts = Union[int, Sequence[int]]


def segment_counts(num_microbatches: int, num_splits: SegmentCounts) -> tuple[int, ...]:
    """One segment count per micro-batch (``num_splits`` an int, or a sequence of ``m``)."""
    if isinstance(num_splits, int) and not isinstance(num_splits, bool):
        counts = (num_splits,) * num_microbatches
    else:
        try:
            counts = tuple(num_splits)
        except TypeError:
            raise ValueError(f"num_splits must be a positive integer or one per micro-batch, "
                             f"got {num_splits!r}") from None
        if len(counts) != num_microbatches:
            raise ValueError(f"num_splits has {len(counts)} entries for {num_microbatches} "
                             "micro-batches")
    bad = [c for c in counts if not isinstance(c, int) or isinstance(c, bool) or c < 1]
    if bad:
        raise ValueError(f"segment counts must be positive integers, got {bad[0]!r}")
    return counts


def counts_of(schedule: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Segments per micro-batch read off a schedule's actions (micro-batches ``0..m-1``)."""
    last: dict[int, int] = {}
    for rank in schedule:
        for action in rank:
            if action.segment >= last.get(action.microbatch, 0):
                last[action.microbatch] = action.segment + 1
    return tuple(last.get(mb, 1) for mb in range(max(last, default=-1) + 1))


def uniform(counts: Sequence[int]) -> bool:
    return len(set(counts)) <= 1


def forward_needs(forwards: Sequence[Action], backwards: Sequence[Action],
                  last_chunk: int = 0) -> list[int]:
    """``need[j]`` of the module docstring, for each backward in order."""
    position: dict[tuple[int, int], int] = {}
    for index, action in enumerate(forwards):
        if action.chunk == last_chunk:
            position[action.microbatch] = index + 1  # the last segment's comes last
    return [position[b.microbatch] if b.chunk == last_chunk else 0 for b in backwards]


def forwards_before(needs: Sequence[int], lead: int, total: int) -> list[int]:
    """Forwards before each backward on a rank ``lead`` ahead of the last stage."""
    before, previous = [], -1
    for need in needs:
        previous = min(total, max(previous + 1, need + lead))
        before.append(previous)
    return before


def interleave(forwards: Sequence[Action], backwards: Sequence[Action],
               before: Sequence[int]) -> list[Action]:
    """One rank's order: ``before[j]`` forwards ahead of backward ``j``, then the rest."""
    actions: list[Action] = []
    done = 0
    for backward, count in zip(backwards, before):
        actions += forwards[done:count]
        done = max(done, count)
        actions.append(backward)
    return actions + list(forwards[done:])


def warmup_of(needs: Sequence[int], lead: int, total: int) -> int:
    """Forwards before the steady state, where pairs of one forward and one backward start
    (``before[0] - 1`` unless every forward runs first)."""
    return min(needs[0] + lead - 1, total) if needs else total


def peak_in_flight(before: Sequence[int]) -> int:
    """Most units a rank holds (forwarded, not yet backwarded) in its order."""
    return max((count - j for j, count in enumerate(before)), default=0)


__all__ = ["SegmentCounts", "segment_counts", "counts_of", "uniform", "forward_needs",
           "forwards_before", "interleave", "warmup_of", "peak_in_flight"]
