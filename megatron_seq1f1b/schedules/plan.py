"""Point-to-point messages implied by a schedule, grouped into steps.

Every rank runs a list of :class:`Step`: post one batch of sends and
receives, wait for all of them, then compute the step's actions (a *slot*).

* Slots. Non-interleaved schedules compute one action per slot (Megatron's
  1F1B pattern). Interleaved schedules pair each steady-state forward with
  the backward after it (Megatron's interleaved pattern): all ranks then
  alternate "compute F and B, exchange once", which keeps neighbours in phase.
* Sends go out in the step after the slot that produced them.
* Receives are posted in the receiver's first step that starts at or after
  the sender posts, read off a dataflow timing of the schedule (forward 1,
  backward 2 per unit), and never later than the step of the slot that
  consumes them (a step waits for its receives before its compute). Usually
  that is the consumer's own step; on the wrap-around link of interleaved
  schedules (last stage, chunk c -> first stage, chunk c+1) the receiver
  posts earlier and keeps the tensor until its slot comes, as Megatron does.

The executor runs exactly these steps; the validator replays them with
rendezvous semantics (a send completes only when the peer posted the matching
receive, as with NCCL), so a plan that validates cannot deadlock on GPUs.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from megatron_seq1f1b.schedules.actions import BACKWARD, FORWARD
from megatron_seq1f1b.schedules.order import counts_of
from megatron_seq1f1b.schedules.schedule import Action, DeadlockError, schedule_shape, splits_backward

ACTIVATION = "act"
GRADIENT = "grad"


class Message(NamedTuple):
    """One tensor between two ranks, named by the unit that consumes it."""

    kind: str  # ACTIVATION (forward direction) or GRADIENT (backward direction)
    microbatch: int
    segment: int
    chunk: int  # model chunk of the receiving unit
    src: int
    dst: int

    def __str__(self) -> str:
        unit = f"{self.microbatch}.{self.segment}" + (f"c{self.chunk}" if self.chunk else "")
        return f"{self.kind} {unit} {self.src}->{self.dst}"


@dataclass(frozen=True)
class Step:
    """Post ``sends`` and ``recvs`` as one batch, wait, then run ``actions`` in order."""

    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    actions: tuple[Action, ...]

    def describe(self) -> str:
        if not self.actions:
            return "final sends"
        return "before " + " ".join(str(a) for a in self.actions)


@dataclass(frozen=True)
class Topology:
    num_stages: int
    num_model_chunks: int

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.num_stages + rank

    @property
    def last_virtual_stage(self) -> int:
        return self.num_stages * self.num_model_chunks - 1

    def locate(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) holding a virtual stage."""
        return virtual_stage % self.num_stages, virtual_stage // self.num_stages


def input_message(action: Action, rank: int, topo: Topology) -> Message | None:
    """What `action` must receive before it runs (None on the pipeline's ends, and for W)."""
    if action.is_weight:
        return None
    stage = topo.virtual_stage(rank, action.chunk)
    if action.is_forward:
        if stage == 0:
            return None
        src, _ = topo.locate(stage - 1)
        return Message(ACTIVATION, action.microbatch, action.segment, action.chunk, src, rank)
    if stage == topo.last_virtual_stage:
        return None
    src, _ = topo.locate(stage + 1)
    return Message(GRADIENT, action.microbatch, action.segment, action.chunk, src, rank)


def output_message(action: Action, rank: int, topo: Topology) -> Message | None:
    """What `action` sends after it ran (None on the pipeline's ends, and for W)."""
    if action.is_weight:
        return None
    stage = topo.virtual_stage(rank, action.chunk)
    if action.is_forward:
        if stage == topo.last_virtual_stage:
            return None
        dst, chunk = topo.locate(stage + 1)
        return Message(ACTIVATION, action.microbatch, action.segment, chunk, rank, dst)
    if stage == 0:
        return None
    dst, chunk = topo.locate(stage - 1)
    return Message(GRADIENT, action.microbatch, action.segment, chunk, rank, dst)


Slot = tuple[Action, ...]


