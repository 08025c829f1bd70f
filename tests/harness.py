"""Run test bodies on N gloo ranks, reusing long-lived worker processes.

Starting N processes and a gloo group costs ~5-10 s; a test case costs ~1 s.
So each world size gets one pool of worker processes for the whole session.
A case is a module-level function (importable in a spawned process) run on
every rank; between cases each worker tears down Megatron's parallel state and
every process group except WORLD.

Deadlocks cannot hang CI: gloo operations time out after ``COMM_TIMEOUT_S``
and raise on the rank that waited, and the harness itself gives every case a
deadline. A failing or timed-out case kills its pool (a half-finished
collective would poison the next case); the next case starts a fresh one.
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

COMM_TIMEOUT_S = float(os.environ.get("SEQ1F1B_TEST_COMM_TIMEOUT", "30"))
CASE_TIMEOUT_S = float(os.environ.get("SEQ1F1B_TEST_CASE_TIMEOUT", "240"))
ERROR_GRACE_S = 5.0


class CaseFailed(AssertionError):
    """A case raised on at least one rank, or did not finish in time."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _teardown_groups() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    world = torch.distributed.group.WORLD
    c10d = torch.distributed.distributed_c10d
    for group in list(c10d._world.pg_map):
        if group is not world and group is not None:
            try:
                torch.distributed.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - best effort; the group may be gone
                pass
    gc.collect()


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import megatron_seq1f1b.runtime.cpu

    megatron_seq1f1b.runtime.cpu.enable()
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COMM_TIMEOUT_S),
    )
    results.put((rank, "__ready__", "ok", None))
    while True:  # until the pool kills this worker (RankPool.close)
        fn, kwargs, case = tasks.get()
        try:
            value = fn(**kwargs)
            results.put((rank, case, "ok", value))
        except BaseException:  # noqa: BLE001 - report everything, including asserts
            results.put((rank, case, "error", traceback.format_exc()))
        finally:
            try:
                _teardown_groups()
            except Exception:  # noqa: BLE001
                pass


class RankPool:
    """World-size-N group of worker processes that run cases one at a time."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_worker, args=(rank, world_size, port, self.tasks[rank], self.results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        self._collect("__ready__", timeout=120)

    @property
    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def _collect(self, case: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(values) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, got_case, status, value = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, proc in enumerate(self.procs) if not proc.is_alive()]
                if dead:
                    self.kill()
                    raise CaseFailed(f"case {case!r}: worker process(es) of rank(s) {dead} died")
                continue
            if got_case != case:
                continue  # a late report of an earlier, already failed case
            if status == "ok":
                values[rank] = value
            else:
                errors[rank] = value
                # The other ranks are likely blocked on the failed one: give them a
                # moment to report their own error, then stop waiting.
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
        if not errors and not missing:
            return [values[r] for r in range(self.world_size)]
        self.kill()
        detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        if errors:
            raise CaseFailed(f"case {case!r} failed on rank(s) {sorted(errors)}:{detail}")
        raise CaseFailed(
            f"case {case!r}: rank(s) {missing} did not finish within {timeout:.0f} s (deadlock?)"
        )

    def run(self, fn: Callable[..., Any], case: str, timeout: float = CASE_TIMEOUT_S, **kwargs):
        """Run ``fn(**kwargs)`` on every rank; return the per-rank results."""
        for task_queue in self.tasks:
            task_queue.put((fn, kwargs, case))
        return self._collect(case, timeout)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)

    def close(self) -> None:
        """Stop the workers. They are idle (between cases) and own nothing that outlives
        them, so they are killed: a clean exit (destroying the process groups, joining
        gloo's threads) took up to 18 s after the MoE modules."""
        self.kill()


class Pools:
    """One lazily started RankPool per world size; restarts after a failure."""

    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn: Callable[..., Any], case: str | None = None, **kwargs):
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool.run(fn, case or fn.__name__, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
