"""Replay every rank's steps together, with rendezvous point-to-point semantics.

A message moves once both of its ends have posted it; a step computes its
actions once what it waits for has moved. With costs this yields a timeline;
without progress it yields a deadlock report naming each blocked rank and what
it waits for. The validator and the simulator are both thin layers over
:func:`replay`.

When a step posts its operations and what its compute waits for is the
transport's, one of :data:`TIMINGS` (how the executor's transports map onto
them: :mod:`megatron_seq1f1b.runtime.p2p`, and docs/design.md):

* ``"rendezvous"``: a step posts its sends and receives when the rank reaches
  it and computes once all of them completed (``send_slack=0``; the
  validator's, NCCL's batch transport, Megatron's own schedules);
* ``"slack"``: the same posting, but the compute waits only for the step's
  receives and the previous step's sends (``send_slack=1``);
* ``"nccl"``: a step posts its sends and receives once the previous step's
  sends completed (the executor finishes them first, and NCCL's streams wait on
  the compute stream), and computes once its receives arrived;
* ``"gloo"``: a step posts its sends once the previous step's sends completed
  (the host waits for them), but its receives were posted at the start of the
  previous step's compute (``p2p.EarlyReceives``); it computes once they arrived.

In the last two a rank ends when its last sends completed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from megatron_seq1f1b.schedules.plan import Message, Step
from megatron_seq1f1b.schedules.schedule import Action, DeadlockError, ScheduleError

__all__ = ["ScheduleError", "DeadlockError", "Interval", "Timeline", "StepTimes", "TIMINGS",
           "timing_of", "replay", "replay_times", "action_costs", "index_messages",
           "message_partners"]

#: The replay's models of when a step posts and what its compute waits for (module doc).
TIMINGS = ("rendezvous", "slack", "nccl", "gloo")


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


def message_partners(steps: Sequence[Sequence[Step]]) -> tuple[list, list]:
    """Per rank and step, where its messages' other ends are: (for its receives the
    senders' (rank, step), for its sends the receivers'), in the step's order."""
    sent, received = index_messages(steps)
    senders = [[tuple(sent[m] for m in step.recvs) for step in rank] for rank in steps]
    receivers = [[tuple(received[m] for m in step.sends) for step in rank] for rank in steps]
    return senders, receivers


def timing_of(send_slack: int = 0, timing: str | None = None) -> str:
    """The timing model of a replay: ``timing`` if given, else ``send_slack``'s (0
    rendezvous, 1 slack)."""
    if timing is not None:
        if timing not in TIMINGS:
            raise ValueError(f"unknown timing {timing!r}; choose one of {TIMINGS}")
        if send_slack:
            raise ValueError(f"send_slack={send_slack} with timing={timing!r}: give one of them")
        return timing
    if send_slack not in (0, 1):
        raise ValueError(f"send_slack must be 0 or 1, got {send_slack!r}")
    return TIMINGS[send_slack]


@dataclass
class StepTimes:
    """Per rank and step, when the rank reached it (the previous step's end), posted its sends
    (``post``) and its receives (``recv_post``), and started its compute; ``end`` per rank:
    when it finished (its last compute, or its last sends where it waits for them)."""

    reach: list[list[float]]
    post: list[list[float]]
    recv_post: list[list[float]]
    start: list[list[float]]
    end: list[float]


def action_costs(steps: Sequence[Sequence[Step]], cost: CostFn | None = None
                 ) -> list[list[tuple[float, ...]]]:
    """Per rank and step, the cost of each of its actions (default 1 each)."""
    cost = cost or (lambda action, rank: 1.0)
    return [[tuple(cost(a, rank) for a in step.actions) for step in rank_steps]
            for rank, rank_steps in enumerate(steps)]


