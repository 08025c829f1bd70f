"""Post one step's sends and receives, wait for what the step needs, name the culprit on failure.

Ranks come from Megatron-Core's ``P2PCommunicator`` (the caller's, or one
built on the pipeline group). Receive buffers have the per-segment shapes the
plan knows in advance: no shape handshake, no ``variable_seq_lengths``.

A step waits only for its receives; its sends finish at the next step
(:class:`InFlight`; ``replay``'s ``send_slack=1``), so a rank computes while
its neighbour has not yet taken what it sent. Two transports give that:

* **Links** (NCCL): every direction of every pipeline link (stage ``a`` to
  stage ``b``) has a process group of its own, so its operations run on a
  communicator, and a stream, of their own; operations are posted one by one,
  each with its own work, in one order of links both ends agree on
  (:func:`link_order`). On one link one side only sends and the other only
  receives, in the same order (the validator checks it), so a receive posted
  early can never sit in front of a send its peer waits for, the trap of
  posting one by one on one pipeline group (NCCL runs a pair's operations in
  posting order on one stream). The groups are made once per pipeline group,
  by every rank of the world in one global order (:func:`link_groups`), with
  the pipeline group's timeout, and their communicators started in that order
  too (NCCL starts one by a blocking handshake of both sides).
* **Batch** (gloo, or ``SEQ1F1B_P2P=batch``): a step's operations are posted
  together as one ``batch_isend_irecv`` on the pipeline group, whatever
  ``batch_p2p_comm`` says (transfers progress together, the semantics the
  plan is validated under). Gloo returns one work per operation, so the step
  again waits for its receives only; NCCL returns one work for the whole batch,
  and the step then waits for everything (as Megatron's own schedules do),
  which the planner models with ``send_slack=0``.

On gloo a step also posts the next step's receives before its compute
(:class:`EarlyReceives`): gloo moves a message only once both ends have posted it, by a
thread of each process, so a receive posted late waits for the sender's thread to get
its busy core back (0.4 ms typical, several ms at worst, per message on two busy CPU
ranks); posted a step ahead, the transfer happens during the receiver's compute. On a
link one side only receives, in the order both ends agree on, so posting receives
earlier, still in that order, matches the same messages. NCCL's transports do not post
ahead: its receives are stream work the host does not wait for, and on one pipeline group
(the batch transport) an early receive would sit in front of the next step's sends.

A sent output is freed only once its send has completed. Nothing here formats
text unless something failed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_seq1f1b.schedules.plan import Message, Step

#: Environment variable that forces the batch transport on NCCL (``SEQ1F1B_P2P=batch``).
TRANSPORT_ENV = "SEQ1F1B_P2P"
LINKS, BATCH = "links", "batch"


class PipelineCommError(RuntimeError):
    """A point-to-point transfer failed or timed out (deadlock or mismatch)."""


@dataclass
class Peers:
    """Global ranks and groups for this rank's pipeline links.

    ``links``: the process group of each direction ``(src stage, dst stage)``
    (the links transport), or None (one batch per step on ``group``).
    """

    pp_rank: int
    pp_size: int
    global_rank: int
    stage_to_global: list[int]
    group: object
    sync_after_batch: bool
    links: dict[tuple[int, int], object] | None = None
    stand_in: bool = False  # a rehearsal: receives are made up, sends dropped (no group)
    early_receives: bool = False  # post the next step's receives ahead (gloo: EarlyReceives)

    @classmethod
    def build(cls, p2p_communicator, config, wraparound: bool = False) -> "Peers":
        group = p2p_communicator.pp_group
        size, rank = group.size(), group.rank()
        stage_to_global = [dist.get_global_rank(group, r) for r in range(size)]
        links = None
        if size > 1 and transport(group) == LINKS:
            links = link_groups(stage_to_global, wraparound, group)
        return cls(
            pp_rank=rank,
            pp_size=size,
            global_rank=dist.get_rank(),
            stage_to_global=stage_to_global,
            group=group,
            sync_after_batch=bool(getattr(config, "batch_p2p_sync", False)),
            links=links,
            early_receives=size > 1 and links is None and not _coalesces(group),
        )

    @classmethod
    def stand_ins(cls, num_stages: int, stage: int) -> "Peers":
        """Stage ``stage`` of a ``num_stages`` pipeline, rehearsed alone on this rank: every
        receive gets a made-up tensor of its shape and dtype, every send is dropped
        (:mod:`megatron_seq1f1b.planner.rehearse`)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(pp_rank=stage, pp_size=num_stages, global_rank=rank,
                   stage_to_global=[rank] * num_stages, group=None, sync_after_batch=False,
                   stand_in=True)


