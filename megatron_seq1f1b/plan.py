"""Point-to-point messages implied by a schedule, grouped into steps.

Every rank runs a list of :class:`Step`: post one batch of sends and
receives, wait for all of them, then compute one action. The batch holds the
output of the previous action (activation to the next stage after a forward,
input gradient to the previous stage after a backward) and the input of the
next action. Posting each send together with the next receive is Megatron's
``send_forward_recv_backward`` / ``send_backward_recv_forward`` pattern: two
neighbours that both send first and receive later cannot block each other.

The executor runs exactly these steps; the validator replays them with
rendezvous semantics (a send completes only when the peer posted the matching
receive, as with NCCL), so a plan that validates cannot deadlock on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_seq1f1b.schedule import Action, schedule_shape

ACTIVATION = "act"
GRADIENT = "grad"


@dataclass(frozen=True)
class Message:
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
    """Post ``sends`` and ``recvs`` as one batch, wait, then run ``action`` (if any)."""

    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    action: Action | None


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
    """What `action` must receive before it runs (None on the pipeline's ends)."""
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
    """What `action` sends after it ran (None on the pipeline's ends)."""
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


def plan_rank(actions: Sequence[Action], rank: int, topo: Topology) -> list[Step]:
    steps = []
    pending: Message | None = None
    for action in actions:
        recv = input_message(action, rank, topo)
        steps.append(Step(_opt(pending), _opt(recv), action))
        pending = output_message(action, rank, topo)
    if pending is not None:
        steps.append(Step((pending,), (), None))
    return steps


def plan_steps(
    schedule: Sequence[Sequence[Action]], num_model_chunks: int | None = None
) -> list[list[Step]]:
    """Steps of every rank (pass `num_model_chunks` when a chunk may have no actions)."""
    num_stages, _, _, chunks = schedule_shape(schedule)
    topo = Topology(num_stages, num_model_chunks or max(chunks, 1))
    return [plan_rank(actions, rank, topo) for rank, actions in enumerate(schedule)]


def _opt(message: Message | None) -> tuple[Message, ...]:
    return () if message is None else (message,)
