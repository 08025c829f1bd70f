"""Replay every rank's steps together, with rendezvous point-to-point semantics.

A step's batch completes when every peer has posted the matching operation
(NCCL semantics: a send waits for its receiver); then the rank computes its
action. With costs this yields a timeline; without progress it yields a
deadlock report naming each blocked rank and what it waits for. The validator
and the simulator are both thin layers over :func:`replay`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from megatron_seq1f1b.schedules.plan import Message, Step
from megatron_seq1f1b.schedules.schedule import Action, DeadlockError, ScheduleError

__all__ = ["ScheduleError", "DeadlockError", "Interval", "Timeline", "replay", "index_messages"]


@dataclass(frozen=True)
class Interval:
    rank: int
    start: float
    end: float
    action: Action | None  # None for a communication wait
    step: int


@dataclass
class Timeline:
    """Compute intervals and communication waits of every rank."""

    compute: list[list[Interval]] = field(default_factory=list)
    waits: list[list[Interval]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        ends = [iv.end for rank in self.compute for iv in rank]
        ends += [iv.end for rank in self.waits for iv in rank]
        return max(ends, default=0.0)

    def scaled(self, factor: float) -> "Timeline":
        """The same timeline with every time multiplied by `factor` (a change of unit)."""
        def scale(rank):
            return [Interval(iv.rank, iv.start * factor, iv.end * factor, iv.action, iv.step)
                    for iv in rank]
        return Timeline([scale(r) for r in self.compute], [scale(r) for r in self.waits])


CostFn = Callable[[Action, int], float]


def _describe(step: Step | None) -> str:
    return "the end" if step is None else step.describe()


def index_messages(steps: Sequence[Sequence[Step]]) -> tuple[dict, dict]:
    """Where every message is sent and received: {message: (rank, step)}."""
    sent: dict[Message, tuple[int, int]] = {}
    received: dict[Message, tuple[int, int]] = {}
    for rank, rank_steps in enumerate(steps):
        for i, step in enumerate(rank_steps):
            for table, messages in ((sent, step.sends), (received, step.recvs)):
                for msg in messages:
                    if msg in table:
                        other = table[msg]
                        raise ScheduleError(
                            f"message {msg} appears twice (rank {other[0]} step {other[1]} and "
                            f"rank {rank} step {i})"
                        )
                    table[msg] = (rank, i)
    for msg, (rank, i) in received.items():
        if msg not in sent:
            raise ScheduleError(
                f"rank {rank} receives {msg} {_describe(steps[rank][i])}, but rank {msg.src} "
                "never sends it"
            )
    for msg, (rank, i) in sent.items():
        if msg not in received:
            raise ScheduleError(
                f"rank {rank} sends {msg} {_describe(steps[rank][i])}, but rank {msg.dst} "
                "never receives it"
            )
    return sent, received


def replay(
    steps: Sequence[Sequence[Step]],
    cost: CostFn | None = None,
    comm_latency: float = 0.0,
    send_slack: int = 0,
) -> Timeline:
    """Run all ranks' steps under rendezvous semantics; raise DeadlockError if stuck.

    ``send_slack=1`` times a runtime whose compute waits only for a step's
    receives and finishes the step's sends at the next step (where the
    transport lets it, see :mod:`megatron_seq1f1b.runtime.p2p`); a plan that replays
    without deadlock with ``send_slack=0`` also does with 1.
    """
    cost = cost or (lambda action, rank: 1.0)
    sent, received = index_messages(steps)
    num_ranks = len(steps)
    position = [0] * num_ranks
    arrival = [[0.0] for _ in range(num_ranks)]  # time each rank reached step i
    timeline = Timeline([[] for _ in range(num_ranks)], [[] for _ in range(num_ranks)])

    def counterpart(msg: Message, sending: bool) -> tuple[int, int]:
        return received[msg] if sending else sent[msg]

    def waited_for(rank: int, i: int):
        """(message, sending) pairs step i of `rank` waits for before its compute."""
        step = steps[rank][i]
        pairs = [(msg, False) for msg in step.recvs]
        owed = i if send_slack == 0 else i - send_slack
        if 0 <= owed:
            pairs += [(msg, True) for msg in steps[rank][owed].sends]
        if send_slack and i == len(steps[rank]) - 1:  # nothing left behind at the end
            pairs += [(msg, True) for j in range(max(owed + 1, 0), i + 1)
                      for msg in steps[rank][j].sends]
        return pairs

    def ready(rank: int) -> bool:
        for msg, sending in waited_for(rank, position[rank]):
            peer, peer_step = counterpart(msg, sending)
            if position[peer] < peer_step:
                return False
        return True

    remaining = sum(len(s) for s in steps)
    while remaining:
        progressed = False
        for rank in range(num_ranks):
            while position[rank] < len(steps[rank]) and ready(rank):
                i = position[rank]
                step = steps[rank][i]
                now = arrival[rank][i]
                done = now
                for msg, sending in waited_for(rank, i):
                    peer, peer_step = counterpart(msg, sending)
                    done = max(done, arrival[peer][peer_step])
                if step.sends or step.recvs:
                    done += comm_latency
                if done > now:
                    timeline.waits[rank].append(Interval(rank, now, done, None, i))
                end = done
                for action in step.actions:
                    start, end = end, end + cost(action, rank)
                    timeline.compute[rank].append(Interval(rank, start, end, action, i))
                arrival[rank].append(end)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise DeadlockError(_deadlock_report(steps, position, sent, received))
    return timeline


def _deadlock_report(steps, position, sent, received) -> str:
    lines = ["deadlock: no rank can make progress"]
    for rank, rank_steps in enumerate(steps):
        if position[rank] >= len(rank_steps):
            lines.append(f"  rank {rank}: finished")
            continue
        i = position[rank]
        step = rank_steps[i]
        waits = []
        for sending, messages in ((True, step.sends), (False, step.recvs)):
            for msg in messages:
                peer, peer_step = received[msg] if sending else sent[msg]
                if position[peer] < peer_step:
                    peer_at = rank_steps_desc(steps, peer, position[peer])
                    verb = "receive" if sending else "send"
                    waits.append(f"rank {peer} to {verb} {msg} (rank {peer} is {peer_at})")
        lines.append(f"  rank {rank} at step {i} ({_describe(step)}) waits for " + "; ".join(waits))
    return "\n".join(lines)


def rank_steps_desc(steps, rank: int, i: int) -> str:
    if i >= len(steps[rank]):
        return "finished"
    return f"at step {i}, {_describe(steps[rank][i])}"
