"""p2p.exchange posts a step as one batch, whatever batch_p2p_comm says.

Posted one by one, NCCL would run the operations between two ranks in
posting order on one stream, and a receive posted early could block a send
behind it (pipeline size >= 3). Gloo does not show that, so the multi-rank
tests cannot catch a regression; this one looks at what is posted.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_seq1f1b.runtime.p2p import Peers, PipelineCommError, exchange
from megatron_seq1f1b.schedules.plan import ACTIVATION, GRADIENT, Message, Step
from megatron_seq1f1b.schedules.schedule import F


class _Op:
    """Stands in for dist.P2POp, which needs an initialised process group."""

    def __init__(self, op, tensor, peer, group):
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group


class _Done:
    def wait(self):
        return True


class _Failed:
    def wait(self):
        raise RuntimeError("timed out")


def _peers() -> Peers:
    return Peers(pp_rank=1, pp_size=3, global_rank=11, stage_to_global=[10, 11, 12],
                 group=None, sync_after_batch=False)


def _step() -> Step:
    act_out = Message(ACTIVATION, 1, 0, 0, 1, 2)
    grad_in = Message(GRADIENT, 0, 1, 0, 2, 1)
    return Step(sends=(act_out,), recvs=(grad_in,), actions=(F(2, 0),))


def test_step_is_posted_as_one_batch(monkeypatch):
    batches = []
    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: batches.append(ops) or [_Done()])
    # (a direct dist.isend/irecv would fail: no process group exists in this test)
    step = _step()
    sent = torch.ones(2, 1, 4)
    received = exchange(step, 7, _peers(), {step.sends[0]: sent}, lambda m: torch.zeros(2, 1, 4))

    assert len(batches) == 1
    (send, recv) = batches[0]
    assert send.op is dist.isend and send.tensor is sent and send.peer == 12
    assert recv.op is dist.irecv and recv.tensor is received[step.recvs[0]] and recv.peer == 12
    assert set(received) == set(step.recvs)


def test_failure_names_rank_step_and_messages(monkeypatch):
    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [_Failed()])
    step = _step()
    with pytest.raises(PipelineCommError) as error:
        exchange(step, 7, _peers(), {step.sends[0]: torch.ones(1)}, lambda m: torch.zeros(1))
    text = str(error.value)
    assert "rank 11 (pipeline stage 1)" in text and "step 7" in text
    assert "send act 1.0 1->2" in text and "receive grad 0.1 2->1" in text


class _Pending:
    """A send that completes only when waited for; records the order of events."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"wait {self.name}")


def test_sends_finish_at_the_next_step_where_each_operation_has_a_work(monkeypatch):
    """gloo: the step waits for its receive only; the send (and freeing the sent output)
    completes at the next exchange. A coalesced batch (one work) is waited whole."""
    from megatron_seq1f1b.runtime.p2p import InFlight

    log = []
    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv",
                        lambda ops: [_Pending(log, f"{op.op.__name__}") for op in ops])
    freed = []
    in_flight = InFlight(lambda tensor: freed.append(tensor))
    step = _step()
    sent = torch.ones(2, 1, 4)
    exchange(step, 7, _peers(), {step.sends[0]: sent}, lambda m: torch.zeros(2, 1, 4),
             in_flight, [sent])
    assert log == ["wait irecv"] and freed == [] and in_flight.holds(sent)
    exchange(Step((), (), (F(3, 0),)), 8, _peers(), {}, lambda m: None, in_flight)
    assert log == ["wait irecv", "wait isend"] and freed == [sent]

    log.clear()
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [_Pending(log, "batch")])
    exchange(step, 9, _peers(), {step.sends[0]: sent}, lambda m: torch.zeros(2, 1, 4),
             in_flight, [sent])
    assert log == ["wait batch"] and freed == [sent, sent] and not in_flight.holds(sent)


def test_a_held_send_that_fails_names_its_step(monkeypatch):
    from megatron_seq1f1b.runtime.p2p import InFlight

    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [_Failed(), _Done()])
    in_flight = InFlight()
    step = _step()
    exchange(step, 7, _peers(), {step.sends[0]: torch.ones(1)}, lambda m: torch.zeros(1),
             in_flight)
    with pytest.raises(PipelineCommError, match="rank 11 .*the sends of step 7 .*act 1.0 1->2"):
        in_flight.finish(_peers())


