"""What every phase needs from the process group: who prints, device sync, per-stage values."""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank0() -> bool:
    return dist.get_rank() == 0


def say(message: str) -> None:
    """Print once (rank 0), flushed so that torchrun interleaves lines sensibly."""
    if rank0():
        print(message, flush=True)


def synchronize() -> None:
    """Wait for the GPU, so that wall-clock timings cover the kernels."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def local_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def per_stage(*values: float) -> list[list[float]]:
    """Each value per pipeline stage (max over the stage's tensor/data-parallel ranks)."""
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    mine = torch.tensor([stage, *values], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    result = [[0.0] * stages for _ in values]
    for row in everyone:
        for i in range(len(values)):
            result[i][int(row[0])] = max(result[i][int(row[0])], row[1 + i].item())
    return result
