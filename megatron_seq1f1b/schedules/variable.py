"""Micro-batches of different lengths: how many segments each gets, and where they are cut.

Post-training frameworks run Megatron-Core with ``variable_seq_lengths=True``: every
micro-batch has its own length ``S_i``. Two ways to cut them:

* a fixed count, ``num_splits`` segments per micro-batch (a micro-batch too short for that
  many segments of whole multiples gets as many as it has multiples);
* a token budget per segment, ``segment_tokens``: ``ceil(S_i / segment_tokens)`` segments,
  so that every unit costs about the same whatever the micro-batch (a short micro-batch
  stays whole); ``num_splits`` is then the most a micro-batch may get (a cap on the
  number of units and their fixed cost; pass a large one for no cap).

Within a micro-batch the segments are cut by the partition: ``uniform`` (equal tokens),
``balanced`` (equal estimated FLOPs, :class:`~megatron_seq1f1b.schedules.partition.CostModel`)
or, with packed documents, ``documents``
(:func:`~megatron_seq1f1b.schedules.partition.split_documents`, which the executor calls with
each micro-batch's documents). The same function runs on every rank, the simulator and the
planner: the cut is plan data, derived from the lengths alone.

Pure Python; no torch.
"""

from __future__ import annotations

import math
from typing import Sequence

from megatron_seq1f1b.schedules.partition import CostModel, split_sequence


def segment_tokens_problems(segment_tokens) -> list[str]:
    """A token budget per segment must be a positive integer (or None)."""
    if segment_tokens is None:
        return []
    if isinstance(segment_tokens, bool) or not isinstance(segment_tokens, int) \
            or segment_tokens < 1:
        return [f"segment_tokens (--seq1f1b-segment-tokens) must be a positive integer, got "
                f"{segment_tokens!r}"]
    return []


def segment_count(length: int, num_splits: int, segment_tokens: int | None = None,
                  multiple_of: int = 1) -> int:
    """Segments of a micro-batch of ``length`` tokens (module docstring), at least 1 and at
    most one per ``multiple_of`` tokens."""
    wanted = num_splits if segment_tokens is None else min(num_splits,
                                                          math.ceil(length / segment_tokens))
    return max(1, min(wanted, length // multiple_of))


def cut_microbatch(length: int, count: int, partition: str, cost: CostModel | None = None,
                   multiple_of: int = 1) -> tuple[int, ...]:
    """One micro-batch's segment lengths: ``uniform`` or ``balanced`` (by ``cost``)."""
    if count == 1:
        return (length,)
    return tuple(split_sequence(length, count, partition, multiple_of=multiple_of,
                                cost=cost if partition == "balanced" else None))


def cut_microbatches(lengths: Sequence[int], num_splits: int, partition: str, *,
                     segment_tokens: int | None = None, cost: CostModel | None = None,
                     multiple_of: int = 1) -> tuple[tuple[int, ...], ...]:
    """Segment lengths of every micro-batch (``uniform`` or ``balanced``; the documents
    partition cuts by documents, :func:`~megatron_seq1f1b.schedules.partition.split_documents`)."""
    return tuple(
        cut_microbatch(n, segment_count(n, num_splits, segment_tokens, multiple_of), partition,
                       cost, multiple_of)
        for n in lengths)


def length_problems(lengths: Sequence[int], multiple_of: int) -> list[str]:
    """Micro-batch lengths the layout cannot cut (named by micro-batch)."""
    problems = []
    for index, n in enumerate(lengths):
        if n < 1:
            problems.append(f"micro-batch {index} has {n} tokens")
        elif n % multiple_of:
            problems.append(
                f"micro-batch {index} has {n} tokens, not a multiple of {multiple_of} (sequence "
                "parallelism, context parallelism or FP8 need every length divisible by it; "
                "pad the micro-batch)")
    return problems


__all__ = ["segment_tokens_problems", "segment_count", "cut_microbatch", "cut_microbatches",
           "length_problems"]
