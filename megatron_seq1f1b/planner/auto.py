"""``--seq1f1b-splits auto``: measure the model where it runs, then let the planner choose.

:func:`plan_by_measuring` is the one path: every rank times segments of one
real micro-batch on its own chunks (:func:`~megatron_seq1f1b.planner.measure.measure_calibration`,
gathered over the pipeline; global rank 0's fit and bytes per token are
broadcast), so every rank plans from the same numbers and the deterministic
:func:`~megatron_seq1f1b.planner.choose_plan` gives all of them the same plan.
The measurement leaves no trace in training: gradient sync is off, the
gradients it made are zeroed, the random-number state is restored and the MoE
loss tracker emptied.

Our trainer calls it at start-up; Megatron-LM gets
:func:`auto_forward_backward_func` (installed by the patched
``pretrain_gpt.py``), which plans on its first call, from the first
micro-batch of that call, and replays that micro-batch to the schedule, so the
data each iteration consumes is the same as with the chosen flags given by hand.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import torch

from megatron_seq1f1b.base.checks import ConfigError
from megatron_seq1f1b.planner.measure import untouched_state


def plan_by_measuring(chunks: list, forward_step_func: Callable, data_iterator: Iterator | None,
                      *, seq_length: int, num_microbatches: int, micro_batch_size: int,
                      memory_budget_gib: float | None = None,
                      memory_budget_microbatches: float | None = None,
                      min_segment_length: int = 128, segment_multiple: int | None = None,
                      documents=None):
    """Measure these chunks and choose a plan (a :class:`~megatron_seq1f1b.planner.PlanChoice`).

    Collective over the world. ``data_iterator`` yields the micro-batch to
    time (``forward_step_func`` reads it as in training, possibly many times:
    it repeats one element). ``segment_multiple``: as the executor's (segment lengths
    rounded to 64 on CUDA by default). A budget nothing fits raises
    :class:`~megatron_seq1f1b.base.checks.ConfigError` on every rank alike, naming
    the smallest memory reachable. ``documents``: where the micro-batch's packed
    documents are (:data:`~megatron_seq1f1b.segments.document_plan.DocumentSource`): they are read
    on the first stage and sent to every rank, attention keeps them apart while timed, and
    every candidate is predicted on them, the ``documents`` partition among them.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    from megatron_seq1f1b.base.checks import raise_if, rounding_multiple, segment_multiple_problems
    from megatron_seq1f1b.planner.choice import TIE_TOLERANCE, BudgetError
    from megatron_seq1f1b.planner.measure import measure_calibration, pipeline_dense_attention
    from megatron_seq1f1b.planner.memory_model import GIB
    from megatron_seq1f1b.planner.search import choose_plan
    from megatron_seq1f1b.runtime.p2p import replay_timing

    config = get_model_config(chunks[0])
    raise_if(segment_multiple_problems(segment_multiple))
    multiple = rounding_multiple(config, seq_length, 1, segment_multiple)
    try:
        vocab_size = get_attr_wrapped_model(chunks[0], "vocab_size")
    except RuntimeError:
        vocab_size = None
    found = None
    if documents is not None:
        found = _measured_documents(documents, data_iterator, seq_length, micro_batch_size)
    with untouched_state(chunks):
        calibration = measure_calibration(chunks, forward_step_func, data_iterator, seq_length,
                                          micro_batch_size, min_segment_length=min_segment_length,
                                          multiple_of=multiple, documents=found)
    try:
        return choose_plan(
            seq_length, parallel_state.get_pipeline_model_parallel_world_size(),
            num_microbatches, num_model_chunks=len(chunks), micro_batch_size=micro_batch_size,
            calibration=calibration, memory_budget=memory_budget_microbatches,
            memory_budget_bytes=memory_budget_gib * GIB if memory_budget_gib else None,
            # the FLOP model adds the balanced partition to the candidates
            config=config if vocab_size else None, vocab_size=vocab_size,
            dense_attention=pipeline_dense_attention(chunks),  # as the stages agree on it
            min_segment_length=min_segment_length,
            multiple_of=multiple,
            # timed as this pipeline's transport posts and waits (NCCL links, gloo, batch)
            timing=replay_timing(parallel_state.get_pipeline_model_parallel_group()),
            tie_tolerance=TIE_TOLERANCE,  # closer predictions are within its noise
            documents=found, context_parallel_size=config.context_parallel_size or 1,
        )
    except BudgetError as exc:  # the same on every rank: all stop, none waits
        raise ConfigError([f"--seq1f1b-splits auto: "
                           f"{exc.text({'min_segment_length': '--seq1f1b-min-segment-length'})}"]
                          ) from None


def _measured_documents(source, data_iterator, seq_length: int, micro_batch_size: int):
    """The measured micro-batch's documents on every rank (read on the first stage)."""
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megatron_seq1f1b.segments.document_plan import gather_documents
    from megatron_seq1f1b.segments.run import SegmentData

    groups = SimpleNamespace(tp=parallel_state.get_tensor_model_parallel_group(),
                             pp=parallel_state.get_pipeline_model_parallel_group())
    data = SegmentData(data_iterator) if data_iterator is not None else None
    (documents,) = gather_documents(source, data, 1, seq_length, micro_batch_size, groups,
                                    parallel_state.get_pipeline_model_parallel_rank())
    return documents


