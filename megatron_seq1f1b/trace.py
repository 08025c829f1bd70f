"""Optional per-action timing of a real run, drawable like a simulated timeline.

Pass a :class:`TimelineRecorder` to ``get_forward_backward_func(...,
recorder=...)``. Every iteration appends, for this rank, the start and end of
each compute action and each point-to-point wait, plus the number of units
whose activations are alive after each action. ``gather()`` collects all
pipeline ranks' records into a :class:`~megatron_seq1f1b.replay.Timeline`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from megatron_seq1f1b.replay import Interval, Timeline
from megatron_seq1f1b.schedule import Action


@dataclass
class IterationRecord:
    origin: float = 0.0  # perf_counter() when the iteration began on this rank
    compute: list[Interval] = field(default_factory=list)
    waits: list[Interval] = field(default_factory=list)
    live_units: list[int] = field(default_factory=list)  # after each compute action

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
        if self.synchronize:
            torch.cuda.synchronize()

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