def transport(group) -> str:
    """``links`` on NCCL (unless ``SEQ1F1B_P2P=batch``), ``batch`` elsewhere."""
    wanted = os.environ.get(TRANSPORT_ENV, "").strip().lower()
    if wanted not in ("", LINKS, BATCH):
        raise ValueError(f"{TRANSPORT_ENV}={wanted!r}: use {LINKS!r} or {BATCH!r}")
    if wanted:
        return wanted
    return LINKS if _coalesces(group) else BATCH


def _coalesces(group) -> bool:
    """True where ``batch_isend_irecv`` returns one work for the whole batch (NCCL)."""
    try:
        return dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError, AttributeError):  # stand-in groups in tests
        return False


def replay_timing(group) -> str:
    """How the executor's transport on this pipeline group posts and waits, as the replay's
    timing (:data:`~megatron_seq1f1b.schedules.replay.TIMINGS`; docs/design.md): ``"nccl"``
    for the links transport (a step posts once the previous step's sends completed),
    ``"gloo"`` for the batch transport with a work per operation (receives posted a step
    ahead), ``"rendezvous"`` where one work covers the step (NCCL's batch: it waits for its
    sends too)."""
    if group is None or group.size() < 2:
        return "rendezvous"  # no messages: every timing is the same
    if transport(group) == LINKS:
        return "nccl"
    return "rendezvous" if _coalesces(group) else "gloo"


# ------------------------------------------------------------------ link groups

_LINK_GROUPS: dict[tuple, dict[tuple[int, int], object]] = {}


def pipeline_links(num_stages: int, wraparound: bool) -> list[tuple[int, int]]:
    """Both directions of every link of a pipeline, in a fixed order.

    Neighbouring stages, and with model chunks the wrap-around link between
    the last and the first stage (the same link as stage 1 -> 0 when there are two).
    """
    links = []
    for stage in range(num_stages - 1):
        links += [(stage, stage + 1), (stage + 1, stage)]
    if wraparound and num_stages > 2:
        links += [(num_stages - 1, 0), (0, num_stages - 1)]
    return links


def link_groups(stage_to_global: Sequence[int], wraparound: bool,
                pipeline_group=None) -> dict[tuple[int, int], object]:
    """This pipeline's process group per link direction; made once, collectively.

    ``new_group`` must be entered by every rank of the world in the same
    order, so the first call gathers every rank's pipeline (and whether it
    needs the wrap-around link) and every rank creates all pipelines' link
    groups in one sorted order; then each rank starts its own links'
    communicators in that order with a one-element message (both sides of a
    link start it together; the global order keeps those handshakes from
    waiting on each other in a cycle). Later calls return the cached groups
    (made again if they were destroyed). The groups take ``pipeline_group``'s
    timeout (without one: the backend's default).
    """
    key = (tuple(stage_to_global), bool(wraparound))
    cached = _LINK_GROUPS.get(key)
    if cached is not None and all(_alive(group) for group in cached.values()):
        return cached
    if cached is not None:  # the process groups were destroyed (e.g. an in-process restart)
        _LINK_GROUPS.clear()
    timeout = group_timeout(pipeline_group) if pipeline_group is not None else None
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, key)
    pipelines = {}
    for ranks, wrap in everyone:
        pipelines[ranks] = pipelines.get(ranks, False) or wrap
    me = dist.get_rank()
    created: dict[tuple, dict[tuple[int, int], object]] = {}
    mine_in_order = []
    for ranks in sorted(pipelines):
        groups = created.setdefault((ranks, pipelines[ranks]), {})
        for src, dst in pipeline_links(len(ranks), pipelines[ranks]):
            group = dist.new_group(ranks=[ranks[src], ranks[dst]], timeout=timeout)
            if me in (ranks[src], ranks[dst]):
                groups[(src, dst)] = group
                mine_in_order.append((ranks[src], ranks[dst], group))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    token = torch.zeros(1, device=device)
    for src, dst, group in mine_in_order:
        if me == src:
            dist.send(token, dst, group=group)
        else:
            dist.recv(token, src, group=group)
    _LINK_GROUPS[key] = created[(key[0], pipelines[key[0]])]
    return _LINK_GROUPS[key]


def _alive(group) -> bool:
    """Whether a process group is still registered (not destroyed)."""
    try:
        return group in dist.distributed_c10d._world.pg_map
    except AttributeError:  # a torch without this registry: trust the cache
        return True


