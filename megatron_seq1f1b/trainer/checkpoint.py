"""Checkpoints: per-rank files, and Megatron-Core's distributed checkpoint for sharded state.

Every rank writes one small file (iteration, layout, LR schedule, RNG states).
Model chunks and optimizer go into that file too, except with
``--use-distributed-optimizer``: each data-parallel rank then owns a shard of
the optimizer state, and both go through ``megatron.core.dist_checkpointing``
(``torch_dist`` format, the distributed optimizer's ``dp_reshardable`` layout,
as Megatron-LM writes them).

Seq1F1B does not change parameter names (``enable`` only installs forwards),
so a checkpoint written by a Seq1F1B run loads into a 1F1B run of the same
parallel layout and vice versa. Resuming is bit-exact: the data position, the
RNG states and the optimizer state are restored as they were.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_seq1f1b.runtime.model_hooks import unwrap

LATEST = "latest_checkpointed_iteration.txt"
SHARDED = "sharded"  # the dist_checkpointing folder inside an iteration's folder


def _layout(args) -> dict:
    layout = {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
    }
    cp = getattr(args, "context_parallel_size", 1)
    if cp > 1:  # (absent at 1: checkpoints from before the flag still match)
        layout["context_parallel_size"] = cp
    return layout


def _file(directory: Path, iteration: int) -> Path:
    return directory / f"iter_{iteration:07d}" / f"rank_{dist.get_rank():05d}.pt"


def _sharded_state(model: list, optimizer, loading: bool) -> dict:
    """Model chunks and distributed-optimizer shards as Megatron-Core sharded tensors."""
    from megatron.core import parallel_state

    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
                "distrib_optim_sharding_type": "dp_reshardable",
                "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    state = {f"model{i}": unwrap(chunk).sharded_state_dict(metadata=metadata)
             for i, chunk in enumerate(model)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    return state


def _torch_adams(optimizer) -> list:
    inner = (opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer]))
    return [opt for opt in inner if isinstance(opt, torch.optim.Adam | torch.optim.AdamW)]


def _materialize_adam_state(optimizer) -> None:
    """Create torch Adam's lazily made state (zeros) so a sharded load has tensors to fill.

    Only where torch's Adam runs (no Apex or Transformer Engine, e.g. on CPU):
    the distributed optimizer then reads ``step`` from that state while it
    describes itself for loading, and before the first step there is none.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                if not adam.state.get(param):
                    adam.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                         "exp_avg": torch.zeros_like(param),
                                         "exp_avg_sq": torch.zeros_like(param)}


def _restore_adam_steps(optimizer) -> None:
    """Per-parameter ``step`` from the loaded param groups' ``step``.

    The distributed optimizer keeps torch Adam's step count in its param groups;
    its sharded load copies the per-parameter ``step`` from the placeholder made
    by :func:`_materialize_adam_state` (zero), which would restart bias correction.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                if "step" in adam.state.get(param, {}):
                    adam.state[param]["step"] = torch.tensor(float(group["step"]))


def save(args, iteration: int, model: list, optimizer, scheduler) -> Path:
    directory = Path(args.save)
    path = _file(directory, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "iteration": iteration,
        "layout": _layout(args),
        "seq1f1b": bool(args.seq1f1b),
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        **_cuda_rng_states(),
    }
    if args.use_distributed_optimizer:
        from megatron.core import dist_checkpointing

        sharded = path.parent / SHARDED
        if dist.get_rank() == 0:
            sharded.mkdir(exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(_sharded_state(model, optimizer, loading=False), str(sharded))
    else:
        state["model"] = [chunk.state_dict() for chunk in model]
        state["optimizer"] = optimizer.state_dict()
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
    if args.use_distributed_optimizer:
        from megatron.core import dist_checkpointing

        sharded = _file(directory, iteration).parent / SHARDED
        if not sharded.is_dir():
            raise SystemExit(f"--load {directory}: iteration {iteration} has no distributed "
                             "checkpoint (it was saved without --use-distributed-optimizer)")
        _materialize_adam_state(optimizer)
        loaded = dist_checkpointing.load(_sharded_state(model, optimizer, loading=True),
                                         str(sharded))
        with torch.no_grad():  # fp32 main params are views of the (grad-requiring) weights
            for i, chunk in enumerate(model):
                unwrap(chunk).load_state_dict(loaded[f"model{i}"])
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    else:
        if "model" not in state:
            raise SystemExit(f"--load {directory}: iteration {iteration} was saved with "
                             "--use-distributed-optimizer; add that flag to resume from it")
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
