"""Optional per-action timing of a real run, drawable like a simulated timeline.

Pass a :class:`TimelineRecorder` to ``get_forward_backward_func(...,
recorder=...)``, or time Megatron-Core's own schedules with
:func:`megatron_step_timer`. Every iteration appends, for this rank, the start and end of
each compute action and each point-to-point wait, plus the number of units
whose activations are alive after each action. ``gather()`` collects all
pipeline ranks' records into a :class:`~megatron_seq1f1b.schedules.replay.Timeline`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from megatron_seq1f1b.schedules.replay import Interval, Timeline
from megatron_seq1f1b.schedules.schedule import Action, B, F


@dataclass
class IterationRecord:
    origin: float = 0.0  # perf_counter() when the iteration began on this rank
    compute: list[Interval] = field(default_factory=list)
    waits: list[Interval] = field(default_factory=list)
    live_units: list[int] = field(default_factory=list)  # after each compute action
    lengths: tuple = ()  # per micro-batch, the segment lengths it was cut into

    @property
    def peak_live_units(self) -> int:
        return max(self.live_units, default=0)


class TimelineRecorder:
    """Collects timings per iteration; cheap when not attached to a schedule."""

    def __init__(self, synchronize: bool | None = None):
        self.iterations: list[IterationRecord] = []
        self.synchronize = torch.cuda.is_available() if synchronize is None else synchronize
        self._rank = 0

    def begin(self, rank: int) -> IterationRecord:
        self._rank = rank
        self.iterations.append(IterationRecord(origin=self.now()))
        return self.iterations[-1]

    def now(self) -> float:
        self._sync()
        return time.perf_counter()

    def _sync(self) -> None:
        # The compute stream only: it waits for a step's receives, not for the sends still
        # in flight on their own NCCL streams (a device-wide synchronize would, and a traced
        # run would then be a rendezvous run, its send waits counted as compute).
        if self.synchronize:
            torch.cuda.current_stream().synchronize()

    def compute(self, start: float, action: Action, step: int, live_units: int) -> None:
        record = self.iterations[-1]
        record.compute.append(Interval(self._rank, start, self.now(), action, step))
        record.live_units.append(live_units)

    def wait(self, start: float, step: int) -> None:
        self.iterations[-1].waits.append(Interval(self._rank, start, self.now(), None, step))

    @property
    def last(self) -> IterationRecord:
        return self.iterations[-1]

    def gather(self, iteration: int = -1, group=None) -> Timeline:
        """All ranks' records of one iteration (collective over `group`), time 0 = first begin.

        Times come from each process's monotonic clock: exact between processes
        of one machine, approximate across machines.
        """
        record = self.iterations[iteration]
        size = torch.distributed.get_world_size(group)
        everything = [None] * size
        torch.distributed.all_gather_object(everything, record, group=group)
        origin = min(r.origin for r in everything)
        timeline = Timeline([[] for _ in everything], [[] for _ in everything])
        for rank, r in enumerate(everything):
            timeline.compute[rank] = [
                Interval(rank, iv.start - origin, iv.end - origin, iv.action, iv.step)
                for iv in r.compute
            ]
            timeline.waits[rank] = [
                Interval(rank, iv.start - origin, iv.end - origin, None, iv.step) for iv in r.waits
            ]
        return timeline


@contextlib.contextmanager
def megatron_step_timer(recorder, chunks: list) -> Iterator[None]:
    """Time Megatron's forward_step/backward_step calls into a TimelineRecorder.

    Patches the module globals of megatron.core.pipeline_parallel.schedules for
    the duration; micro-batch numbers come from ``current_microbatch`` (or a
    per-chunk counter), backward steps are matched to their forward by the
    identity of the output tensor.
    """
    from megatron.core.pipeline_parallel import schedules as msched

    original_forward, original_backward = msched.forward_step, msched.backward_step
    counters = [0] * len(chunks)
    owner: dict[int, Action] = {}
    step = itertools.count()

    def chunk_index(model) -> int:
        for i, chunk in enumerate(chunks):
            if chunk is model:
                return i
        return 0

    def forward_step(*a, **kw):
        model = a[2] if len(a) > 2 else kw["model"]
        c = chunk_index(model)
        mb = kw.get("current_microbatch")
        if mb is None:
            mb = counters[c]
        counters[c] += 1
        start = recorder.now()
        result = original_forward(*a, **kw)
        action = F(mb, 0, c)
        owner[id(result[0])] = action
        recorder.compute(start, action, next(step), 0)
        return result

    def backward_step(input_tensor, output_tensor, output_tensor_grad, *rest):
        # rest: (config,), or (model_type, config) on Megatron-Core 0.16
        start = recorder.now()
        result = original_backward(input_tensor, output_tensor, output_tensor_grad, *rest)
        fwd = owner.pop(id(output_tensor), F(0, 0, 0))
        recorder.compute(start, B(fwd.microbatch, 0, fwd.chunk), next(step), 0)
        return result

    msched.forward_step, msched.backward_step = forward_step, backward_step
    try:
        yield
    finally:
        msched.forward_step, msched.backward_step = original_forward, original_backward


def timeline_stats(timeline: Timeline) -> dict:
    """Makespan, busy and p2p-wait time per rank, and the idle share of a (measured) timeline."""
    makespan = timeline.makespan
    busy = [sum(iv.end - iv.start for iv in rank) for rank in timeline.compute]
    waits = [sum(iv.end - iv.start for iv in rank) for rank in timeline.waits] \
        if timeline.waits else []
    total = makespan * len(timeline.compute)
    return {
        "makespan_s": makespan,
        "busy_s": busy,
        "p2p_wait_s": waits,
        "bubble_fraction": 1.0 - sum(busy) / total if total else 0.0,
    }
