"""Post one step's sends and receives, wait, and name the culprit if that fails.

Ranks come from Megatron-Core's ``P2PCommunicator`` (the caller's, or one
built on the pipeline group). Receive buffers have the per-segment shapes the
plan knows in advance: no shape handshake, no ``variable_seq_lengths``.

All operations use the pipeline group, and a step's operations are always
posted together as one ``batch_isend_irecv`` group, whatever
``batch_p2p_comm`` says. Where the transport returns a work per operation
(gloo), the step waits only for its receives and its sends are finished at
the next step (:class:`InFlight`; the validator's ``send_slack=1``). That is the semantics the plan is validated under
(a step's transfers progress together; messages between two ranks match in
posting order, per direction, which the validator checks, also for pipeline
size 2 where activations and gradients share both directions). Posted one by
one, NCCL runs the operations between two ranks in posting order on one
stream, and a receive the plan posts early would block a send behind it:
a deadlock from pipeline size 3 on. A sent output is freed only once its send
has completed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_seq1f1b.plan import Message, Step


class PipelineCommError(RuntimeError):
    """A point-to-point transfer failed or timed out (deadlock or mismatch)."""


@dataclass
class Peers:
    """Global ranks and groups for this rank's pipeline links."""

    pp_rank: int
    pp_size: int
    global_rank: int
    stage_to_global: list[int]
    group: object
    sync_after_batch: bool

    @classmethod
    def build(cls, p2p_communicator, config) -> "Peers":
        group = p2p_communicator.pp_group
        size, rank = group.size(), group.rank()
        return cls(
            pp_rank=rank,
            pp_size=size,
            global_rank=dist.get_rank(),
            stage_to_global=[dist.get_global_rank(group, r) for r in range(size)],
            group=group,
            sync_after_batch=bool(getattr(config, "batch_p2p_sync", False)),
        )


class InFlight:
    """A step's sends, finished at the next exchange instead of before the step's compute.

    With transports that return one work per operation (gloo), a rank then
    computes while its neighbour is still busy and receives later, instead of
    idling until the neighbour reaches its step (rendezvous); zero-bubble
    schedules, whose ranks run actions of uneven length, depend on it.
    ``release`` is called for each tensor once its send has completed (the
    executor frees sent activations then, not earlier). Coalesced transports
    (NCCL's batched p2p gives one work for the whole step) keep the rendezvous:
    there the step waits for everything, as before.
    """

    def __init__(self, release: Callable[[torch.Tensor], None] | None = None):
        self._release = release or (lambda tensor: None)
        self._works: list = []
        self._sent: list[torch.Tensor] = []  # kept alive until their sends completed
        self._tensors: list[torch.Tensor] = []
        self._where = ""

    def hold(self, works: list, sent: list[torch.Tensor], release: Sequence[torch.Tensor],
             where: str) -> None:
        self._works, self._sent, self._tensors = list(works), list(sent), list(release)
        self._where = where

    def holds(self, tensor: torch.Tensor) -> bool:
        """True if `tensor` waits for a held send before it may be released."""
        return any(t is tensor for t in self._tensors)

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors:
            self._release(tensor)

    def finish(self, peers: "Peers") -> None:
        """Wait for the held sends; name the step and messages if one failed."""
        works, tensors, where = self._works, self._tensors, self._where
        self._works, self._sent, self._tensors = [], [], []
        try:
            for work in works:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with where and what
            raise PipelineCommError(
                f"Seq1F1B: rank {peers.global_rank} (pipeline stage {peers.pp_rank}) failed to "
                f"complete {where}: {exc}"
            ) from exc
        self.release(tensors)


def exchange(
    step: Step,
    index: int,
    peers: Peers,
    outgoing: dict[Message, torch.Tensor],
    make_buffer: Callable[[Message], torch.Tensor],
    in_flight: InFlight | None = None,
    release_after_send: Sequence[torch.Tensor] = (),
) -> dict[Message, torch.Tensor]:
    """Run the step's communication; return the received tensors by message.

    Finishes the previous step's sends (``in_flight``) first. The step's own
    sends are left in ``in_flight`` when the transport allows it; then
    ``release_after_send`` is released once they complete.
    """
    in_flight = in_flight or InFlight()
    in_flight.finish(peers)
    if not step.sends and not step.recvs:
        in_flight.release(release_after_send)
        return {}
    sent = [outgoing.pop(msg) for msg in step.sends]
    ops = [dist.P2POp(dist.isend, tensor, peers.stage_to_global[msg.dst], peers.group)
           for msg, tensor in zip(step.sends, sent)]
    received = {msg: make_buffer(msg) for msg in step.recvs}
    ops += [dist.P2POp(dist.irecv, buffer, peers.stage_to_global[msg.src], peers.group)
            for msg, buffer in received.items()]
    what = ", ".join(f"send {m}" for m in step.sends)
    what += (", " if what and step.recvs else "") + ", ".join(f"receive {m}" for m in step.recvs)
    stages = sorted({m.dst for m in step.sends} | {m.src for m in step.recvs})
    what += " (peer " + ", ".join(
        f"stage {s} = global rank {peers.stage_to_global[s]}" for s in stages) + ")"
    where = f"step {index} ({step.describe()}): {what}"
    try:
        works = dist.batch_isend_irecv(ops)
        per_operation = len(works) == len(ops)
        waited = works[len(step.sends):] if per_operation else works
        for work in waited:
            work.wait()
    except Exception as exc:  # noqa: BLE001 - re-raised with where and what
        raise PipelineCommError(
            f"Seq1F1B: rank {peers.global_rank} (pipeline stage {peers.pp_rank}) failed at "
            f"step {index} ({step.describe()}) to {what}: {exc}"
        ) from exc
    if per_operation:
        in_flight.hold(works[:len(step.sends)], sent, release_after_send, f"the sends of {where}")
    else:
        in_flight.release(release_after_send)
    if peers.sync_after_batch and torch.cuda.is_available():
        torch.cuda.synchronize()
    return received