def test_pipeline_links_cover_both_directions_and_the_wraparound():
    from megatron_seq1f1b.runtime.p2p import pipeline_links

    assert pipeline_links(2, False) == [(0, 1), (1, 0)]
    assert pipeline_links(2, True) == [(0, 1), (1, 0)]  # the wrap-around link is the same one
    assert pipeline_links(3, False) == [(0, 1), (1, 0), (1, 2), (2, 1)]
    assert pipeline_links(3, True)[-2:] == [(2, 0), (0, 2)]
    assert pipeline_links(1, True) == []


def test_links_transport_posts_each_operation_on_its_link_and_waits_for_receives_only(
        monkeypatch):
    """NCCL's transport: one group per link direction, operations one by one; the send is
    held until the next step (send slack 1), the receive waited for at once."""
    from megatron_seq1f1b.runtime import p2p
    from megatron_seq1f1b.runtime.p2p import InFlight

    log, posted = [], []
    monkeypatch.setattr(dist, "isend", lambda t, dst, group: posted.append(("send", dst, group))
                        or _Pending(log, "isend"))
    monkeypatch.setattr(dist, "irecv", lambda t, src, group: posted.append(("recv", src, group))
                        or _Pending(log, "irecv"))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: pytest.fail("batched"))
    peers = _peers()
    peers.links = {(1, 2): "g12", (2, 1): "g21"}
    monkeypatch.delenv(p2p.TRANSPORT_ENV, raising=False)
    in_flight = InFlight()
    step = _step()
    exchange(step, 7, peers, {step.sends[0]: torch.ones(1)}, lambda m: torch.zeros(1), in_flight)
    assert posted == [("send", 12, "g12"), ("recv", 12, "g21")]
    assert log == ["wait irecv"]
    in_flight.finish(peers)
    assert log == ["wait irecv", "wait isend"]


def test_transport_choice(monkeypatch):
    from megatron_seq1f1b.runtime import p2p

    monkeypatch.setattr(dist, "get_backend", lambda group: group)
    monkeypatch.delenv(p2p.TRANSPORT_ENV, raising=False)
    assert p2p.transport("nccl") == p2p.LINKS and p2p.transport("gloo") == p2p.BATCH
    monkeypatch.setenv(p2p.TRANSPORT_ENV, "batch")
    assert p2p.transport("nccl") == p2p.BATCH
    monkeypatch.setenv(p2p.TRANSPORT_ENV, "bogus")
    with pytest.raises(ValueError, match="SEQ1F1B_P2P"):
        p2p.transport("nccl")


def test_each_transport_is_timed_as_it_posts(monkeypatch):
    """The planner's replay timing of a pipeline group (docs/design.md): NCCL's links post a
    step once the previous sends completed ("nccl"), gloo posts receives a step ahead
    ("gloo"), NCCL's batch waits for its whole step ("rendezvous")."""
    from megatron_seq1f1b.runtime import p2p

    class Group(str):
        def size(self):
            return 2

    monkeypatch.setattr(dist, "get_backend", lambda group: str(group))
    monkeypatch.delenv(p2p.TRANSPORT_ENV, raising=False)
    assert p2p.replay_timing(Group("nccl")) == "nccl"
    assert p2p.replay_timing(Group("gloo")) == "gloo"
    monkeypatch.setenv(p2p.TRANSPORT_ENV, "batch")
    assert p2p.replay_timing(Group("nccl")) == "rendezvous"
    assert p2p.replay_timing(None) == "rendezvous"


def _next_step() -> Step:
    """Rank 1's step after ``_step``: receives an activation from stage 0 and a gradient."""
    act_in = Message(ACTIVATION, 3, 0, 0, 0, 1)
    grad_in = Message(GRADIENT, 0, 2, 0, 2, 1)
    return Step(sends=(), recvs=(act_in, grad_in), actions=(F(3, 0),))


