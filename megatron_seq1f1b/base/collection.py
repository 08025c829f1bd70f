"""Python's cyclic garbage collector paused around builds that only allocate.

Building a schedule's steps (and replaying them) makes hundreds of thousands of small
objects that all stay alive until the build returns: nothing for the collector to find,
but its generational passes walk them again and again (about 40% of a variable-count plan's
build at p 8, m 256). Builds that the executor or the planner run per iteration or per
candidate pause it; what they leave behind is collected as usual afterwards.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The block runs with the cyclic collector off (as it was, afterwards)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
