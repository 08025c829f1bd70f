"""Shared fixtures: CPU Megatron-Core and the multi-rank worker pools."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ranks():
    """`ranks.run(world_size, fn, case=..., **kwargs)` runs fn on that many gloo ranks."""
    from harness import Pools

    pools = Pools()
    yield pools
    pools.close()
