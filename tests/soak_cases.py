"""Soak: hundreds of iterations on the same ranks leave nothing behind (run in harness workers).

After every iteration no object of the executor's per-iteration state may be
alive (pipeline, segment run, K/V cache entries and stores, losses, in-flight
transfers, deferred weight gradients), the number of live tensors stays put
and the process's resident memory stops growing once warm.
"""

from __future__ import annotations

import contextlib
import gc

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

import megatron_seq1f1b as s1
from gpt import DataSpec, ModelSpec
from megatron_seq1f1b.runtime import executor, p2p, te_wgrad, wgrad
from megatron_seq1f1b.segments import kv_cache, loss, run as segments
from pipeline_cases import _layout, _run

# Everything the executor creates for one iteration; none may outlive it.
PER_ITERATION = (
    executor._Pipeline, segments.SegmentRun, segments.SegmentData, segments._Active,
    kv_cache.KVEntry, kv_cache.KVStore, loss.SegmentLosses, loss._Microbatch, p2p.InFlight,
    wgrad.WeightGradStore, te_wgrad.DelayedLayers,
)


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _census() -> dict:
    gc.collect()
    objects = gc.get_objects()
    alive = {cls.__name__: sum(1 for o in objects if type(o) is cls) for cls in PER_ITERATION}
    return {"alive": {name: n for name, n in alive.items() if n},
            "tensors": sum(1 for o in objects if isinstance(o, torch.Tensor)),
            "rss_kib": _rss_kib()}


def soak(pp: int, k: int, vpp: int | None, iterations: int, every: int, model: ModelSpec,
         schedule: str = "1f1b") -> dict:
    """Train `iterations` times (Adam steps), then evaluate as often; a census every `every`.

    Returns ``{"train": {iteration: census}, "eval": {...}}``.
    """
    data = DataSpec(num_microbatches=4)
    _, _, models, batches = _layout(model, data, pp, enable=True, vpp=vpp,
                                    ddp=dict(overlap_grad_reduce=True))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=False, fp16=False), models,
        use_gloo_process_groups=False)
    fwd_bwd = s1.get_forward_backward_func(k, "balanced", schedule=schedule)
    censuses = {"train": {}, "eval": {}}
    for phase, forward_only in (("train", False), ("eval", True)):
        for iteration in range(1, iterations + 1):
            if not forward_only:
                for chunk in models:
                    chunk.zero_grad_buffer()
                optimizer.zero_grad()
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                _run(fwd_bwd, models, batches, model, data, slicer=s1.slice_batch,
                     forward_only=forward_only)
            if not forward_only:
                optimizer.step()
            if iteration % every == 0:
                censuses[phase][iteration] = _census()
    return censuses
