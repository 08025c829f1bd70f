"""Check a schedule before anything runs: completeness, order, messages, deadlock.

Rules, each reported with the rank and the action that breaks it:

* every rank runs the forward (and, unless forward-only, the backward) of
  every (micro-batch, segment, chunk) unit exactly once;
* on a rank, the segments of a micro-batch are forwarded in order (segment j
  reads the keys/values of segments < j) and backwarded in reverse order
  (segment j's backward produces gradient for the keys/values of < j);
  a unit's forward precedes its backward;
* zero-bubble schedules: either no unit or every unit has a weight-gradient
  action ``W``, once per rank, after its ``B``, and a rank runs its ``W`` in
  the order of its ``B`` (the runtime and Transformer Engine's delayed
  weight gradients are first-in-first-out);
* on every link the receiver posts its receives in the order the sender
  posts the sends (transports match messages in order, not by name);
* replaying all ranks with rendezvous semantics finishes (no deadlock).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

from megatron_seq1f1b.schedules.order import SegmentCounts, counts_of, segment_counts
from megatron_seq1f1b.schedules.plan import Message, Step, plan_steps
from megatron_seq1f1b.schedules.replay import ScheduleError, replay_times
from megatron_seq1f1b.schedules.schedule import Action, schedule_shape, splits_backward

__all__ = ["ScheduleError", "validate", "check_units", "check_link_order"]


def check_units(
    schedule: Sequence[Sequence[Action]],
    num_microbatches: int,
    num_splits: SegmentCounts,
    num_model_chunks: int,
    forward_only: bool = False,
) -> None:
    """Every unit once per rank, in the orders the module docstring gives (``num_splits``:
    one count, or one per micro-batch)."""
    counts = segment_counts(num_microbatches, num_splits)
    expected = {
        (mb, s, c)
        for mb in range(num_microbatches)
        for s in range(counts[mb])
        for c in range(num_model_chunks)
    }
    split = splits_backward(schedule)
    for rank, actions in enumerate(schedule):
        forwarded: set = set()
        backwarded: set = set()
        last_forward_seg: dict = defaultdict(lambda: -1)
        last_backward_seg: dict = {}
        backward_order: list = []
        weighted: list = []
        for position, action in enumerate(actions):
            here = (rank, position, action)  # named only in an error
            unit = action.unit
            if unit not in expected:
                raise ScheduleError(f"{_at(*here)}: unit outside m={num_microbatches}, "
                                    f"k={counts[action.microbatch] if action.microbatch < num_microbatches else '?'}, "
                                    f"v={num_model_chunks}")
            key = (action.microbatch, action.chunk)
            if action.is_forward:
                if unit in forwarded:
                    raise ScheduleError(f"{_at(*here)}: forwarded twice")
                if action.segment != last_forward_seg[key] + 1:
                    raise ScheduleError(
                        f"{_at(*here)}: segment {action.segment} forwarded before segment "
                        f"{last_forward_seg[key] + 1} of the same micro-batch and chunk"
                    )
                last_forward_seg[key] = action.segment
                forwarded.add(unit)
            elif action.is_backward:
                if forward_only:
                    raise ScheduleError(f"{_at(*here)}: backward in a forward-only schedule")
                if unit not in forwarded:
                    raise ScheduleError(f"{_at(*here)}: backward before its forward")
                if unit in backwarded:
                    raise ScheduleError(f"{_at(*here)}: backwarded twice")
                want = last_backward_seg.get(key, counts[action.microbatch]) - 1
                if action.segment != want:
                    raise ScheduleError(
                        f"{_at(*here)}: segments must be backwarded in reverse order; expected "
                        f"segment {want}"
                    )
                last_backward_seg[key] = action.segment
                backwarded.add(unit)
                backward_order.append(unit)
            else:
                if forward_only:
                    raise ScheduleError(
                        f"{_at(*here)}: weight gradients in a forward-only schedule")
                if unit not in backwarded:
                    raise ScheduleError(
                        f"{_at(*here)}: weight gradients before the unit's backward")
                if len(weighted) == len(backward_order) or backward_order[len(weighted)] != unit:
                    raise ScheduleError(
                        f"{_at(*here)}: weight gradients must follow the order of the backwards "
                        f"(next: {backward_order[len(weighted)] if len(weighted) < len(backward_order) else 'none pending'})"
                    )
                weighted.append(unit)
        if forwarded != expected:
            missing = sorted(expected - forwarded)[:3]
            raise ScheduleError(f"rank {rank}: forwards missing for units {missing} ...")
        if not forward_only and backwarded != expected:
            missing = sorted(expected - backwarded)[:3]
            raise ScheduleError(f"rank {rank}: backwards missing for units {missing} ...")
        if split and len(weighted) != len(expected):
            missing = sorted(expected - set(weighted))[:3]
            raise ScheduleError(f"rank {rank}: weight gradients (W) missing for units {missing} ...")


def _at(rank: int, position: int, action: Action) -> str:
    """How an error names an action (made only for the error: check_units visits every
    action of every plan the planner times)."""
    return f"rank {rank}, action {position} ({action})"


def check_link_order(
    steps: Sequence[Sequence[Step]],
    channel: Callable[[Message], tuple] = lambda m: (m.src, m.dst),
) -> None:
    """Senders and receivers agree on the message order between every pair of ranks.

    Activations and gradients share the link (one process group), so with
    pipeline size 2 and model chunks both kinds interleave on it.
    """
    sends: dict = defaultdict(list)
    recvs: dict = defaultdict(list)
    for rank_steps in steps:
        for step in rank_steps:
            for msg in step.sends:
                sends[channel(msg)].append(msg)
            for msg in step.recvs:
                recvs[channel(msg)].append(msg)
    for key in set(sends) | set(recvs):
        sent, got = sends.get(key, []), recvs.get(key, [])
        for i, (a, b) in enumerate(zip(sent, got)):
            if a != b:
                raise ScheduleError(
                    f"link {key}: message #{i} is sent as [{a}] but received as [{b}]; "
                    "transports match in order, so the data would land in the wrong unit"
                )
        if len(sent) != len(got):
            raise ScheduleError(f"link {key}: {len(sent)} sends but {len(got)} receives")


def validate(
    schedule: Sequence[Sequence[Action]],
    num_microbatches: int | None = None,
    num_splits: SegmentCounts | None = None,
    num_model_chunks: int | None = None,
    *,
    forward_only: bool = False,
) -> list[list[Step]]:
    """Raise :class:`ScheduleError` on the first broken rule; return the step plan.

    Sizes default to what the actions show (segments per micro-batch included)."""
    _, m, _, v = schedule_shape(schedule)
    m, v = num_microbatches or m, num_model_chunks or v
    k = num_splits if num_splits is not None else (counts_of(schedule) + (1,) * m)[:m]
    check_units(schedule, m, k, v, forward_only)
    steps = plan_steps(schedule, v)
    check_link_order(steps)
    replay_times(steps)  # a deadlock raises; the times themselves are not needed
    return steps
