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
    """The plan (a :class:`~megatron_seq1f1b.planner.PlanChoice`, or with
    ``--variable-seq-lengths`` a :class:`VariableChoice`); fills in the args' flags."""
    from megatron.core import parallel_state

    from megatron_seq1f1b.base.checks import ConfigError
    from megatron_seq1f1b.planner.auto import plan_by_measuring

    eod = data.make_tokenizer(args).eod
    if args.variable_seq_lengths is not None:
        return _choose_variable(args, model, forward_step_func, train_ds, eod)
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


class VariableChoice:
    """What the variable-length plan says at start-up: the chosen budget and the candidates."""

    def __init__(self, chosen, ranked):
        from megatron_seq1f1b.planner.variable import table

        self.plan, self.source = chosen, "measured at start-up, on the first global batch"
        self._table = table(chosen, ranked)

    def table(self) -> str:
        return self._table


def _choose_variable(args, model: list, forward_step_func: Callable, train_ds, eod: int):
    """Micro-batches of their own lengths: a token budget (or a count) chosen on the first
    global batch's lengths (:mod:`megatron_seq1f1b.planner.auto_lengths`), read from the
    iterators training itself uses (its own, fresh: training reads them again)."""
    from megatron_seq1f1b.base.checks import ConfigError
    from megatron_seq1f1b.planner.auto_lengths import plan_variable_by_measuring
    iterators, _ = data.data_iterators(args, train_ds, model, 0)
    try:
        chosen, ranked, _, _ = plan_variable_by_measuring(
            model, forward_step_func, iterators if isinstance(iterators, list) else [iterators],
            num_microbatches=args.num_microbatches,
            micro_batch_size=args.schedule_micro_batch_size,
            memory_budget_gib=args.seq1f1b_memory_budget,
            min_segment_length=args.seq1f1b_min_segment_length,
            segment_multiple=args.seq1f1b_segment_multiple,
            documents=data.seq1f1b_documents(args, eod))
    except ConfigError as exc:  # the same on every rank: all stop, none waits
        raise SystemExit(str(exc)) from None
    args.seq1f1b_splits, args.seq1f1b_partition = chosen.num_splits, chosen.partition
    args.seq1f1b_segment_tokens, args.seq1f1b_schedule = chosen.segment_tokens, chosen.schedule
    args.seq1f1b_split_lengths = args.seq1f1b_segment_costs = None
    dist.barrier()
    return VariableChoice(chosen, ranked)
