"""Pipeline schedules as data: for every rank, the ordered list of compute actions.

A *unit* is one segment of one micro-batch on one model chunk. Schedules are
built by pure functions here; the same lists drive the executor, the
validator, the simulator and the pictures. Nothing here touches torch.

Non-interleaved Seq1F1B (``num_model_chunks == 1``): 1F1B over the ``m*k``
units. Forwards run in order ``(mb 0, seg 0), (mb 0, seg 1), ...``;
backwards run micro-batches first-in-first-out but the segments of one
micro-batch last-in-first-out, because later segments read the keys and
values of earlier ones and so produce gradient for them. Rank ``r`` of ``p``
warms up with ``min(p - r - 1 + k - 1, m*k)`` forwards: the last stage needs
``k - 1`` because its first backward (segment ``k-1`` of micro-batch 0) can
only start after that micro-batch's last forward. ``k == 1`` is exactly
Megatron-Core's 1F1B. Micro-batches may have different segment counts
(variable-length micro-batches): a rank then runs extra forwards before the
first backward of a micro-batch with more segments than the one before
(:mod:`megatron_seq1f1b.schedules.order`).

Interleaved Seq1F1B (``num_model_chunks == v > 1``) lives in
:mod:`megatron_seq1f1b.schedules.interleaved`; :func:`build_schedule` dispatches to it.
Both builders share :mod:`megatron_seq1f1b.schedules.actions` (``Action``, ``F``/``B``,
the text format, the errors), whose names are re-exported here: import them
from this module.
"""

from __future__ import annotations

from megatron_seq1f1b.schedules.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    B,
    DeadlockError,
    F,
    Schedule,
    ScheduleError,
    W,
    format_actions,
    format_schedule,
    one_forward_one_backward,  # noqa: F401 - re-exported
    parse_schedule,
    schedule_shape,
    splits_backward,
)
from megatron_seq1f1b.schedules.interleaved import ZB_H2_PROBLEM, interleaved_orders
from megatron_seq1f1b.schedules.interleaved import forwards_before_backwards as interleaved_before
from megatron_seq1f1b.schedules.order import (
    SegmentCounts,
    forward_needs,
    forwards_before,
    interleave,
    peak_in_flight,
    segment_counts,
    warmup_of,
)
from megatron_seq1f1b.schedules.zero_bubble import (
    VARIANTS,
    CostTable,
    build_zero_bubble,
    segment_cost_fn,
)

__all__ = [
    "FORWARD", "BACKWARD", "WEIGHT", "Action", "F", "B", "W", "Schedule", "ScheduleError",
    "DeadlockError", "format_actions", "format_schedule", "parse_schedule", "schedule_shape",
    "splits_backward",
    "one_forward_one_backward", "forward_units", "backward_units", "warmup_forwards",
    "build_schedule", "forward_backward_orders", "SCHEDULES",
]


def forward_units(num_microbatches: int, num_splits: SegmentCounts) -> list[tuple[int, int]]:
    """(micro-batch, segment) in forward order."""
    counts = segment_counts(num_microbatches, num_splits)
    return [(mb, s) for mb in range(num_microbatches) for s in range(counts[mb])]


def backward_units(num_microbatches: int, num_splits: SegmentCounts) -> list[tuple[int, int]]:
    """(micro-batch, segment) in backward order: micro-batches FIFO, segments LIFO."""
    counts = segment_counts(num_microbatches, num_splits)
    return [(mb, s) for mb in range(num_microbatches) for s in reversed(range(counts[mb]))]


def warmup_forwards(num_stages: int, rank: int, num_microbatches: int,
                    num_splits: SegmentCounts) -> int:
    """Forwards before the first backward on `rank` (non-interleaved)."""
    forwards, backwards = _orders(num_microbatches, num_splits)
    return warmup_of(forward_needs(forwards, backwards), num_stages - rank - 1, len(forwards))


def _orders(m: int, num_splits: SegmentCounts) -> tuple[list[Action], list[Action]]:
    return ([F(mb, s) for mb, s in forward_units(m, num_splits)],
            [B(mb, s) for mb, s in backward_units(m, num_splits)])


def _check_sizes(num_stages: int, num_microbatches: int, num_model_chunks: int):
    for name, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_model_chunks", num_model_chunks),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


SCHEDULES = ("1f1b",) + VARIANTS  # "1f1b": Seq1F1B itself; the others split B and W


def build_schedule(
    num_stages: int,
    num_microbatches: int,
    num_splits: SegmentCounts,
    num_model_chunks: int = 1,
    *,
    forward_only: bool = False,
    schedule: str = "1f1b",
    costs: CostTable | None = None,
) -> Schedule:
    """Per-rank action lists of Seq1F1B (interleaved when ``num_model_chunks > 1``).

    ``num_splits``: segments per micro-batch, one count for all or one per micro-batch
    (variable-length micro-batches; :mod:`megatron_seq1f1b.schedules.order` says how a rank
    orders them). ``schedule``: ``"1f1b"`` (Seq1F1B), or a zero-bubble variant
    (``"zb-h1"``, ``"zb-h2"``: see :mod:`megatron_seq1f1b.schedules.zero_bubble`) that keeps
    Seq1F1B's orders and adds ``W`` actions, placed for ``costs`` (F, B, W per segment, or
    per micro-batch and segment; default all equal). Forward-only schedules are the same
    for all.
    """
    _check_sizes(num_stages, num_microbatches, num_model_chunks)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    if forward_only:
        p, m, v = num_stages, num_microbatches, num_model_chunks
        counts = segment_counts(m, num_splits)
        forwards = interleaved_orders(p, m, counts, v)[0] if v > 1 else _orders(m, counts)[0]
        return [list(forwards) for _ in range(p)]
    orders, cap = forward_backward_orders(num_stages, num_microbatches, num_splits,
                                          num_model_chunks, schedule)
    if schedule == "1f1b":
        return orders
    cost = segment_cost_fn(costs) if costs is not None else None
    return build_zero_bubble(orders, [cap] * num_stages, num_model_chunks, cost)


def forward_backward_orders(num_stages: int, num_microbatches: int,
                            num_splits: SegmentCounts, num_model_chunks: int = 1,
                            schedule: str = "1f1b") -> tuple[Schedule, int]:
    """Every rank's forwards and backwards in ``schedule``'s order, before any ``W`` is
    placed (Seq1F1B's schedule itself for ``"1f1b"``), and how many units a zero-bubble
    variant lets each rank hold (the first stage's most in flight)."""
    _check_sizes(num_stages, num_microbatches, num_model_chunks)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    if schedule == "zb-h2" and num_model_chunks > 1:
        raise ValueError(ZB_H2_PROBLEM)
    p, m, v = num_stages, num_microbatches, num_model_chunks
    counts = segment_counts(m, num_splits)
    extra = 1 if schedule == "zb-h2" else 0  # ZB-H2: p-r-1 more forwards ahead on rank r
    if v > 1:
        forwards, backwards = interleaved_orders(p, m, counts, v)
        before = interleaved_before(p, m, counts, v, lead_extra=extra)
    else:
        forwards, backwards = _orders(m, counts)
        needs = forward_needs(forwards, backwards)
        before = [forwards_before(needs, (p - rank - 1) * (1 + extra), len(forwards))
                  for rank in range(p)]
    orders = [interleave(forwards, backwards, rank_before) for rank_before in before]
    # Every rank may hold as many units as the first stage (zero_bubble's docstring).
    return orders, peak_in_flight(before[0])
