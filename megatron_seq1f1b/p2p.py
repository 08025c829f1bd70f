"""Post one step's sends and receives, wait, and name the culprit if that fails.

Ranks come from Megatron-Core's ``P2PCommunicator`` (the caller's, or one
built on the pipeline group). Receive buffers have the per-segment shapes the
plan knows in advance: no shape handshake, no ``variable_seq_lengths``.

All operations use the pipeline group. With ``batch_p2p_comm`` (the
default) a step's operations are posted as one ``batch_isend_irecv`` group,
the pattern that cannot deadlock between two neighbours on NCCL; otherwise
they are posted one by one in Megatron's order (even pipeline ranks send
first, odd ranks receive first). Messages between two ranks are matched in
posting order; the plan guarantees both sides post them in the same order
(checked by the validator, also for pipeline size 2 where activations and
gradients share both directions). Every operation is waited for before the
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
    batched: bool
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
            batched=bool(getattr(config, "batch_p2p_comm", True)),
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
    ops: list[tuple[str, Message, torch.Tensor, int, object]] = []
    for msg in step.sends:
        peer = peers.stage_to_global[msg.dst]
        ops.append(("send", msg, outgoing.pop(msg), peer, peers.group))
    received = {}
    for msg in step.recvs:
        buffer = make_buffer(msg)
        received[msg] = buffer
        ops.append(("recv", msg, buffer, peers.stage_to_global[msg.src], peers.group))
    try:
        works = _post_batched(ops) if peers.batched else _post_ordered(ops, peers.pp_rank)
        for work in works:
            work.wait()
    except Exception as exc:  # noqa: BLE001 - re-raised with where and what
        what = ", ".join(f"send {m}" for m in step.sends)
        what += (", " if what and step.recvs else "") + ", ".join(f"receive {m}" for m in step.recvs)
        raise PipelineCommError(
            f"Seq1F1B: rank {peers.global_rank} (pipeline stage {peers.pp_rank}) failed at "
            f"step {index} ({step.describe()}) to {what}: {exc}"
        ) from exc
    if peers.batched and peers.sync_after_batch and torch.cuda.is_available():
        torch.cuda.synchronize()
    return received


def _post_batched(ops):
    """One batch_isend_irecv for the whole step."""
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group)
        for kind, _, tensor, peer, group in ops
    ])


def _post_ordered(ops, pp_rank: int):
    """Separate isend/irecv calls: even ranks send first, odd ranks receive first.

    Megatron's principle for unbatched p2p (two neighbours never both wait in
    a send); within sends and within receives the plan's order is kept,
    since messages between two ranks are matched in posting order.
    """
    first = "send" if pp_rank % 2 == 0 else "recv"
    ordered = [op for op in ops if op[0] == first] + [op for op in ops if op[0] != first]
    return [
        (dist.isend if kind == "send" else dist.irecv)(tensor, peer, group=group)
        for kind, _, tensor, peer, group in ordered
    ]
