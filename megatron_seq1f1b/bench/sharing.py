"""Replay a schedule as it runs on real hardware: p2p latency, and ranks sharing CPU cores.

:func:`megatron_seq1f1b.schedules.simulate.simulate` gives every rank its own device
and free messages. On the development machine neither holds: every step
that exchanges tensors pays a message time, and with more ranks than cores
ranks that compute at once slow each other down while a rank in a bubble
hands its core to the busy ones. :func:`pipeline_replay` models both.
"""

from __future__ import annotations

from typing import Sequence

from megatron_seq1f1b.schedules.plan import plan_steps
from megatron_seq1f1b.schedules.replay import Interval, Timeline, index_messages
from megatron_seq1f1b.schedules.schedule import Action, schedule_shape
from megatron_seq1f1b.schedules.simulate import CostFn, SimResult, peak_inflight


def pipeline_replay(schedule: Sequence[Sequence[Action]], cost: CostFn,
                    cores: float | None = None, latency: float = 0.0) -> SimResult:
    """Replay with rendezvous p2p (as :func:`megatron_seq1f1b.schedules.replay.replay`), plus two effects.

    * ``latency``: a step that exchanges tensors starts computing ``latency``
      seconds after the last peer arrived (the replay's ``comm_latency``).
    * ``cores``: processor sharing. While n ranks compute at once, each
      progresses at ``min(1, cores / n)`` of its isolated speed (one thread per
      rank); models oversubscribed CPUs, where overlapping compute slows down
      and bubbles hand their core to the busy ranks. None: one device per rank.

    With neither, this is the plain replay that :func:`simulate` runs.
    """
    _, _, _, chunks = schedule_shape(schedule)
    steps = plan_steps(schedule, chunks)
    sent, received = index_messages(steps)
    n = len(steps)
    position = [0] * n
    queue: list[list] = [[] for _ in range(n)]  # [action, remaining, start] of the current step
    start_at = [0.0] * n  # compute of the current step may begin then (after p2p latency)
    timeline = Timeline([[] for _ in range(n)], [[] for _ in range(n)])
    waiting_since = [0.0] * n
    now = 0.0

    def ready(rank: int) -> bool:
        step = steps[rank][position[rank]]
        for table, messages in ((received, step.sends), (sent, step.recvs)):
            for msg in messages:
                peer, peer_step = table[msg]
                if position[peer] < peer_step:
                    return False
        return True

    while True:
        progressed = True
        while progressed:
            progressed = False
            for rank in range(n):
                if queue[rank] or position[rank] >= len(steps[rank]) or not ready(rank):
                    continue
                step = steps[rank][position[rank]]
                comm = bool(step.sends or step.recvs)
                if step.actions:
                    queue[rank] = [[a, cost(a, rank), None] for a in step.actions]
                    start_at[rank] = now + (latency if comm else 0.0)
                    if comm and start_at[rank] > waiting_since[rank]:
                        timeline.waits[rank].append(Interval(
                            rank, waiting_since[rank], start_at[rank], None, position[rank]))
                else:
                    position[rank] += 1
                    waiting_since[rank] = now
                progressed = True
        pending = [r for r in range(n) if queue[r]]
        if not pending:
            if any(position[r] < len(steps[r]) for r in range(n)):
                raise RuntimeError("pipeline_replay: deadlock")
            break
        active = [r for r in pending if start_at[r] <= now + 1e-15]
        rate = 1.0 if cores is None else min(1.0, cores / max(len(active), 1))
        for r in active:
            if queue[r][0][2] is None:
                queue[r][0][2] = now
        candidates = [queue[r][0][1] / rate for r in active]
        candidates += [start_at[r] - now for r in pending if r not in active]
        dt = max(min(candidates), 0.0)
        now += dt
        for r in active:
            head = queue[r][0]
            head[1] -= dt * rate
            if head[1] <= 1e-12:
                timeline.compute[r].append(Interval(r, head[2], now, head[0], position[r]))
                queue[r].pop(0)
                if not queue[r]:
                    position[r] += 1
                    waiting_since[r] = now
    makespan = timeline.makespan
    busy = [sum(iv.end - iv.start for iv in rank) for rank in timeline.compute]
    total_busy = sum(iv.end - iv.start for rank in timeline.compute for iv in rank)
    bubble = 1.0 - total_busy / (makespan * n) if makespan else 0.0
    return SimResult(makespan, busy, bubble, [peak_inflight(a) for a in schedule], timeline)
