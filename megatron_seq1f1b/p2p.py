"""Post one step's sends and receives, wait, and name the culprit if that fails.

Ranks come from Megatron-Core's ``P2PCommunicator`` (the caller's, or one
built on the pipeline group). Receive buffers have the per-segment shapes the
plan knows in advance: no shape handshake, no ``variable_seq_lengths``.

All operations use the pipeline group, and a step's operations are always
posted together as one ``batch_isend_irecv`` group, whatever
``batch_p2p_comm`` says. That is the semantics the plan is validated under
(a step's transfers progress together; messages between two ranks match in
posting order, per direction, which the validator checks, also for pipeline
size 2 where activations and gradients share both directions). Posted one by
one, NCCL runs the operations between two ranks in posting order on one
stream, and a receive the plan posts early would block a send behind it:
a deadlock from pipeline size 3 on. Every operation is waited for before the
step's compute runs, so a sent output may be freed right after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


def exchange(
    step: Step,
    index: int,
    peers: Peers,
    outgoing: dict[Message, torch.Tensor],
    make_buffer: Callable[[Message], torch.Tensor],
) -> dict[Message, torch.Tensor]:
    """Run the step's communication; return the received tensors by message."""
    if not step.sends and not step.recvs:
        return {}
    ops = [dist.P2POp(dist.isend, outgoing.pop(msg), peers.stage_to_global[msg.dst], peers.group)
           for msg in step.sends]
    received = {msg: make_buffer(msg) for msg in step.recvs}
    ops += [dist.P2POp(dist.irecv, buffer, peers.stage_to_global[msg.src], peers.group)
            for msg, buffer in received.items()]
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    except Exception as exc:  # noqa: BLE001 - re-raised with where and what
        what = ", ".join(f"send {m}" for m in step.sends)
        what += (", " if what and step.recvs else "") + ", ".join(f"receive {m}" for m in step.recvs)
        raise PipelineCommError(
            f"Seq1F1B: rank {peers.global_rank} (pipeline stage {peers.pp_rank}) failed at "
            f"step {index} ({step.describe()}) to {what}: {exc}"
        ) from exc
    if peers.sync_after_batch and torch.cuda.is_available():
        torch.cuda.synchronize()
    return received
