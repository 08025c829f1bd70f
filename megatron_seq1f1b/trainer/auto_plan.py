"""``--seq1f1b-splits auto``: measure this model at start-up, then let the planner choose.

Every rank times segments of one training micro-batch on its own chunks
(:func:`megatron_seq1f1b.measure.measure_calibration`: gathered over the
pipeline, global rank 0's fit broadcast), so all ranks plan from the same
numbers and :func:`~megatron_seq1f1b.planner.choose_plan` (deterministic)
gives all of them the same plan. The measurement runs without gradient sync
and restores the random-number state, so training afterwards is exactly what
it would be with the chosen flags given by hand.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from megatron_seq1f1b.trainer import data


@contextlib.contextmanager
def _untouched_rng():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    tracker = get_cuda_rng_tracker().get_states() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
            get_cuda_rng_tracker().set_states(tracker)


def choose(args, model: list, forward_step_func: Callable, train_ds):
    """The plan (a :class:`~megatron_seq1f1b.planner.PlanChoice`); fills in the args' flags."""
    from megatron.core import parallel_state

    from megatron_seq1f1b.measure import measure_calibration
    from megatron_seq1f1b.model import dense_attention, unwrap
    from megatron_seq1f1b.planner import BudgetError, choose_plan

    first = data.batches(train_ds, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                         args.data_parallel_size)
    batch = next(first)
    with _untouched_rng(), contextlib.ExitStack() as no_sync:
        for chunk in model:
            if hasattr(chunk, "no_sync"):
                no_sync.enter_context(chunk.no_sync())
        calibration = measure_calibration(model, forward_step_func, batch, args.seq_length,
                                          args.micro_batch_size,
                                          min_segment_length=args.seq1f1b_min_segment_length)
    try:
        choice = choose_plan(
            args.seq_length, args.pipeline_model_parallel_size, args.num_microbatches,
            num_model_chunks=len(model), micro_batch_size=args.micro_batch_size,
            calibration=calibration, memory_budget=args.seq1f1b_memory_budget,
            # the FLOP model adds the balanced partition to the candidates
            config=unwrap(model[0]).config, vocab_size=args.vocab_size,
            dense_attention=dense_attention(model),
            min_segment_length=args.seq1f1b_min_segment_length,
            multiple_of=args.tensor_model_parallel_size if args.sequence_parallel else 1,
            send_slack=0 if torch.cuda.is_available() else 1,  # NCCL steps wait for sends
        )
    except BudgetError as exc:  # the same on every rank: all stop, none waits
        raise SystemExit(f"--seq1f1b-memory-budget {args.seq1f1b_memory_budget}: {exc}") from None
    plan = choice.plan
    args.seq1f1b_splits, args.seq1f1b_partition = plan.num_splits, plan.partition
    args.seq1f1b_schedule, args.seq1f1b_split_lengths = plan.schedule, list(plan.lengths)
    args.seq1f1b_segment_costs = plan.segment_costs  # W placed as the planner simulated it
    dist.barrier()
    return choice