class _Replayed:
    """An iterator whose first element is read once and can be given out again.

    The measurement reads the element as often as it likes (:meth:`repeating`);
    the schedule then gets it once more, followed by the rest (:meth:`resumed`),
    so a rank reads from the real iterator exactly what it would have read.
    """

    def __init__(self, source: Iterator):
        self.source, self.first, self.read = source, None, False

    def _first(self):
        if not self.read:
            self.first, self.read = next(self.source), True
        return self.first

    def repeating(self) -> Iterator:
        while True:
            yield self._first()

    def resumed(self) -> Iterator:
        return itertools.chain([self.first], self.source) if self.read else self.source


def auto_forward_backward_func(*, memory_budget_gib: float | None = None,
                               memory_budget_microbatches: float | None = None,
                               min_segment_length: int = 128,
                               segment_multiple: int | None = None,
                               log: Callable[[str], None] | None = None,
                               documents=None) -> Callable:
    """Megatron-Core's forward-backward signature; plans on the first call (see module doc).

    Later calls run the chosen plan (its ``choice`` attribute once made); with
    ``variable_seq_lengths`` the plan is a token budget chosen on the first global batch's
    lengths (:mod:`megatron_seq1f1b.planner.auto_lengths`);
    ``log`` gets the candidates' table once (default: print on global rank 0).
    ``documents``: where each micro-batch's packed documents are (planned on the first,
    then given to the schedule).
    """
    state: dict[str, Any] = {}

    def forward_backward_func(*, forward_step_func, data_iterator, model, num_microbatches: int,
                              seq_length: int, micro_batch_size: int, **kwargs):
        from megatron_seq1f1b.runtime.model_hooks import chunks_of

        if "run" not in state and _variable_lengths(model):
            from megatron_seq1f1b.planner.auto_lengths import plan_variable_by_measuring
            from megatron_seq1f1b.planner.variable import table

            iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
            chosen, ranked, state["run"], replayed = plan_variable_by_measuring(
                chunks_of(model), forward_step_func, iterators,
                num_microbatches=num_microbatches, micro_batch_size=micro_batch_size,
                memory_budget_gib=memory_budget_gib, min_segment_length=min_segment_length,
                segment_multiple=segment_multiple, documents=documents)
            forward_backward_func.choice = chosen
            _log(log, "Seq1F1B plan (--seq1f1b-splits auto, variable-length micro-batches; "
                      f"costs measured on the longest of the first {num_microbatches}):\n"
                      + table(chosen, ranked))
            data_iterator = replayed if isinstance(data_iterator, list) else replayed[0]
        if "run" not in state:
            chunks = chunks_of(model)
            iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
            replayed = _Replayed(iterators[0]) if iterators[0] is not None else None
            choice = plan_by_measuring(
                chunks, forward_step_func, replayed.repeating() if replayed else None,
                seq_length=kwargs.get("decoder_seq_length") or seq_length,
                num_microbatches=num_microbatches, micro_batch_size=micro_batch_size,
                memory_budget_gib=memory_budget_gib,
                memory_budget_microbatches=memory_budget_microbatches,
                min_segment_length=min_segment_length, segment_multiple=segment_multiple,
                documents=documents)
            state["run"] = run_plan(choice.plan, documents, segment_multiple)
            forward_backward_func.choice = choice
            _log(log, f"Seq1F1B plan (--seq1f1b-splits auto; costs: {choice.source}, on the "
                      f"first micro-batch):\n{choice.table()}")
            if replayed is not None:
                resumed = replayed.resumed()
                data_iterator = ([resumed] + list(data_iterator[1:])
                                 if isinstance(data_iterator, list) else resumed)
        return state["run"](forward_step_func=forward_step_func, data_iterator=data_iterator,
                            model=model, num_microbatches=num_microbatches,
                            seq_length=seq_length, micro_batch_size=micro_batch_size, **kwargs)

    forward_backward_func.choice = None
    forward_backward_func.num_splits = "auto"
    forward_backward_func.__qualname__ = "seq1f1b_forward_backward[auto]"
    return forward_backward_func


def _variable_lengths(model) -> bool:
    from megatron.core.utils import get_model_config

    from megatron_seq1f1b.runtime.model_hooks import chunks_of

    return bool(getattr(get_model_config(chunks_of(model)[0]), "variable_seq_lengths", False))


def run_plan(plan, documents=None, segment_multiple: int | None = None) -> Callable:
    """The forward-backward function of a chosen plan (the ``documents`` partition cuts every
    micro-batch by its own documents; the others run the plan's lengths)."""
    from megatron_seq1f1b.api import get_forward_backward_func

    by_documents = plan.partition == "documents"
    return get_forward_backward_func(
        plan.num_splits, plan.partition,
        split_lengths=None if by_documents else plan.lengths, schedule=plan.schedule,
        segment_costs=None if by_documents else plan.segment_costs,
        segment_multiple=segment_multiple if by_documents else None, documents=documents)


def _log(log: Callable[[str], None] | None, text: str) -> None:
    import torch.distributed as dist

    if log is not None:
        log(text)
    elif not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)
