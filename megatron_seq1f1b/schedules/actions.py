"""The vocabulary both schedule builders share: actions, their text form, errors.

An :class:`Action` is the forward or backward of one unit (micro-batch,
segment, model chunk); a schedule is one ordered list of actions per rank.
This module sits below :mod:`megatron_seq1f1b.schedules.schedule` and
:mod:`megatron_seq1f1b.schedules.interleaved` so that the two builders depend on it
and not on each other. Users import these names from
:mod:`megatron_seq1f1b.schedules.schedule`, which re-exports them.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"  # zero-bubble schedules: the weight-gradient half of a backward


class ScheduleError(ValueError):
    """A schedule (or its communication plan) is invalid; the message says where."""


class DeadlockError(ScheduleError):
    """No rank can make progress."""


class Action(NamedTuple):
    """Forward, backward or weight-gradient work of one (micro-batch, segment, chunk) unit.

    In schedules without ``W`` a ``B`` is the whole backward; with ``W`` (zero
    bubble) ``B`` computes only the gradients the previous stage waits for and
    ``W`` the weight gradients.

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
    def is_backward(self) -> bool:
        return self.kind == BACKWARD

    @property
    def is_weight(self) -> bool:
        return self.kind == WEIGHT

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
        """Inverse of ``str``: ``"F3.1"``, ``"B0.2c1"`` or ``"W0.2c1"``."""
        kind, rest = text[0], text[1:]
        if kind not in (FORWARD, BACKWARD, WEIGHT):
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


def W(microbatch: int, segment: int = 0, chunk: int = 0) -> Action:
    return Action(WEIGHT, microbatch, segment, chunk)


def splits_backward(schedule: Sequence[Sequence[Action]]) -> bool:
    """True if the schedule runs weight gradients as separate ``W`` actions."""
    return any(a.kind == WEIGHT for rank in schedule for a in rank)


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