def slots_of(actions: Sequence[Action], warmup: int | None = None,
             unpaired: frozenset = frozenset()) -> list[Slot]:
    """Cut a rank's actions into slots.

    With ``warmup=None`` every action is its own slot. Otherwise the first
    ``warmup`` forwards are single slots and each later forward is paired
    with the backward right after it (steady state), unless that backward is in
    ``unpaired``; the rest are single.
    """
    if warmup is None:
        return [(a,) for a in actions]
    slots, i, forwards = [], 0, 0
    while i < len(actions):
        action = actions[i]
        if (action.is_forward and forwards >= warmup and i + 1 < len(actions)
                and actions[i + 1].is_backward and actions[i + 1] not in unpaired):
            slots.append((action, actions[i + 1]))
            i += 2
        else:
            slots.append((action,))
            i += 1
        forwards += action.is_forward
    return slots


def _unit_cost(action: Action) -> float:
    """Forward 1, whole backward 2."""
    return 1.0 if action.is_forward else 2.0


def _split_unit_cost(action: Action) -> float:
    """Zero-bubble schedules: forward, input-gradient and weight-gradient work 1 each."""
    return 1.0


def _slot_messages(slots, topo):
    """Inputs and outputs of every slot, computed once (what :func:`input_message` and
    :func:`output_message` give, inlined: this is the plan's hot spot)."""
    num_stages, last = topo.num_stages, topo.last_virtual_stage
    new = tuple.__new__
    inputs, outputs = [], []
    for rank, rank_slots in enumerate(slots):
        rank_inputs, rank_outputs = [], []
        for slot in rank_slots:
            needed, made = [], []
            for kind, microbatch, segment, chunk in slot:
                stage = chunk * num_stages + rank
                if kind == FORWARD:
                    if stage:
                        needed.append(new(Message, (ACTIVATION, microbatch, segment, chunk,
                                                    (stage - 1) % num_stages, rank)))
                    if stage < last:
                        made.append(new(Message, (ACTIVATION, microbatch, segment,
                                                  (stage + 1) // num_stages, rank,
                                                  (stage + 1) % num_stages)))
                elif kind == BACKWARD:
                    if stage < last:
                        needed.append(new(Message, (GRADIENT, microbatch, segment, chunk,
                                                    (stage + 1) % num_stages, rank)))
                    if stage:
                        made.append(new(Message, (GRADIENT, microbatch, segment,
                                                  (stage - 1) // num_stages, rank,
                                                  (stage - 1) % num_stages)))
            rank_inputs.append(needed)
            rank_outputs.append(made)
        inputs.append(rank_inputs)
        outputs.append(rank_outputs)
    return inputs, outputs


def dataflow_timing(
    slots: Sequence[Sequence[Slot]], topo: Topology, cost: Callable[[Action], float] = _unit_cost,
    messages: tuple | None = None,
) -> tuple[list[list[float]], dict[Message, float]]:
    """Start time of every slot and send time of every message, if sends never wait.

    ``messages``: the slots' (inputs, outputs) where the caller has them already.
    Raises DeadlockError if the compute order itself cannot finish (a slot
    waits for a message that is only produced after it).
    """
    inputs, outputs = messages if messages is not None else _slot_messages(slots, topo)
    produced: dict[Message, float] = {}
    starts: list[list[float]] = [[] for _ in slots]
    durations = [[cost(slot[0]) if len(slot) == 1 else sum(cost(a) for a in slot)
                  for slot in rank_slots] for rank_slots in slots]
    clock = [0.0] * len(slots)
    position = [0] * len(slots)
    remaining = sum(len(s) for s in slots)
    while remaining:
        progressed = False
        for rank, rank_slots in enumerate(slots):
            t, n = position[rank], len(rank_slots)
            rank_inputs, rank_outputs = inputs[rank], outputs[rank]
            rank_durations, rank_starts = durations[rank], starts[rank]
            now = clock[rank]
            while t < n:  # run the rank's slots until one waits for an unsent message
                start = now
                for message in rank_inputs[t]:
                    sent = produced.get(message)
                    if sent is None:
                        break
                    if sent > start:
                        start = sent
                else:  # every input sent: the slot runs
                    now = start + rank_durations[t]
                    for message in rank_outputs[t]:
                        produced[message] = now
                    rank_starts.append(start)
                    t += 1
                    continue
                break
            if t != position[rank]:
                remaining -= t - position[rank]
                progressed = True
                position[rank], clock[rank] = t, now
        if not progressed:
            raise DeadlockError(_stuck_report(slots, position, produced, topo))
    return starts, produced


