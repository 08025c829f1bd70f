"""Stage rehearsal: one stage of a P-stage pipeline run alone (:func:`rehearse_stage`).

The executor runs exactly that stage's steps of the ``num_stages`` pipeline
(``rehearse=(num_stages, stage)``): every receive is a made-up tensor of the message's
shape and dtype, every send is dropped, there is no stage agreement. With the stage's own
chunks (:func:`~megatron_seq1f1b.planner.stage_build.build_stage_chunks`) its real peak
memory and its compute time without waits are measured (:class:`Rehearsal`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

if TYPE_CHECKING:
    from megatron_seq1f1b.runtime.model_hooks import AttentionKind

__all__ = ["Rehearsal", "rehearse_stage"]


@dataclasses.dataclass
class Rehearsal:
    """What one stage did alone: its actions, their times, its memory.

    Times are the last iteration's (``action_s`` per action, ``compute_s`` their sum) and
    every measured iteration's wall time. Memory of the measured iterations, in bytes:
    ``peak_bytes`` the most real allocations above the start of an iteration (CUDA
    allocator; CPU resident set, see :class:`~megatron_seq1f1b.planner.peak_memory.PeakMemory`),
    ``peak_total_bytes`` the CUDA allocator's peak including weights, gradients and
    optimizer states (None on CPU), ``activation_bytes`` the most bytes autograd held
    for backward (:class:`~megatron_seq1f1b.planner.peak_memory.SavedActivations`; None unless counted).
    """

    num_stages: int
    stage: int
    num_model_chunks: int
    num_microbatches: int
    lengths: list[int]
    schedule: str
    actions: list[str]
    action_s: list[float]
    compute_s: float
    iteration_s: list[float]
    peak_bytes: int
    peak_total_bytes: int | None
    peak_reserved_bytes: int | None
    activation_bytes: int | None
    parameter_bytes: int
    parameters: int
    device: str
    warning: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _zero_grads(chunks) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        chunk.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _finalize_on_real_groups(config):
    """The executor hands ``finalize_model_grads_func`` the rehearsal's process groups,
    whose pipeline group only stands in (it has no peers); the gradients' reductions run
    on Megatron's real groups of this one rank instead."""
    original = config.finalize_model_grads_func
    if original is None:
        yield
        return

    def finalize(chunks, num_tokens=None, pg_collection=None, force_all_reduce=False):
        return original(chunks, num_tokens, force_all_reduce=force_all_reduce)

    config.finalize_model_grads_func = finalize
    try:
        yield
    finally:
        config.finalize_model_grads_func = original


def rehearse_stage(
    model,
    forward_step_func: Callable,
    data_iterator: Iterator | list | None,
    *,
    num_stages: int,
    stage: int,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    num_splits: int = 1,
    partition: str = "uniform",
    split_lengths: Sequence[int] | None = None,
    schedule: str = "1f1b",
    segment_costs=None,
    segment_multiple: int | None = None,
    iters: int = 1,
    warmup: int = 0,
    optimizer=None,
    count_saved: bool | None = None,
    documents=None,
    attention: AttentionKind | None = None,
) -> Rehearsal:
    """Run stage ``stage`` of a ``num_stages`` pipeline alone; ``warmup`` + ``iters``
    iterations, the last ``iters`` measured.

    ``model``: that stage's chunk(s) (:func:`build_stage_chunks`; wrapped or not, Seq1F1B-
    enabled when ``num_splits > 1``); ``data_iterator`` as Megatron's (one per chunk for
    several), yielding at least ``num_microbatches`` per iteration. Scheduling arguments
    as :func:`megatron_seq1f1b.get_forward_backward_func`'s. ``optimizer``: stepped after
    every iteration (its states then count in the CUDA total). ``count_saved``: count
    the bytes autograd saves (default on CPU, where the allocator cannot tell; it costs
    host time per operation). ``documents``: where each micro-batch's packed documents
    are (:func:`megatron_seq1f1b.get_forward_backward_func`'s argument). ``attention``: the
    whole pipeline's attention, which a balanced or documents cut and zero-bubble costs weigh
    (default: this stage's own; a stage without attention layers needs it where those read it).
    """
    from megatron.core.utils import get_model_config

    from megatron_seq1f1b.planner.peak_memory import PeakMemory, SavedActivations
    from megatron_seq1f1b.runtime import executor
    from megatron_seq1f1b.runtime.model_hooks import chunks_of, unwrap
    from megatron_seq1f1b.runtime.trace import TimelineRecorder

    chunks = chunks_of(model)
    config = get_model_config(chunks[0])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    on_gpu = device.type == "cuda"
    count_saved = (not on_gpu) if count_saved is None else count_saved
    params = [p for chunk in chunks for p in unwrap(chunk).parameters()]
    meter = SavedActivations(exclude=params) if count_saved else None
    memory = PeakMemory(device)
    recorder = TimelineRecorder()
    walls, peaks, totals, reserved, saved = [], [], [], [], []
    call = partial(
        executor.forward_backward, forward_step_func=forward_step_func,
        data_iterator=data_iterator, model=model, num_microbatches=num_microbatches,
        seq_length=seq_length, micro_batch_size=micro_batch_size, num_splits=num_splits,
        partition=partition, split_lengths=split_lengths, recorder=recorder, schedule=schedule,
        segment_costs=segment_costs, segment_multiple=segment_multiple,
        rehearse=(num_stages, stage, attention), documents=documents)
    with _finalize_on_real_groups(config), (meter or contextlib.nullcontext()):
        for iteration in range(warmup + iters):
            _zero_grads(chunks)
            if optimizer is not None:
                optimizer.zero_grad()
            if on_gpu:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            memory.reset()
            if meter is not None:
                meter.reset()
            start = time.perf_counter()
            call()
            if optimizer is not None:
                optimizer.step()
            if on_gpu:
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - start
            if iteration < warmup:
                continue
            walls.append(wall)
            peaks.append(memory.peak_above_baseline())
            if on_gpu:
                totals.append(torch.cuda.max_memory_allocated(device))
                reserved.append(torch.cuda.max_memory_reserved(device))
            if meter is not None:
                saved.append(meter.peak_bytes)
    _zero_grads(chunks)
    record = recorder.last
    lengths = list(record.lengths[0])  # a rehearsal repeats one micro-batch
    action_s = [iv.end - iv.start for iv in record.compute]
    return Rehearsal(
        num_stages=num_stages, stage=stage, num_model_chunks=len(chunks),
        num_microbatches=num_microbatches,
        lengths=lengths,
        schedule=schedule, actions=[str(iv.action) for iv in record.compute],
        action_s=action_s, compute_s=sum(action_s), iteration_s=walls,
        peak_bytes=max(peaks), peak_total_bytes=max(totals) if totals else None,
        peak_reserved_bytes=max(reserved) if reserved else None,
        activation_bytes=max(saved) if saved else None,
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        parameters=sum(p.numel() for p in params), device=str(device),
        warning=memory.warning)