def test_gloo_posts_the_next_steps_receives_before_the_compute(monkeypatch):
    """gloo (``early_receives``): after its own receives, a step posts the next step's (in
    that step's order), which then posts no receive of its own, waits for those and hands
    over their buffers; its sends are posted as before."""
    from megatron_seq1f1b.runtime.p2p import EarlyReceives

    log, batches = [], []
    monkeypatch.setattr(dist, "P2POp", _Op)

    def batch(ops):
        batches.append([(op.op.__name__, op.peer) for op in ops])
        return [_Pending(log, f"{op.op.__name__} {len(batches)}.{i}") for i, op in enumerate(ops)]

    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    peers = _peers()
    peers.early_receives = True
    early = EarlyReceives()
    step, ahead = _step(), _next_step()
    buffers = []

    def make(msg):
        buffers.append(torch.zeros(1))
        return buffers[-1]

    exchange(step, 7, peers, {step.sends[0]: torch.ones(1)}, make, early=early, next_step=ahead)
    assert batches == [[("isend", 12), ("irecv", 12)], [("irecv", 10), ("irecv", 12)]]
    assert log == ["wait irecv 1.1"]  # the early receives are not waited for yet
    send = Message(ACTIVATION, 3, 0, 1, 1, 2)
    received = exchange(Step((send,), ahead.recvs, ahead.actions), 8, peers,
                        {send: torch.ones(1)}, make, early=early, next_step=None)
    assert batches[2:] == [[("isend", 12)]]  # its receives were posted ahead
    assert log[1:] == ["wait irecv 2.0", "wait irecv 2.1"]
    assert [received[m] for m in ahead.recvs] == buffers[1:3]
    assert early.take(9) == ({}, [])


def test_receives_are_not_posted_ahead_without_early_receives(monkeypatch):
    """NCCL (links, or one batch on the pipeline group): each step posts its own receives."""
    from megatron_seq1f1b.runtime.p2p import EarlyReceives

    batches = []
    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv",
                        lambda ops: batches.append(len(ops)) or [_Done() for _ in ops])
    early = EarlyReceives()
    step = _step()
    exchange(step, 7, _peers(), {step.sends[0]: torch.ones(1)}, lambda m: torch.zeros(1),
             early=early, next_step=_next_step())
    assert batches == [2] and early.take(8) == ({}, [])


def test_a_receive_posted_ahead_that_fails_names_its_own_step(monkeypatch):
    from megatron_seq1f1b.runtime.p2p import EarlyReceives

    monkeypatch.setattr(dist, "P2POp", _Op)
    calls = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: calls.append(ops) or (
        [_Done() for _ in ops] if len(calls) == 1 else [_Failed() for _ in ops]))
    peers = _peers()
    peers.early_receives = True
    early = EarlyReceives()
    step, ahead = _step(), _next_step()
    exchange(step, 7, peers, {step.sends[0]: torch.ones(1)}, lambda m: torch.zeros(1),
             early=early, next_step=ahead)
    with pytest.raises(PipelineCommError, match=r"rank 11 .*at step 8 .*receive act 3\.0 0->1"):
        exchange(ahead, 8, peers, {}, lambda m: torch.zeros(1), early=early)


def test_only_gloo_pipelines_post_receives_ahead(monkeypatch):
    from megatron_seq1f1b.runtime import p2p

    class Group:
        def __init__(self, backend, size=2):
            self.backend, self._size = backend, size

        def size(self):
            return self._size

        def rank(self):
            return 0

    monkeypatch.setattr(dist, "get_backend", lambda group: group.backend)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: r)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(p2p, "link_groups", lambda *args: {(0, 1): "g01", (1, 0): "g10"})
    monkeypatch.delenv(p2p.TRANSPORT_ENV, raising=False)

    def build(group):
        return p2p.Peers.build(type("Communicator", (), {"pp_group": group})(), object())

    assert build(Group("gloo")).early_receives
    assert not build(Group("gloo", size=1)).early_receives
    assert not build(Group("nccl")).early_receives  # links
    monkeypatch.setenv(p2p.TRANSPORT_ENV, "batch")
    assert not build(Group("nccl")).early_receives  # one batch per step: would block sends


def test_p2p_latency_benchmark_measures_both_ways():
    """``python -m megatron_seq1f1b.bench.p2p_latency`` (docs/design.md's numbers) runs on two
    gloo ranks and reports a wait for each way of posting."""
    import os
    import re
    import subprocess
    import sys

    from test_benchmark import ROOT, _port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={_port()}", "-m", "megatron_seq1f1b.bench.p2p_latency",
           "--trials", "3", "--compute-ms", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = re.findall(r"receive posted (late|early) *: wait median ([\d.]+) ms, longest "
                       r"([\d.]+) ms", done.stdout)
    assert [way for way, _, _ in found] == ["late", "early"], done.stdout
    assert all(float(median) <= float(longest) for _, median, longest in found), found
