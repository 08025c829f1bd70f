"""Start-up measurement: what one segment's forward and backward cost on this rank's chunks.

Each rank runs forward of segments 0..k-1, then backward k-1..0, of one
micro-batch by hand (:class:`~megatron_seq1f1b.segments.run.SegmentRun`) on its own
model chunks, for a few partitions; per segment the median repetition counts
(the pipeline runs under the same interference; the fastest of a few was
biased low for short segments, whose timings scatter more, so fits made many
segments look cheap). The pipeline's samples are
gathered, fitted (:meth:`Calibration.from_samples`) and global rank 0's
calibration is broadcast, so every rank plans from the same numbers.
The benchmark's calibration (:mod:`megatron_seq1f1b.bench.calibration`) times
segments with the same :func:`time_segments`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_seq1f1b.planner.timing import UnitTimer

# One row [length, end, forward_s, backward_s(, weight_s, input_grad_s)] per segment.
Rows = list[list[float]]


@contextlib.contextmanager
def untouched_state(chunks: list):
    """Around a start-up measurement: RNG restored, grad sync off, MoE losses cleared (the
    timing zeroes the gradients it made): training after it is as without it."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_seq1f1b.base import compat

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    tracker = get_cuda_rng_tracker().get_states() if torch.cuda.is_available() else None
    try:
        with contextlib.ExitStack() as no_sync, torch.enable_grad():
            for chunk in chunks:
                if hasattr(chunk, "no_sync"):
                    no_sync.enter_context(chunk.no_sync())
            yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
            get_cuda_rng_tracker().set_states(tracker)
        compat.moe_losses(reset=True)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HeldActivations:
    """Bytes that one micro-batch's forwards leave alive for its backwards, on one chunk.

    CUDA: the caching allocator's growth over the forwards (real allocations).
    CPU: the resident set cannot tell (glibc reuses freed pages without
    returning them), so the storages autograd saved plus the outputs, each
    storage once, parameters excluded. Either way an estimate for planning:
    what a stage holds per token, times the tokens a schedule keeps in flight.
    """

    def __init__(self, chunk):
        self.on_gpu = torch.cuda.is_available()
        self.parameters = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
        self.bytes: int | None = None
        self._storages: dict[int, int] = {}
        self._before = 0

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def forwards(self, outputs: list):
        """Around the forwards; ``outputs`` (filled inside) are held too."""
        if self.on_gpu:
            torch.cuda.synchronize()
            self._before = torch.cuda.memory_allocated()
            yield
            torch.cuda.synchronize()
            self.bytes = torch.cuda.memory_allocated() - self._before
            return
        self._storages = {}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield
        for output in outputs:
            self._pack(output)
        self.bytes = sum(self._storages.values())
        self._storages = {}


