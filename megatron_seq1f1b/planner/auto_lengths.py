"""``--seq1f1b-splits auto`` with variable-length micro-batches: measure, then choose a budget.

With ``config.variable_seq_lengths`` every micro-batch has its own length, so the plan is a
token budget per segment (or a fixed count), not one cut. On its first call the auto
function reads the iteration's micro-batches ahead on every rank that has data (as the
executor does), the ranks agree on their lengths (one all-gather,
:mod:`megatron_seq1f1b.segments.length_plan`), every stage times segments of the longest one
on its own chunks (:func:`~megatron_seq1f1b.planner.measure.measure_calibration`, the same
numbers on every rank), and :func:`~megatron_seq1f1b.planner.variable.choose_variable_plan`
picks the fastest plan on those lengths within the memory budget; the same on every rank.
The micro-batches read are then given to the schedule first, so every iteration consumes
what it would have without the measurement.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from megatron_seq1f1b.base.checks import ConfigError


def plan_variable_by_measuring(chunks: list, forward_step_func: Callable, iterators: Sequence,
                               *, num_microbatches: int, micro_batch_size: int,
                               memory_budget_gib: float | None = None,
                               min_segment_length: int = 128,
                               segment_multiple: int | None = None, documents=None,
                               max_splits: int = 64):
    """(chosen plan, ranked plans, the forward-backward function to run, the iterators to give
    it: the micro-batches read ahead first). Collective over the world."""
    import math

    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    from megatron_seq1f1b.api import get_forward_backward_func
    from megatron_seq1f1b.base.checks import segment_multiple as layout_multiple
    from megatron_seq1f1b.planner.measure import (
        measure_calibration, pipeline_dense_attention, untouched_state,
    )
    from megatron_seq1f1b.planner.memory_model import GIB
    from megatron_seq1f1b.planner.variable import choose_variable_plan
    from megatron_seq1f1b.runtime.executor_setup import (
        device, length_group, model_cost, process_groups,
    )
    from megatron_seq1f1b.runtime.p2p import replay_timing
    from megatron_seq1f1b.segments.document_plan import gather_documents
    from megatron_seq1f1b.segments.length_plan import gather_lengths
    from megatron_seq1f1b.segments.run import SegmentData

    config = get_model_config(chunks[0])
    _, groups = process_groups(config, None, None)
    readers = [SegmentData(it) if it is not None else None for it in iterators]
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    lengths = gather_lengths(readers, num_microbatches, length_group(groups), pp_rank, device())
    found = None
    if documents is not None:
        found = gather_documents(documents, readers[0], num_microbatches, lengths,
                                 micro_batch_size, groups, pp_rank)
    longest = max(range(num_microbatches), key=lambda i: (lengths[i], -i))
    first = next((r for r in readers if r is not None), None)
    sample = first.prefetch(num_microbatches)[longest] if first is not None else None
    multiple = layout_multiple(config)
    if segment_multiple is not None:
        multiple = math.lcm(multiple, segment_multiple)
    with untouched_state(chunks):
        calibration = measure_calibration(
            chunks, forward_step_func, itertools.repeat(sample) if sample is not None else None,
            lengths[longest], micro_batch_size, min_segment_length=min_segment_length,
            multiple_of=multiple, documents=found[longest] if found is not None else None)
    try:
        vocab_size = get_attr_wrapped_model(chunks[0], "vocab_size")
    except RuntimeError:
        vocab_size = None
    cost = model_cost(chunks, config, vocab_size, pipeline_dense_attention(chunks))
    try:
        chosen, ranked = choose_variable_plan(
            calibration, lengths, parallel_state.get_pipeline_model_parallel_world_size(),
            cost=cost, num_model_chunks=len(chunks),
            partition="documents" if documents is not None else "balanced",
            multiple_of=multiple, min_segment_length=min_segment_length, max_splits=max_splits,
            memory_budget_bytes=memory_budget_gib * GIB if memory_budget_gib else None,
            timing=replay_timing(parallel_state.get_pipeline_model_parallel_group()),
            documents=found)
    except ValueError as exc:  # the same on every rank: all stop, none waits
        raise ConfigError([f"--seq1f1b-splits auto (variable lengths): {exc}"]) from None
    function = get_forward_backward_func(
        chosen.num_splits, chosen.partition, segment_tokens=chosen.segment_tokens,
        schedule=chosen.schedule, documents=documents, segment_multiple=segment_multiple)
    replayed = [itertools.chain(r.prefetch(num_microbatches), it) if r is not None else it
                for r, it in zip(readers, iterators)]
    return chosen, ranked, function, replayed
