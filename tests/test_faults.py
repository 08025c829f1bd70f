"""Faults: an exception in the user's code on one rank fails every rank, in time, by name."""

from __future__ import annotations

import os

import pytest

import pipeline_cases as cases
from gpt import DataSpec, ModelSpec
from megatron_seq1f1b.schedules.schedule import build_schedule

TIMEOUT_S = 4
# (stage, phase, where): first, middle and last stage; warm-up, steady state and cool-down.
CI = [(0, "warm-up", "forward"), (1, "cool-down", "backward"), (3, "steady", "loss")]
FULL = [(stage, phase, where) for stage in (0, 1, 3) for phase, where in
        (("warm-up", "forward"), ("steady", "forward"), ("cool-down", "backward"))] + \
       [(3, "steady", "loss")]
GRID = FULL if os.environ.get("SEQ1F1B_FULL") == "1" else CI


def _action(stage: int, phase: str) -> str:
    """An action of that phase on that stage of the pp=4, m=4, k=2 schedule."""
    actions = build_schedule(4, 4, 2)[stage]
    first_backward = next(i for i, a in enumerate(actions) if a.is_backward)
    if phase == "warm-up":
        return str(actions[0])
    if phase == "steady":
        return str(next(a for a in actions[first_backward:] if a.is_forward))
    return str(actions[-1])


@pytest.mark.parametrize("stage,phase,where", GRID)
def test_user_code_failure_stops_every_rank_naming_the_unit(ranks, stage, phase, where):
    action = _action(stage, phase)
    results = ranks.run(4, cases.fault_in_user_code, case=f"fault-{stage}-{phase}-{where}",
                        stage=stage, action=action, where=where, model=ModelSpec(),
                        timeout_s=TIMEOUT_S)
    failed = results[stage]["error"]
    assert failed and failed.startswith("ActionError"), results
    assert f"(pipeline stage {stage}) failed in {action}" in failed, failed
    assert f"injected failure in {where}" in failed and "micro-batch" in failed, failed
    for r in results:
        assert r["error"], f"rank {r['rank']} finished although stage {stage} failed"
        assert r["seconds"] < 6 * TIMEOUT_S, r
        if r.get("finished"):  # did not need the failed stage any more in this schedule
            assert r["rank"] > stage and phase == "cool-down", r
        elif r["rank"] != stage:
            assert r["error"].startswith("PipelineCommError"), r
            assert f"rank {r['rank']} (pipeline stage {r['rank']})" in r["error"], r
            assert "peer stage" in r["error"], r


@pytest.mark.parametrize("pp,model,data", [
    (1, ModelSpec(attention="flash"), DataSpec(num_microbatches=2, documents=(((0, 24),),),
                                                thd=True)),  # packed THD: RoPE failed first
    (2, ModelSpec(), DataSpec(num_microbatches=2)),
], ids=["pp1-thd", "pp2"])
def test_forgotten_slice_batch_names_it(ranks, pp, model, data):
    """The whole micro-batch given to a segment fails in the model's first forward, one line
    naming slice_batch, before the embedding (stage 0 sends nothing; the next stage waits for
    it and stops at the timeout)."""
    results = ranks.run(pp, cases.forgotten_slice_batch, case=f"no-slice-batch-pp{pp}", pp=pp,
                        model=model, data=data, timeout_s=TIMEOUT_S)
    first = results[0]["error"]
    assert first and first.startswith("ActionError") and "failed in F0.0" in first, results
    assert "\n" not in first and "megatron_seq1f1b.slice_batch(batch)" in first, first
    assert f"model got input_ids of {model.seq_length} (the whole micro-batch)" in first, first
    for later in results[1:]:
        assert later["error"].startswith("PipelineCommError"), later
        assert later["seconds"] < 6 * TIMEOUT_S, later


def _killed_peer_worker(rank: int, port: int, results) -> None:
    """pp=2: stage 1 kills itself (SIGKILL) in its third forward; stage 0 reports."""
    import datetime
    import signal
    import time

    import torch

    import megatron_seq1f1b as s1
    import megatron_seq1f1b.runtime.cpu
    from gpt import DataSpec, forward_step
    from pipeline_cases import _layout

    torch.set_num_threads(1)
    megatron_seq1f1b.runtime.cpu.enable()
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model, data = ModelSpec(), DataSpec(num_microbatches=4)
    _, _, models, batches = _layout(model, data, 2, enable=True, timeout_s=TIMEOUT_S)
    calls = []

    def dying_step(data_iterator, chunk):
        calls.append(1)
        if rank == 1 and len(calls) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_step(data_iterator, chunk, slicer=s1.slice_batch)

    start = time.monotonic()
    try:
        s1.get_forward_backward_func(2)(
            forward_step_func=dying_step, data_iterator=iter(batches), model=models[0],
            num_microbatches=len(batches), seq_length=model.seq_length, micro_batch_size=1)
        results.put((rank, None, time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001
        results.put((rank, f"{type(exc).__name__}: {exc}", time.monotonic() - start))


def test_a_killed_peer_fails_the_others_in_time_naming_it():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_killed_peer_worker, args=(r, port, results)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        rank, error, seconds = results.get(timeout=120)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert procs[1].exitcode == -9
    assert rank == 0 and error and error.startswith("PipelineCommError"), error
    assert "rank 0 (pipeline stage 0)" in error and "peer stage 1 = global rank 1" in error, error
    assert seconds < 6 * TIMEOUT_S, seconds