def time_segments(chunk, chunk_index: int, lengths: Sequence[int], data: Iterator | None,
                  forward_step: Callable, config, micro_batch_size: int, pre: bool,
                  post: bool, split_weights: bool = False,
                  held: HeldActivations | None = None, host: Rows | None = None,
                  timer: UnitTimer | None = None, documents=None) -> Rows:
    """Forward segments 0..k-1 then backward k-1..0 of one micro-batch on one chunk.

    ``data``: what ``forward_step`` reads its micro-batch from (one element,
    repeated). Inputs of non-first chunks are random activations of the segment's shape;
    outputs of non-last chunks get random gradients; the last chunk's loss is
    the first value its ``loss_func`` returns. ``split_weights``: the linear
    layers defer their weight gradients (:mod:`megatron_seq1f1b.runtime.wgrad`, as a
    zero-bubble schedule runs them); the backward column is then B alone and a
    fifth column holds W.
    ``held`` measures the bytes the forwards leave for the backwards. Times are the
    device's (:class:`~megatron_seq1f1b.planner.timing.UnitTimer`); ``host`` gets, per segment,
    ``[forward, backward]`` host dispatch seconds (the same as the device's on a CPU).
    ``documents``: the micro-batch's packed documents (attention keeps them apart, as in
    training).
    """
    from megatron.core.utils import get_attr_wrapped_model

    from megatron_seq1f1b.runtime import wgrad
    from megatron_seq1f1b.segments.run import SegmentRun

    from megatron.core import parallel_state

    cp_group = (parallel_state.get_context_parallel_group()
                if (config.context_parallel_size or 1) > 1 else None)
    run = SegmentRun(list(lengths), config=config,
                     documents=None if documents is None else [documents], cp_group=cp_group)
    # this rank's part of a segment's tokens (context and sequence parallelism)
    tp = (config.tensor_model_parallel_size if config.sequence_parallel else 1) * \
        (config.context_parallel_size or 1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    shape = (micro_batch_size, config.hidden_size)
    dtype = config.pipeline_dtype or torch.float32
    set_input = get_attr_wrapped_model(chunk, "set_input_tensor")
    store = wgrad.WeightGradStore([chunk]) if split_weights else None
    timer = timer or UnitTimer(device)
    outputs, grads, rows, hosts = [], [], [], []
    end = 0
    with (held.forwards(outputs) if held else contextlib.nullcontext()), \
            (wgrad.deferring() if split_weights else contextlib.nullcontext()):
        for j, length in enumerate(lengths):
            end += length
            inp = None if pre else torch.randn(length // tp, *shape, device=device, dtype=dtype,
                                               requires_grad=True)
            grads.append(None if post else torch.randn(length // tp, *shape, device=device,
                                                       dtype=dtype))
            with timer.time() as forward:
                set_input([inp])
                with run.forward(0, j, chunk_index):
                    output, loss_func = forward_step(data, chunk)
                if post:
                    output = loss_func(output)[0]
            rows.append([length, end, forward.device, 0.0] + [0.0] * split_weights)
            hosts.append([forward.host, 0.0])
            outputs.append(output)
    for j in reversed(range(len(lengths))):
        unit = (0, j, chunk_index)
        with timer.time() as backward, run.backward(*unit), (
                store.input_grads_only(unit) if store else contextlib.nullcontext()):
            torch.autograd.backward(outputs[j], grad_tensors=grads[j])
        rows[j][3], hosts[j][1] = backward.device, backward.host
        outputs[j] = None
        if store is not None:
            with timer.time() as weight:
                store.run(unit)
            rows[j][4] = weight.device
    if host is not None:
        host.extend(hosts)
    run.close()
    if store is not None:
        store.close()
    return rows


def time_cases(chunk, chunk_index: int, cases: Iterable[Sequence[int]], data: Iterator | None,
               forward_step: Callable, config, micro_batch_size: int, pre: bool, post: bool,
               reps: int, split_weights: bool = False,
               host: Rows | None = None, documents=None) -> tuple[Rows, int | None]:
    """Every case's segments, the median of ``reps`` repetitions after one warm-up; and the
    bytes the first case's forwards held (the fewest of the repetitions). ``host`` gets
    every timed segment's ``[forward, backward]`` host dispatch seconds.

    With ``split_weights`` each repetition runs twice, whole backward and W deferred, and
    rows are ``[length, end, F, B whole, W, B with W deferred]`` (deferring costs a little:
    the weight GEMMs read the saved tensors again later).
    """
    rows, held_bytes = [], None
    timer = UnitTimer()
    for index, lengths in enumerate(cases):
        whole, split = [], []
        for rep in range(reps + 1):
            held = HeldActivations(chunk) if index == 0 else None
            got = time_segments(chunk, chunk_index, lengths, data, forward_step, config,
                                micro_batch_size, pre, post, False, held,
                                host if rep and host is not None else None, timer, documents)
            deferred = (time_segments(chunk, chunk_index, lengths, data, forward_step, config,
                                      micro_batch_size, pre, post, True, timer=timer,
                                      documents=documents)
                        if split_weights else None)
            if not rep:
                timer.reset()  # the warm-up's stalls are not the units' dispatch
            if rep:
                whole.append(got)
                if deferred is not None:
                    split.append(deferred)
                if held is not None:
                    held_bytes = held.bytes if held_bytes is None else min(held_bytes, held.bytes)
        best = typical(whole)
        if split_weights:
            best_split = typical(split)
            best = [row + [s[4], s[3]] for row, s in zip(best, best_split)]
        rows += best
    return rows, held_bytes


def host_floor(host: Rows) -> tuple[float, float]:
    """(forward, backward) host dispatch seconds of a chunk's units: the medians (the
    dispatch hardly depends on the segment's length)."""
    return (statistics.median(row[0] for row in host), statistics.median(row[1] for row in host))


def typical(samples: list[Rows]) -> Rows:
    """Per segment, each timed column's median over repetitions (what a pipeline step sees
    on the same machine; a minimum favours the short segments, whose timings scatter more)."""
    return [samples[0][j][:2] + [statistics.median(s[j][col] for s in samples)
                                 for col in range(2, len(samples[0][j]))]
            for j in range(len(samples[0]))]


def calibration_cases(seq_length: int, multiple_of: int, min_segment_length: int,
                      max_splits: int | None = None) -> list[list[int]]:
    """The full sequence and uniform splits into 2, 4, 8, ... segments, down to the most the
    planner may choose (``split_counts``): lengths and prefix ends spread enough to separate
    per-token, attention and fixed costs, and no plan's segments shorter than a timed one
    (a fit extrapolated to shorter segments misses their lower efficiency)."""
    from megatron_seq1f1b.planner.search import MAX_SPLITS, split_counts
    from megatron_seq1f1b.schedules.partition import split_sequence

    ks = split_counts(seq_length, multiple_of, min_segment_length, max_splits or MAX_SPLITS)
    timed = [k for k in ks if k & (k - 1) == 0]  # powers of two
    timed += [ks[-1]] if ks[-1] not in timed else []
    return [split_sequence(seq_length, k, "uniform", multiple_of=multiple_of) for k in timed]


def measure_p2p(micro_batch_size: int, config, token_counts: Sequence[int],
                reps: int = 5) -> list[list[float]]:
    """One-way time of a pipeline message per size: ping-pong between neighbouring stages.

    One neighbour pair at a time (the others wait at a barrier), the median of
    ``reps`` after a warm-up. Returns [[bytes, seconds], ...] from every pair
    (collective over the world).
    """
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    pp_rank, p = group.rank(), group.size()
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    rows = []
    for stage in range(p - 1):
        dist.barrier()
        if pp_rank not in (stage, stage + 1):
            continue
        peer = dist.get_global_rank(group, stage + 1 if pp_rank == stage else stage)
        for tokens in token_counts:
            tensor = torch.zeros(tokens // tp, micro_batch_size, config.hidden_size,
                                 dtype=config.pipeline_dtype or torch.float32, device=device)
            samples = []
            for rep in range(reps + 1):
                _synchronize()
                start = time.perf_counter()
                if pp_rank == stage:
                    dist.send(tensor, peer)
                    dist.recv(tensor, peer)
                else:
                    dist.recv(tensor, peer)
                    dist.send(tensor, peer)
                _synchronize()
                if rep:
                    samples.append((time.perf_counter() - start) / 2)
            if pp_rank == stage:
                rows.append([float(tensor.numel() * tensor.element_size()),
                             statistics.median(samples)])
    dist.barrier()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return [row for part in gathered for row in part]


def message_fit(rows: list[list[float]], micro_batch_size: int, config):
    """Seconds per message as a :class:`~megatron_seq1f1b.planner.Fit` in tokens of a
    segment (``a`` per token, ``d`` fixed), from :func:`measure_p2p`'s [bytes, seconds]."""
    from megatron_seq1f1b.planner.costs import Fit
    from megatron_seq1f1b.planner.fit import fit_p2p, message_bytes_per_token

    fit = fit_p2p(rows)
    return Fit(fit["beta"] * message_bytes_per_token(micro_batch_size, config), 0.0, fit["alpha"])


def measure_calibration(chunks: Sequence, forward_step: Callable, data: Iterator | None,
                        seq_length: int, micro_batch_size: int, *,
                        min_segment_length: int = 128, reps: int = 3,
                        multiple_of: int | None = None, documents=None):
    """This pipeline's calibration, identical on every rank (collective over the world).

    ``chunks``: this rank's model chunks (Seq1F1B-enabled); ``data``: an
    iterator that yields one micro-batch, repeatedly, as ``forward_step`` reads
    it. Gradients the timing leaves are zeroed (``zero_grad_buffer``). Weight gradients are
    timed apart where a zero-bubble schedule could defer them (``multiple_of``: what the
    cases' segment lengths divide by, default the layout's own multiple); the
    calibration's ``bytes_per_token`` is the most activation bytes any stage
    (all its chunks) holds per token of one sample. On CUDA the fits are the device's
    times, and every stage's forward and backward get the median host dispatch time of its
    units as their ``floor`` (:class:`~megatron_seq1f1b.planner.Fit`): where segments are so
    short that the host cannot keep the device busy, more of them cost more.
    ``documents``: the micro-batch's packed documents (the same on every rank): attention
    keeps them apart while timed, and the fits' quadratic term counts their pairs.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    from megatron_seq1f1b.base.checks import segment_multiple
    from megatron_seq1f1b.planner.costs import Calibration
    from megatron_seq1f1b.runtime import wgrad
    from megatron_seq1f1b.runtime.model_hooks import unwrap

    config = get_model_config(chunks[0])
    cases = calibration_cases(seq_length, multiple_of or segment_multiple(config),
                              min_segment_length)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    split_weights = not wgrad.deferral_problems(chunks)
    if split_weights:
        wgrad.install()
    mine, held, floors = {}, 0, {}
    for index, chunk in enumerate(chunks):
        gpt = unwrap(chunk)
        host: Rows = []
        mine[(pp_rank, index)], chunk_held = time_cases(
            chunk, index, cases, data, forward_step, config, micro_batch_size,
            gpt.pre_process, gpt.post_process, reps, split_weights, host, documents)
        if torch.cuda.is_available():  # host and device apart; on a CPU they are one
            floors[(pp_rank, index)] = host_floor(host)
        held += chunk_held or 0
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        chunk.zero_grad(set_to_none=True)
    gathered = [None] * pp
    dist.all_gather_object(gathered, (mine, held, floors),
                           group=parallel_state.get_pipeline_model_parallel_group())
    samples = {key: rows for part, _, _ in gathered for key, rows in part.items()}
    stage_floors = {key: f for _, _, part in gathered for key, f in part.items()}
    cp = config.context_parallel_size or 1  # per token this rank holds
    bytes_per_token = max(h for _, h, _ in gathered) / (seq_length / cp * micro_batch_size)
    message = None
    if pp > 1:
        tokens = sorted({n for case in cases for n in case})
        message = message_fit(measure_p2p(micro_batch_size, config, tokens), micro_batch_size,
                              config)
    dense = pipeline_dense_attention(chunks)
    calibration = [replace(Calibration.from_samples(
        samples, source=f"measured at start-up, cases {cases}"
                        + (", W timed apart" if split_weights else "")
                        + (", messages timed" if message else "")
                        + (", score rectangle (local attention)" if dense else "")
                        + (", host dispatch floors" if stage_floors else ""),
        bytes_per_token=bytes_per_token or None, dense_attention=dense,
        floors=stage_floors or None, documents=documents), message=message)]
    dist.broadcast_object_list(calibration, src=0)
    return calibration[0]


def pipeline_dense_attention(chunks) -> bool:
    """Whether the pipeline's attention computes masked scores (Megatron's local attention),
    as the executor's stages agree on it: a stage without attention layers (an embedding- or
    loss-only stage of a pipeline layout) takes the others' kind. Collective over the
    pipeline group (one small all-gather)."""
    from megatron.core import parallel_state

    from megatron_seq1f1b.runtime.model_hooks import AttentionKind, attention_kind

    group = parallel_state.get_pipeline_model_parallel_group()
    kinds = [None] * dist.get_world_size(group)
    dist.all_gather_object(kinds, attention_kind(chunks), group=group)
    return max(kinds) == AttentionKind.DENSE
