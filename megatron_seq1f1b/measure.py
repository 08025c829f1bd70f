"""Start-up measurement: what one segment's forward and backward cost on this rank's chunks.

Each rank runs forward of segments 0..k-1, then backward k-1..0, of one
micro-batch by hand (:class:`~megatron_seq1f1b.segments.SegmentRun`) on its own
model chunks, for a few partitions; the fastest repetition counts (on a shared
machine interference only ever adds time). The pipeline's samples are
gathered, fitted (:meth:`Calibration.from_samples`) and global rank 0's
calibration is broadcast, so every rank plans from the same numbers.
The benchmark's calibration (:mod:`megatron_seq1f1b.bench.calibration`) times
segments with the same :func:`time_segments`.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

# One row [length, end, forward_s, backward_s] per segment.
Rows = list[list[float]]


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_segments(chunk, chunk_index: int, lengths: Sequence[int], batch: dict,
                  forward_step: Callable, config, micro_batch_size: int, pre: bool,
                  post: bool) -> Rows:
    """Forward segments 0..k-1 then backward k-1..0 of one micro-batch on one chunk.

    Inputs of non-first chunks are random activations of the segment's shape;
    outputs of non-last chunks get random gradients; the last chunk's loss is
    the first value its ``loss_func`` returns.
    """
    from megatron.core.utils import get_attr_wrapped_model

    from megatron_seq1f1b.segments import SegmentRun

    run = SegmentRun(list(lengths), config=config)
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    shape = (micro_batch_size, config.hidden_size)
    dtype = config.pipeline_dtype or torch.float32
    data = itertools.repeat(batch)
    set_input = get_attr_wrapped_model(chunk, "set_input_tensor")
    outputs, grads, rows = [], [], []
    end = 0
    for j, length in enumerate(lengths):
        end += length
        inp = None if pre else torch.randn(length // tp, *shape, device=device, dtype=dtype,
                                           requires_grad=True)
        grads.append(None if post else torch.randn(length // tp, *shape, device=device,
                                                   dtype=dtype))
        _synchronize()
        start = time.perf_counter()
        set_input([inp])
        with run.forward(0, j, chunk_index):
            output, loss_func = forward_step(data, chunk)
        if post:
            output = loss_func(output)[0]
        _synchronize()
        rows.append([length, end, time.perf_counter() - start, 0.0])
        outputs.append(output)
    for j in reversed(range(len(lengths))):
        _synchronize()
        start = time.perf_counter()
        with run.backward(0, j, chunk_index):
            torch.autograd.backward(outputs[j], grad_tensors=grads[j])
        _synchronize()
        rows[j][3] = time.perf_counter() - start
        outputs[j] = None
    run.close()
    return rows


def time_cases(chunk, chunk_index: int, cases: Iterable[Sequence[int]], batch: dict,
               forward_step: Callable, config, micro_batch_size: int, pre: bool, post: bool,
               reps: int) -> Rows:
    """Every case's segments, the fastest of ``reps`` repetitions after one warm-up."""
    rows = []
    for lengths in cases:
        samples = [time_segments(chunk, chunk_index, lengths, batch, forward_step, config,
                                 micro_batch_size, pre, post) for _ in range(reps + 1)][1:]
        rows += [[lengths[j], samples[0][j][1], min(s[j][2] for s in samples),
                  min(s[j][3] for s in samples)] for j in range(len(lengths))]
    return rows


def calibration_cases(seq_length: int, multiple_of: int, min_segment_length: int
                      ) -> list[list[int]]:
    """The full sequence and uniform splits into 2, 4 and 8 (as far as segments stay long):
    lengths and prefix ends spread enough to separate per-token, attention and fixed costs."""
    from megatron_seq1f1b.partition import split_sequence

    cases = [[seq_length]]
    for k in (2, 4, 8):
        if seq_length // k >= max(min_segment_length, multiple_of):
            cases.append(split_sequence(seq_length, k, "uniform", multiple_of=multiple_of))
    return cases


def measure_calibration(chunks: Sequence, forward_step: Callable, batch: dict, seq_length: int,
                        micro_batch_size: int, *, min_segment_length: int = 128,
                        reps: int = 2):
    """This pipeline's calibration, identical on every rank (collective over the world).

    ``chunks``: this rank's model chunks (Seq1F1B-enabled); ``batch``: one
    micro-batch as ``forward_step``'s data iterator yields it. Gradients the
    timing leaves are zeroed (``zero_grad_buffer``).
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    from megatron_seq1f1b.checks import segment_multiple
    from megatron_seq1f1b.model import unwrap
    from megatron_seq1f1b.planner import Calibration

    config = get_model_config(chunks[0])
    cases = calibration_cases(seq_length, segment_multiple(config), min_segment_length)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    mine = {}
    for index, chunk in enumerate(chunks):
        gpt = unwrap(chunk)
        mine[(pp_rank, index)] = time_cases(chunk, index, cases, batch, forward_step, config,
                                            micro_batch_size, gpt.pre_process, gpt.post_process,
                                            reps)
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        chunk.zero_grad(set_to_none=True)
    gathered = [None] * pp
    dist.all_gather_object(gathered, mine,
                           group=parallel_state.get_pipeline_model_parallel_group())
    samples = {key: rows for part in gathered for key, rows in part.items()}
    calibration = [Calibration.from_samples(samples, source=f"measured at start-up, cases "
                                                             f"{cases}")]
    dist.broadcast_object_list(calibration, src=0)
    return calibration[0]
