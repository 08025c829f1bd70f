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
Megatron-Core's 1F1B.

Interleaved Seq1F1B (``num_model_chunks == v > 1``) lives in
:mod:`megatron_seq1f1b.interleaved`.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

FORWARD = "F"
BACKWARD = "B"


class ScheduleError(ValueError):
    """A schedule (or its communication plan) is invalid; the message says where."""


class DeadlockError(ScheduleError):
    """No rank can make progress."""


class Action(NamedTuple):
    """Forward or backward of one (micro-batch, segment, model chunk) unit.

    A named tuple: hashing and comparison run in C, which the validator and
    simulator lean on (millions of lookups for large schedules).
    """

    kind: str
    microbatch: int
    segment: int
    chunk: int = 0

    @property
    def is_forward(self) -> bool:
        return self.kind == FORWARD

    @property
    def unit(self) -> tuple[int, int, int]:
        return (self.microbatch, self.segment, self.chunk)

    def __str__(self) -> str:
        text = f"{self.kind}{self.microbatch}.{self.segment}"
        return f"{text}c{self.chunk}" if self.chunk else text

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"F3.1"`` or ``"B0.2c1"``."""
        kind, rest = text[0], text[1:]
        if kind not in (FORWARD, BACKWARD):
            raise ValueError(f"not an action: {text!r}")
        chunk = 0
        if "c" in rest:
            rest, chunk_text = rest.split("c")
            chunk = int(chunk_text)
        microbatch, segment = (int(x) for x in rest.split("."))
        return cls(kind, microbatch, segment, chunk)


Schedule = list[list[Action]]


def F(microbatch: int, segment: int = 0, chunk: int = 0) -> Action:
    return Action(FORWARD, microbatch, segment, chunk)


def B(microbatch: int, segment: int = 0, chunk: int = 0) -> Action:
    return Action(BACKWARD, microbatch, segment, chunk)


def forward_units(num_microbatches: int, num_splits: int) -> list[tuple[int, int]]:
    """(micro-batch, segment) in forward order."""
    return [(mb, s) for mb in range(num_microbatches) for s in range(num_splits)]


def backward_units(num_microbatches: int, num_splits: int) -> list[tuple[int, int]]:
    """(micro-batch, segment) in backward order: micro-batches FIFO, segments LIFO."""
    return [(mb, s) for mb in range(num_microbatches) for s in reversed(range(num_splits))]


def warmup_forwards(num_stages: int, rank: int, num_microbatches: int, num_splits: int) -> int:
    """Forwards before the first backward on `rank` (non-interleaved)."""
    return min(num_stages - rank - 1 + num_splits - 1, num_microbatches * num_splits)


def _check_sizes(num_stages: int, num_microbatches: int, num_splits: int, num_model_chunks: int):
    for name, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_splits", num_splits),
        ("num_model_chunks", num_model_chunks),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def build_schedule(
    num_stages: int,
    num_microbatches: int,
    num_splits: int,
    num_model_chunks: int = 1,
    *,
    forward_only: bool = False,
) -> Schedule:
    """Per-rank action lists of Seq1F1B (interleaved when ``num_model_chunks > 1``)."""
    _check_sizes(num_stages, num_microbatches, num_splits, num_model_chunks)
    if num_model_chunks > 1:
        from megatron_seq1f1b.interleaved import build_interleaved_schedule

        return build_interleaved_schedule(
            num_stages, num_microbatches, num_splits, num_model_chunks, forward_only=forward_only
        )
    forwards = [F(mb, s) for mb, s in forward_units(num_microbatches, num_splits)]
    if forward_only:
        return [list(forwards) for _ in range(num_stages)]
    backwards = [B(mb, s) for mb, s in backward_units(num_microbatches, num_splits)]
    return [
        one_forward_one_backward(
            forwards, backwards, warmup_forwards(num_stages, rank, num_microbatches, num_splits)
        )
        for rank in range(num_stages)
    ]


def one_forward_one_backward(
    forwards: Sequence[Action], backwards: Sequence[Action], warmup: int
) -> list[Action]:
    """`warmup` forwards, then one forward and one backward in turn, then the rest backwards."""
    steady = len(forwards) - warmup
    actions = list(forwards[:warmup])
    for i in range(steady):
        actions += [forwards[warmup + i], backwards[i]]
    return actions + list(backwards[steady:])


def format_actions(actions: Iterable[Action]) -> str:
    return " ".join(str(a) for a in actions)


def format_schedule(schedule: Sequence[Sequence[Action]]) -> str:
    """One line per rank, e.g. ``rank 0: F0.0 F0.1 F1.0 B0.1 ...``."""
    width = len(str(len(schedule) - 1))
    return "\n".join(
        f"rank {rank:>{width}}: {format_actions(actions)}" for rank, actions in enumerate(schedule)
    )


def parse_schedule(text: str) -> Schedule:
    """Inverse of :func:`format_schedule`."""
    schedule = []
    for line in text.strip().splitlines():
        _, _, body = line.partition(":")
        schedule.append([Action.parse(tok) for tok in body.split()])
    return schedule


def schedule_shape(schedule: Sequence[Sequence[Action]]) -> tuple[int, int, int, int]:
    """(stages, micro-batches, splits, chunks) read off the actions."""
    actions = [a for rank in schedule for a in rank]
    if not actions:
        return len(schedule), 0, 0, 0
    return (
        len(schedule),
        1 + max(a.microbatch for a in actions),
        1 + max(a.segment for a in actions),
        1 + max(a.chunk for a in actions),
    )