def _stuck_report(slots, position, produced, topo) -> str:
    lines = ["deadlock: the compute order cannot finish"]
    for rank, rank_slots in enumerate(slots):
        if position[rank] >= len(rank_slots):
            lines.append(f"  rank {rank}: finished")
            continue
        slot = rank_slots[position[rank]]
        missing = [m for m in (input_message(a, rank, topo) for a in slot) if m and m not in produced]
        where = " ".join(str(a) for a in slot)
        lines.append(f"  rank {rank} before {where} waits for rank {missing[0].src} to send "
                     f"{missing[0]}" if missing else f"  rank {rank} before {where}")
    return "\n".join(lines)


def plan_slots(slots: Sequence[Sequence[Slot]], topo: Topology,
               cost: Callable[[Action], float] = _unit_cost) -> list[list[Step]]:
    """Steps of every rank for the given slots (see the module docstring)."""
    inputs, outputs = _slot_messages(slots, topo)  # made once: the plan's hot spot
    starts, produced = dataflow_timing(slots, topo, cost, (inputs, outputs))
    consumer: dict[Message, int] = {msg: t for rank in inputs
                                    for t, needed in enumerate(rank) for msg in needed}
    recvs: list[dict[int, list[Message]]] = [{} for _ in slots]  # per rank: step -> receives
    # In send-time order, so every link's receives stay in its sends' order.
    for msg, sent_at in _keyed(produced):
        dst = msg[5]
        step = bisect.bisect_left(starts[dst], sent_at)
        last = consumer[msg]
        if last < step:
            step = last
        at = recvs[dst].get(step)
        if at is None:
            recvs[dst][step] = [msg]
        else:
            at.append(msg)
    steps = []
    for rank, rank_slots in enumerate(slots):
        rank_steps, pending = [], ()
        rank_recvs, rank_outputs = recvs[rank], outputs[rank]
        for t, slot in enumerate(rank_slots):
            rank_steps.append(Step(pending, tuple(rank_recvs.get(t, ())), slot))
            pending = tuple(rank_outputs[t])
        if pending:
            rank_steps.append(Step(pending, (), ()))
        steps.append(rank_steps)
    return steps


def _keyed(produced: dict[Message, float]):
    """(message, time) pairs in time order, ties broken the same way in every process."""
    return sorted(produced.items(), key=_time_then_message)


_time_then_message = operator.itemgetter(1, 0)


def plan_steps(
    schedule: Sequence[Sequence[Action]],
    num_model_chunks: int | None = None,
    warmups: Sequence[int] | None = None,
    cost: Callable[[Action, int], float] | None = None,
) -> list[list[Step]]:
    """Steps of every rank. Interleaved schedules pair steady-state (F, B) slots.

    ``warmups`` (forwards before the steady state, per rank) default to the
    interleaved builder's when there are several model chunks. ``cost``
    (action, rank) -> time places the receives; default F 1 and B 2, or
    F = B = W = 1 when W is split off. The plan is deadlock-free for any
    positive costs only as far as the validator's replay says: validate it.
    """
    num_stages, _, _, chunks = schedule_shape(schedule)
    topo = Topology(num_stages, num_model_chunks or max(chunks, 1))
    split = splits_backward(schedule)
    unpaired = None
    if warmups is None and topo.num_model_chunks > 1 and not split:
        from megatron_seq1f1b.schedules import interleaved

        has_backward = any(a.is_backward for rank in schedule for a in rank)
        if has_backward:
            counts = counts_of(schedule)
            warmups = interleaved.warmups(num_stages, len(counts), counts, topo.num_model_chunks)
            unpaired = interleaved.unpaired_backwards(num_stages, len(counts), counts,
                                                      topo.num_model_chunks)
    if unpaired is None:
        unpaired = [frozenset()] * num_stages
    slots = [slots_of(actions, None if warmups is None else warmups[rank], unpaired[rank])
             for rank, actions in enumerate(schedule)]
    if cost is None:
        slot_cost = _split_unit_cost if split else _unit_cost
    else:
        slot_cost = lambda action: cost(action, 0)  # noqa: E731 - the same on every rank
    return plan_slots(slots, topo, slot_cost)


__all__ = [
    "ACTIVATION", "GRADIENT", "Message", "Step", "Topology", "input_message", "output_message",
    "slots_of", "dataflow_timing", "plan_slots", "plan_steps",
]
