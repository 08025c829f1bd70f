"""Post one step's sends and receives, wait, and name the culprit if that fails.

Ranks come from Megatron-Core's ``P2PCommunicator`` (the caller's, or one
built on the pipeline group). Receive buffers have the per-segment shapes the
plan knows in advance: no shape handshake, no ``variable_seq_lengths``.

A step holds at most one send and one receive. With ``batch_p2p_comm`` (the
default) they are posted as one ``batch_isend_irecv`` group per process
group, the pattern that cannot deadlock between two neighbours on NCCL;
otherwise they are posted one by one in Megatron's order (even pipeline ranks
send first, odd ranks receive first). Activations and gradients travel on
separate process groups when both directions connect the same two ranks
(pipeline size 2 with model chunks), so their order on the wire never mixes.
Every operation is waited for before the step's compute runs, so a sent
output may be freed right after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_seq1f1b.plan import ACTIVATION, Message, Step


class PipelineCommError(RuntimeError):
    """A point-to-point transfer failed or timed out (deadlock or mismatch)."""


@dataclass
class Peers:
    """Global ranks and groups for this rank's pipeline links."""

    pp_rank: int
    pp_size: int
    global_rank: int
    stage_to_global: list[int]
    activation_group: object
    gradient_group: object
    batched: bool
    sync_after_batch: bool

    @classmethod
    def build(cls, p2p_communicator, config, separate_gradient_group: bool) -> "Peers":
        group = p2p_communicator.pp_group
        size, rank = group.size(), group.rank()
        stage_to_global = [dist.get_global_rank(group, r) for r in range(size)]
        gradient_group = dist.group.WORLD if separate_gradient_group else group
        return cls(
            pp_rank=rank,
            pp_size=size,
            global_rank=dist.get_rank(),
            stage_to_global=stage_to_global,
            activation_group=group,
            gradient_group=gradient_group,
            batched=bool(getattr(config, "batch_p2p_comm", True)),
            sync_after_batch=bool(getattr(config, "batch_p2p_sync", False)),
        )

    def group_for(self, message: Message):
        return self.activation_group if message.kind == ACTIVATION else self.gradient_group


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
    ops: list[tuple[str, torch.Tensor, int, object]] = []
    for msg in step.sends:
        ops.append(("send", outgoing.pop(msg), peers.stage_to_global[msg.dst], peers.group_for(msg)))
    received = {}
    for msg in step.recvs:
        buffer = make_buffer(msg)
        received[msg] = buffer
        ops.append(("recv", buffer, peers.stage_to_global[msg.src], peers.group_for(msg)))
    try:
        works = _post_batched(ops) if peers.batched else _post_ordered(ops, peers.pp_rank)
        for work in works:
            work.wait()
    except Exception as exc:  # noqa: BLE001 - re-raised with where and what
        what = ", ".join(f"send {m}" for m in step.sends)
        what += (", " if what and step.recvs else "") + ", ".join(f"receive {m}" for m in step.recvs)
        before = f"before {step.action}" if step.action is not None else "after the last action"
        raise PipelineCommError(
            f"Seq1F1B: rank {peers.global_rank} (pipeline stage {peers.pp_rank}) failed at "
            f"step {index} ({before}) to {what}: {exc}"
        ) from exc
    if peers.batched and peers.sync_after_batch and torch.cuda.is_available():
        torch.cuda.synchronize()
    return received


def _post_batched(ops):
    """One batch_isend_irecv per process group (all ops of a batch share a group)."""
    by_group: dict[int, tuple[object, list]] = {}
    for kind, tensor, peer, group in ops:
        fn = dist.isend if kind == "send" else dist.irecv
        by_group.setdefault(id(group), (group, []))[1].append(dist.P2POp(fn, tensor, peer, group))
    works = []
    for _, p2p_ops in by_group.values():
        works.extend(dist.batch_isend_irecv(p2p_ops))
    return works


def _post_ordered(ops, pp_rank: int):
    """Separate isend/irecv calls; even ranks send first, odd ranks receive first."""
    first = "send" if pp_rank % 2 == 0 else "recv"
    ordered = sorted(ops, key=lambda op: op[0] != first)
    works = []
    for kind, tensor, peer, group in ordered:
        fn = dist.isend if kind == "send" else dist.irecv
        works.append(fn(tensor, peer, group=group))
    return works
