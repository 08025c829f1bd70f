"""Which unit is running: the active (segment, phase, run), set by SegmentRun's contexts.

Its own module so that what a segment carries (:mod:`~megatron_seq1f1b.segments.state_carry`)
can ask for the running unit while :mod:`~megatron_seq1f1b.segments.run` holds the carries.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

FORWARD = "forward"
BACKWARD = "backward"


@dataclass
class Active:
    """The running unit: its segment (``SegmentInfo``), phase, ``SegmentRun``, and the whole
    micro-batch ``slice_batch`` cut its part from (multi-token prediction reads the tokens
    after the segment from it: :mod:`~megatron_seq1f1b.segments.mtp`)."""

    info: Any
    phase: str
    run: Any
    batch: dict | None = None


_active: Active | None = None


def active() -> Active | None:
    """The running unit (info, phase, run) or None outside segmented steps."""
    return _active


def current_segment():
    """The segment being computed (``SegmentInfo``), or None outside a segmented step."""
    return _active.info if _active is not None else None


@contextlib.contextmanager
def entered(info, phase: str, run) -> Iterator[Any]:
    """``info`` runs in ``phase`` of ``run`` inside the block (nested blocks restore)."""
    global _active
    outer = _active
    _active = Active(info, phase, run)
    try:
        yield info
    finally:
        _active = outer