def replay_times(
    steps: Sequence[Sequence[Step]] | None,
    cost: CostFn | None = None,
    comm_latency: float = 0.0,
    send_slack: int = 0,
    timing: str | None = None,
    *,
    partners: tuple[list, list] | None = None,
    costs: Sequence[Sequence[Sequence[float]]] | None = None,
) -> StepTimes:
    """The times of every step under ``timing`` (module doc; or ``send_slack``'s); raise
    DeadlockError if the ranks get stuck. ``partners``: :func:`message_partners` of these
    steps (computed if not given); ``costs``: :func:`action_costs` (else from ``cost(action,
    rank)``, default 1 per action); with both, ``steps`` may be None."""
    model = timing_of(send_slack, timing)
    senders, receivers = partners or message_partners(steps)
    if costs is None:
        costs = action_costs(steps, cost)
    if steps is None:  # described by partners and costs alone (a steady-state replay)
        steps = [[None] * len(rank) for rank in senders]
    after_sends = model in ("nccl", "gloo")  # a step posts once the previous sends completed
    ahead = model == "gloo"  # receives posted at the start of the previous step's compute
    own_sends = model == "rendezvous"
    previous_sends = model == "slack"
    num_ranks = len(steps)
    sizes = [len(s) for s in steps]
    reach = [[0.0] * (n + 1) for n in sizes]
    post = [[0.0] * n for n in sizes]
    start = [[0.0] * n for n in sizes]
    posted = [0] * num_ranks  # steps whose post time is known
    started = [0] * num_ranks  # steps computed (start and end known)
    # What starting step i waits for at its receivers (rendezvous: its own sends; slack: the
    # previous step's, and the last step's own too)
    waited = receivers if own_sends else None
    if previous_sends:
        waited = [[(rank[i - 1] if i else ()) + (rank[i] if i == len(rank) - 1 else ())
                   for i in range(len(rank))] for rank in receivers]

    def recv_time(q: int, j: int) -> float:
        return start[q][j - 1] if ahead and j else post[q][j]

    remaining = sum(sizes)
    while remaining:
        progressed = False
        for r in range(num_ranks):
            n = sizes[r]
            i = started[r]
            if i == n:
                continue
            rank_senders, rank_receivers = senders[r], receivers[r]
            rank_post, rank_reach, rank_costs = post[r], reach[r], costs[r]
            rank_waited = waited[r] if waited is not None else None
            while i < n:
                if posted[r] == i:  # post step i
                    t = rank_reach[i]
                    if after_sends and i:
                        blocked = False
                        for q, j in rank_receivers[i - 1]:
                            if (started[q] < j) if ahead and j else (posted[q] <= j):
                                blocked = True
                                break
                            x = start[q][j - 1] if ahead and j else post[q][j]
                            if x > t:
                                t = x
                        if blocked:
                            break
                    rank_post[i] = t
                    posted[r] = i + 1
                    progressed = True
                # start step i once what it waits for has been posted
                t = rank_post[i]
                blocked = False
                for s, j in rank_senders[i]:
                    if posted[s] <= j:
                        blocked = True
                        break
                    x = post[s][j]
                    if x > t:
                        t = x
                if blocked:
                    break
                if rank_waited is not None:
                    for q, j in rank_waited[i]:
                        if posted[q] <= j:
                            blocked = True
                            break
                        x = post[q][j]
                        if x > t:
                            t = x
                    if blocked:
                        break
                if rank_senders[i] or rank_receivers[i]:
                    t += comm_latency
                start[r][i] = t
                for c in rank_costs[i]:
                    t += c
                i += 1
                rank_reach[i] = t
                started[r] = i
                remaining -= 1
                progressed = True
        if not progressed:
            if steps and any(step is None for rank in steps for step in rank):
                raise DeadlockError(f"deadlock: no rank can make progress (steps reached per "
                                    f"rank: {started})")
            raise DeadlockError(_deadlock_report(steps, started, *index_messages(steps)))
    end = [reach[r][sizes[r]] for r in range(num_ranks)]
    if after_sends:
        for r in range(num_ranks):
            if sizes[r]:
                last = sizes[r] - 1
                end[r] = max([end[r], post[r][last]]
                             + [recv_time(q, j) for q, j in receivers[r][last]])
    recv_post = [[recv_time(r, i) for i in range(sizes[r])] for r in range(num_ranks)]
    return StepTimes([row[:-1] for row in reach], post, recv_post, start, end)


def replay(
    steps: Sequence[Sequence[Step]],
    cost: CostFn | None = None,
    comm_latency: float = 0.0,
    send_slack: int = 0,
    timing: str | None = None,
) -> Timeline:
    """Run all ranks' steps; raise DeadlockError if stuck.

    ``timing`` (or ``send_slack``: 0 rendezvous, 1 slack) says when a step posts
    its operations and what its compute waits for (module doc); a plan that
    replays without deadlock under rendezvous also does under the others.
    ``comm_latency`` is added to the wait of every step that exchanges tensors.
    """
    costs = action_costs(steps, cost)
    times = replay_times(steps, comm_latency=comm_latency, send_slack=send_slack,
                         timing=timing, costs=costs)
    timeline = Timeline([[] for _ in steps], [[] for _ in steps])
    for rank, rank_steps in enumerate(steps):
        compute, waits = timeline.compute[rank], timeline.waits[rank]
        end = 0.0
        for i, step in enumerate(rank_steps):
            now, end = times.reach[rank][i], times.start[rank][i]
            if end > now:
                waits.append(Interval(rank, now, end, None, i))
            for action, c in zip(step.actions, costs[rank][i]):
                begin, end = end, end + c
                compute.append(Interval(rank, begin, end, action, i))
        if times.end[rank] > end:
            waits.append(Interval(rank, end, times.end[rank], None, len(rank_steps)))
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
