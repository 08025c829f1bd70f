"""Per-rank checkpoint files: model chunks, optimizer, LR schedule, iteration.

Seq1F1B does not change parameter names (``enable`` only installs forwards),
so a checkpoint written by a Seq1F1B run loads into a 1F1B run of the same
parallel layout and vice versa.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"


def _layout(args) -> dict:
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
    }


def _file(directory: Path, iteration: int) -> Path:
    return directory / f"iter_{iteration:07d}" / f"rank_{dist.get_rank():05d}.pt"


def save(args, iteration: int, model: list, optimizer, scheduler) -> Path:
    directory = Path(args.save)
    path = _file(directory, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "iteration": iteration,
        "layout": _layout(args),
        "seq1f1b": bool(args.seq1f1b),
        "model": [chunk.state_dict() for chunk in model],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        **_cuda_rng_states(),
    }
    torch.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        (directory / LATEST).write_text(str(iteration))
    dist.barrier()
    return path


def load(args, model: list, optimizer, scheduler) -> int:
    """Restore the latest checkpoint under --load; returns its iteration."""
    directory = Path(args.load)
    latest = directory / LATEST
    if not latest.exists():
        raise SystemExit(f"--load {directory}: no {LATEST} there")
    iteration = int(latest.read_text().strip())
    state = torch.load(_file(directory, iteration), map_location="cpu", weights_only=False)
    if state["layout"] != _layout(args):
        raise SystemExit(
            f"--load {directory}: checkpoint layout {state['layout']} differs from this run's "
            f"{_layout(args)}; per-rank checkpoints need the same parallel layout"
        )
    for chunk, chunk_state in zip(model, state["model"]):
        chunk.load_state_dict(chunk_state)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    if torch.cuda.is_available() and state.get("cuda_rng") is not None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda_rng"])
        get_cuda_rng_tracker().set_states(state["cuda_rng_tracker"])
    return iteration


def _cuda_rng_states() -> dict:
    """The GPU generators (default and Megatron's tracker: dropout in TP regions)."""
    if not torch.cuda.is_available():
        return {}
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"cuda_rng": torch.cuda.get_rng_state(),
            "cuda_rng_tracker": get_cuda_rng_tracker().get_states()}
