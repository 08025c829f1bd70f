"""Shared fixtures: CPU Megatron-Core and the multi-rank worker pools."""

import os
import sys

# Megatron-Core's jit_fuser'd functions (e.g. MLA's rotary under selective recompute) are
# torch.compile'd: ~15 s of compiling per process on CPU for the same numbers eager gives.
# Tests compare schedules with one another, so they run eager (set before torch is imported;
# workers and subprocesses inherit it); the demo and the benchmarks keep compiling.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ranks():
    """`ranks.run(world_size, fn, case=..., **kwargs)` runs fn on that many gloo ranks."""
    from harness import Pools

    pools = Pools()
    yield pools
    pools.close()
