"""Time a unit of work as the device and the host see it, apart.

On a GPU the host launches kernels that the device runs later, so a unit
(one segment's forward or backward through a chunk) has two times: how long
the host needs to dispatch it, and how long the device is busy with it. The
slower of the two is what the unit costs in a pipeline whose host runs ahead
(:class:`megatron_seq1f1b.planner.Fit`'s ``floor``). To see the device time
alone, :class:`UnitTimer` holds the device with a sleep kernel while the
host dispatches, so the unit's kernels queue up behind it and CUDA events
around them measure only the device; the host's wall time over the same
block is its dispatch time. On a CPU both are the wall time.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class Timing:
    """Seconds of one timed block: ``device`` busy, ``host`` dispatching; ``held``: the
    device was held for the whole dispatch (else ``device`` may include waits for the host)."""

    device: float = 0.0
    host: float = 0.0
    held: bool = True


class UnitTimer:
    """``with timer.time() as t: ...`` fills ``t`` (a :class:`Timing`) when the block ends.

    CUDA: synchronizes before and after the block (timing only, never in training).
    The hold grows to twice the longest dispatch seen (at most ``max_hold_s``), so a
    block that outlasted it is marked ``held=False`` and the next one is held long
    enough. :meth:`reset`, after a warm-up, sets the hold from the warm-up's typical
    (median) dispatch: its one-off stalls (compilation, first cuBLAS calls) would
    otherwise hold every later block that long.
    """

    def __init__(self, device: torch.device | str | None = None, hold_s: float = 0.02,
                 max_hold_s: float = 0.25):
        device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))
        self.cuda = device.type == "cuda"
        self.base_hold_s = self.hold_s = hold_s
        self.max_hold_s = max(max_hold_s, hold_s)
        self._cycles_per_s: float | None = None
        self._hosts: list[float] = []  # dispatch times since the last reset

    def reset(self) -> None:
        """Hold twice the median dispatch seen since the last reset (call after a warm-up)."""
        typical = statistics.median(self._hosts) if self._hosts else 0.0
        self.hold_s = min(max(self.base_hold_s, 2 * typical), self.max_hold_s)
        self._hosts.clear()

    def _cycles(self) -> float:
        """Clock cycles per second of ``torch.cuda._sleep`` (measured once, after a sleep
        that wakes an idle GPU's clock: measured at idle clocks, holds would fall short)."""
        if self._cycles_per_s is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
            torch.cuda.synchronize()
            self._cycles_per_s = 20_000_000 / max(start.elapsed_time(end) / 1e3, 1e-6)
        return self._cycles_per_s

    @contextlib.contextmanager
    def time(self) -> Iterator[Timing]:
        timing = Timing()
        if not self.cuda:
            start = time.perf_counter()
            yield timing
            timing.host = timing.device = time.perf_counter() - start
            return
        cycles = int(self.hold_s * self._cycles())
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        begin.record()
        start = time.perf_counter()
        yield timing
        timing.host = time.perf_counter() - start
        end.record()
        torch.cuda.synchronize()
        timing.device = begin.elapsed_time(end) / 1e3
        timing.held = timing.host < self.hold_s
        self._hosts.append(timing.host)
        if timing.host > self.hold_s / 2:
            self.hold_s = min(2 * timing.host, self.max_hold_s)