def group_timeout(group):
    """The timeout ``group`` was made with (link groups inherit the pipeline group's, e.g.
    Megatron-LM's ``--distributed-timeout-minutes``), or None (the backend's default)."""
    try:
        backend = group._get_backend(torch.device("cuda" if torch.cuda.is_available()
                                                  else "cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def destroy_link_groups() -> None:
    """Forget (and destroy) the link groups, e.g. before ``destroy_process_group``."""
    seen = set()
    for groups in _LINK_GROUPS.values():
        for group in groups.values():
            if id(group) not in seen:
                seen.add(id(group))
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError):
                    pass
    _LINK_GROUPS.clear()


# ------------------------------------------------------------------ exchanging


def _describe(step: Step, index: int, peers: Peers) -> str:
    """The step and its messages, for error messages only."""
    what = ", ".join(f"send {m}" for m in step.sends)
    what += (", " if what and step.recvs else "") + ", ".join(f"receive {m}" for m in step.recvs)
    stages = sorted({m.dst for m in step.sends} | {m.src for m in step.recvs})
    what += " (peer " + ", ".join(
        f"stage {s} = global rank {peers.stage_to_global[s]}" for s in stages) + ")"
    return f"step {index} ({step.describe()}): {what}"


class InFlight:
    """A step's sends, finished at the next exchange instead of before the step's compute.

    A rank then computes while its neighbour is still busy and receives later,
    instead of idling until the neighbour reaches its step (rendezvous);
    zero-bubble schedules, whose ranks run actions of uneven length, depend on
    it. ``release`` is called for each tensor once its send has completed (the
    executor frees sent activations then, not earlier). Where the transport
    gives one work for a whole step (NCCL batch) the step waited for it already.
    """

    def __init__(self, release: Callable[[torch.Tensor], None] | None = None):
        self._release = release or (lambda tensor: None)
        self._works: list = []
        self._sent: list[torch.Tensor] = []  # kept alive until their sends completed
        self._tensors: list[torch.Tensor] = []
        self._step: Step | None = None
        self._index = -1

    def hold(self, works: list, sent: list[torch.Tensor], release: Sequence[torch.Tensor],
             step: Step, index: int) -> None:
        self._works, self._sent, self._tensors = works, sent, list(release)
        self._step, self._index = step, index

    def holds(self, tensor: torch.Tensor) -> bool:
        """True if `tensor` waits for a held send before it may be released."""
        return any(t is tensor for t in self._tensors)

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors:
            self._release(tensor)

    def finish(self, peers: "Peers") -> None:
        """Wait for the held sends; name the step and messages if one failed."""
        if not self._works and not self._tensors:
            return
        works, tensors, step, index = self._works, self._tensors, self._step, self._index
        self._works, self._sent, self._tensors, self._step = [], [], [], None
        try:
            for work in works:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with where and what
            raise PipelineCommError(
                f"Seq1F1B: rank {peers.global_rank} (pipeline stage {peers.pp_rank}) failed to "
                f"complete the sends of {_describe(step, index, peers)}: {exc}"
            ) from exc
        self.release(tensors)


def link_order(msg: Message) -> tuple[int, int, int]:
    """Where a message's operation goes among its step's, the same on both of its ranks:
    links between lower stages first (one direction, then the other).

    A hedge for the links transport: CUDA does not promise that NCCL kernels on different
    streams progress together. Were a GPU to run a rank's transfers one at a time in
    posting order, two neighbours posting in one agreed order of links still meet, where
    each posting its sends first would wait for the other (Megatron's own one-by-one path
    orders by stage parity for the same reason).
    """
    return (min(msg.src, msg.dst), max(msg.src, msg.dst), msg.src)


class EarlyReceives:
    """The next step's receives, posted before this step's compute (gloo; module docstring).

    Holds each posted message's buffer and work until its step takes them; a step's
    receives are posted only after the previous step's, so every link keeps its order.
    """

    def __init__(self):
        self._index = -1
        self._buffers: dict[Message, torch.Tensor] = {}
        self._works: list = []

    def post(self, step: Step, index: int, peers: Peers,
             make_buffer: Callable[[Message], torch.Tensor]) -> None:
        """Post step ``index``'s receives now."""
        buffers = {msg: make_buffer(msg) for msg in step.recvs}
        _, works = _post(step, peers, [], buffers)
        self._index, self._buffers, self._works = index, buffers, works

    def take(self, index: int) -> tuple[dict[Message, torch.Tensor], list]:
        """Step ``index``'s posted receives: (buffers by message, works); empty if none."""
        if index != self._index:
            return {}, []
        taken = self._buffers, self._works
        self._index, self._buffers, self._works = -1, {}, []
        return taken


def _post(step: Step, peers: Peers, sent: list[torch.Tensor],
          received: dict[Message, torch.Tensor]) -> tuple[list, list]:
    """Post the step's operations; (send works, receive works). With one work for the
    whole batch (NCCL batch transport) it counts as a receive work: the step waits for it."""
    if not sent and not received:
        return [], []
    ranks = peers.stage_to_global
    if peers.links is not None:
        links = peers.links
        operations = [(msg, tensor, True) for msg, tensor in zip(step.sends, sent)]
        operations += [(msg, buffer, False) for msg, buffer in received.items()]
        if len(operations) > 1:
            operations.sort(key=lambda op: link_order(op[0]))  # stable: a link keeps its order
        sends, recvs = [], []
        for msg, tensor, is_send in operations:
            group = links[(msg.src, msg.dst)]
            if is_send:
                sends.append(dist.isend(tensor, ranks[msg.dst], group=group))
            else:
                recvs.append(dist.irecv(tensor, ranks[msg.src], group=group))
        return sends, recvs
    ops = [dist.P2POp(dist.isend, tensor, ranks[msg.dst], peers.group)
           for msg, tensor in zip(step.sends, sent)]
    ops += [dist.P2POp(dist.irecv, buffer, ranks[msg.src], peers.group)
            for msg, buffer in received.items()]
    works = dist.batch_isend_irecv(ops)
    if len(works) == len(ops):
        return works[:len(sent)], works[len(sent):]
    return [], works


def exchange(
    step: Step,
    index: int,
    peers: Peers,
    outgoing: dict[Message, torch.Tensor],
    make_buffer: Callable[[Message], torch.Tensor],
    in_flight: InFlight | None = None,
    release_after_send: Sequence[torch.Tensor] = (),
    early: EarlyReceives | None = None,
    next_step: Step | None = None,
) -> dict[Message, torch.Tensor]:
    """Run the step's communication; return the received tensors by message.

    Finishes the previous step's sends (``in_flight``) first. The step's own
    sends are left in ``in_flight`` where the transport allows it; then
    ``release_after_send`` is released once they complete. With ``early`` (where
    ``peers.early_receives``) the receives it posted for this step are taken from it,
    and ``next_step``'s are posted into it before returning.
    """
    in_flight = in_flight or InFlight()
    in_flight.finish(peers)
    if not peers.stand_in and not step.sends and not step.recvs:
        in_flight.release(release_after_send)
        _post_ahead(early, peers, next_step, index + 1, make_buffer)
        return {}
    if peers.stand_in:
        for msg in step.sends:
            outgoing.pop(msg)
        in_flight.release(release_after_send)
        received = {msg: make_buffer(msg) for msg in step.recvs}
        with torch.no_grad():
            for buffer in received.values():
                buffer.normal_()
        return received
    sent = [outgoing.pop(msg) for msg in step.sends]
    posted, early_works = early.take(index) if early is not None else ({}, [])
    fresh = {msg: make_buffer(msg) for msg in step.recvs if msg not in posted}
    received = {msg: posted[msg] if msg in posted else fresh[msg] for msg in step.recvs}
    try:
        send_works, recv_works = _post(step, peers, sent, fresh)
        for work in early_works + recv_works:
            work.wait()
    except Exception as exc:  # noqa: BLE001 - re-raised with where and what
        raise PipelineCommError(
            f"Seq1F1B: rank {peers.global_rank} (pipeline stage {peers.pp_rank}) failed at "
            f"{_describe(step, index, peers)}: {exc}"
        ) from exc
    _post_ahead(early, peers, next_step, index + 1, make_buffer)
    if send_works:
        in_flight.hold(send_works, sent, release_after_send, step, index)
    else:
        in_flight.release(release_after_send)
    if peers.sync_after_batch and peers.links is None and torch.cuda.is_available():
        torch.cuda.synchronize()  # Megatron's batch_p2p_sync, for batched NCCL p2p only
    return received


def _post_ahead(early: EarlyReceives | None, peers: Peers, step: Step | None, index: int,
                make_buffer: Callable[[Message], torch.Tensor]) -> None:
    """Post step ``index``'s receives into ``early`` where the transport takes them ahead."""
    if early is None or not peers.early_receives or step is None or not step.recvs:
        return
    try:
        early.post(step, index, peers, make_buffer)
    except Exception as exc:  # noqa: BLE001 - re-raised with where and what
        raise PipelineCommError(
            f"Seq1F1B: rank {peers.global_rank} (pipeline stage {peers.pp_rank}) failed to "
            f"post the receives of {_describe(step, index, peers)} ahead: {exc}") from exc
