"""``--seq1f1b-splits auto`` in our trainer: measure at start-up, then fill in the flags.

The measurement and the choice are :func:`megatron_seq1f1b.planner.auto.plan_by_measuring`
(the path Megatron-LM's ``auto`` takes too); here it runs before training, on
the first training micro-batch, so the plan is logged before the first
iteration and training afterwards is exactly what the chosen flags given by
hand would do.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch.distributed as dist

from megatron_seq1f1b.trainer import data


def choose(args, model: list, forward_step_func: Callable, train_ds):
    """The plan (a :class:`~megatron_seq1f1b.planner.PlanChoice`); fills in the args' flags."""
    from megatron.core import parallel_state

    from megatron_seq1f1b.base.checks import ConfigError
    from megatron_seq1f1b.planner.auto import plan_by_measuring

    eod = data.make_tokenizer(args).eod
    first = data.batches(train_ds, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                         args.data_parallel_size, data.document_form(args, eod))
    try:
        choice = plan_by_measuring(
            model, forward_step_func, itertools.repeat(next(first)),
            seq_length=args.schedule_seq_length, num_microbatches=args.num_microbatches,
            micro_batch_size=args.schedule_micro_batch_size,
            memory_budget_gib=args.seq1f1b_memory_budget,
            memory_budget_microbatches=args.seq1f1b_memory_budget_microbatches,
            min_segment_length=args.seq1f1b_min_segment_length,
            segment_multiple=args.seq1f1b_segment_multiple,
            documents=data.seq1f1b_documents(args, eod))
    except ConfigError as exc:  # the same on every rank: all stop, none waits
        raise SystemExit(str(exc)) from None
    plan = choice.plan
    by_documents = plan.partition == "documents"  # cut per micro-batch by its documents
    args.seq1f1b_splits, args.seq1f1b_partition = plan.num_splits, plan.partition
    args.seq1f1b_schedule = plan.schedule
    args.seq1f1b_split_lengths = None if by_documents else list(plan.lengths)
    args.seq1f1b_segment_costs = None if by_documents else plan.segment_costs
    dist.barrier()
    return choice
