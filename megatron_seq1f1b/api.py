"""The public entry points: a forward-backward function, and installing it into Megatron."""

from __future__ import annotations

from typing import Callable, Sequence

from megatron_seq1f1b.base.checks import raise_if, segment_multiple_problems
from megatron_seq1f1b.schedules.partition import METHODS
from megatron_seq1f1b.schedules.schedule import SCHEDULES
from megatron_seq1f1b.schedules.variable import segment_tokens_problems
from megatron_seq1f1b.schedules.zero_bubble import segment_cost_problems
from megatron_seq1f1b.segments.document_plan import source_problems

# Megatron-Core's own getter while install() is in force (None: not installed).
_original: Callable | None = None
# Keywords of Megatron-Core's getter (0.19 added schedule_pg_collection); ours takes them all.
GETTER_KEYWORDS = ("pp_size", "vp_size", "schedule_pg_collection")


def get_forward_backward_func(
    num_splits: int,
    partition: str = "uniform",
    *,
    split_lengths: Sequence[int] | None = None,
    recorder=None,
    schedule: str = "1f1b",
    segment_costs: Sequence[Sequence[float]] | None = None,
    segment_multiple: int | None = None,
    documents=None,
    segment_tokens: int | None = None,
    backward_by_documents: bool = False,
) -> Callable:
    """A function with Megatron-Core's forward-backward signature that runs Seq1F1B.

    ``num_splits`` segments per micro-batch, cut by ``partition`` ("uniform"
    or "balanced", from the model's config) unless ``split_lengths`` is
    given. Several model chunks select the interleaved schedule. ``schedule``:
    ``"1f1b"`` (Seq1F1B), or ``"zb-h1"`` / ``"zb-h2"`` to run weight gradients
    as separate ``W`` actions in the bubbles (:mod:`megatron_seq1f1b.schedules.zero_bubble`).
    ``segment_costs``: per segment (F, B, W), relative, that place a
    zero-bubble schedule's W and receives (``choose_plan(...).plan.segment_costs``,
    so what runs is what the planner simulated); default: the model's FLOPs.
    ``segment_multiple``: what segment lengths are rounded to (default: 64 on
    CUDA where the sequence allows it, for tensor cores; the layout's own
    multiple, :func:`~megatron_seq1f1b.base.checks.segment_multiple`, always applies).
    ``recorder`` (a :class:`~megatron_seq1f1b.runtime.trace.TimelineRecorder`) collects
    per-action timings. ``documents``: where each micro-batch's packed
    documents are, ``"cu_seqlens"`` (packed THD batches), the end-of-document
    token id, or a callable (:data:`~megatron_seq1f1b.segments.document_plan.DocumentSource`):
    attention then keeps documents apart (a segment reads earlier segments' keys
    only for the document crossing into it), and ``partition="documents"`` cuts
    every micro-batch by its own documents into segments of equal cost.

    ``segment_tokens``: a token budget per segment: a micro-batch of ``S`` tokens gets
    ``ceil(S / segment_tokens)`` segments (a short one stays whole), at most ``num_splits``
    (pass a large ``num_splits`` for no cap), cut by ``partition``. It matters most with
    micro-batches of different lengths (Megatron's ``config.variable_seq_lengths=True``,
    which this function accepts with any ``num_splits``: every stage learns each
    micro-batch's length once per iteration, :mod:`megatron_seq1f1b.segments.length_plan`),
    where it makes every unit cost about the same (:mod:`megatron_seq1f1b.schedules.variable`).

    ``backward_by_documents``: with ``documents``, a micro-batch's runs of documents that no cut
    links (a cut where a document ends) are scheduled as micro-batches of their own, so a run
    goes backward before the next one comes forward and a stage holds about its longest run
    instead of its longest micro-batch (:mod:`megatron_seq1f1b.segments.document_runs`; needs
    ``config.calculate_per_token_loss=True`` and one model chunk).

    Drop-in: with one segment (``num_splits=1``, the 1F1B schedule, no recorder, no documents)
    a model that :func:`~megatron_seq1f1b.enable` did not prepare (a reward model, a vision
    encoder, Megatron's mock models), or a call without ``seq_length``, runs Megatron's own
    schedule (:func:`megatron_schedule`): nothing is cut, so everything Megatron's schedule
    accepts is accepted, with its results. Segments on such a model are refused.
    """
    problems = []
    if not isinstance(num_splits, int) or num_splits < 1:
        problems.append(f"num_splits must be a positive integer, got {num_splits!r}")
    if partition not in METHODS:
        problems.append(f"unknown partition {partition!r}; choose one of {METHODS}")
    if schedule not in SCHEDULES:
        problems.append(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    if partition == "measured" and split_lengths is None:
        problems.append("partition 'measured' balances calibrated costs the executor does not "
                        "have: pass split_lengths=choose_plan(...).plan.lengths (or "
                        "split_sequence(..., 'measured', cost=calibration))")
    if split_lengths is not None and isinstance(num_splits, int) and len(split_lengths) != num_splits:
        problems.append(f"split_lengths has {len(split_lengths)} entries, num_splits is {num_splits}")
    if segment_costs is not None and isinstance(num_splits, int):
        problems += segment_cost_problems(segment_costs, num_splits)
    problems += segment_multiple_problems(segment_multiple)
    problems += segment_tokens_problems(segment_tokens)
    if segment_tokens is not None and num_splits == 1:
        problems.append("segment_tokens with num_splits=1: num_splits is the most segments a "
                        "micro-batch gets, so nothing would be cut; pass the cap you want "
                        "(e.g. 64)")
    problems += source_problems(documents)
    if backward_by_documents and documents is None:
        problems.append("backward_by_documents=True runs a micro-batch's documents apart: pass "
                        "documents='cu_seqlens' or the end-of-document token id")
    if partition == "documents" and split_lengths is None and documents is None:
        problems.append("partition 'documents' cuts each micro-batch by its documents: pass "
                        "documents='cu_seqlens' or the end-of-document token id")
    raise_if(problems)
    lengths = tuple(split_lengths) if split_lengths is not None else None
    costs = (tuple(tuple(float(x) for x in row) for row in segment_costs)
             if segment_costs is not None else None)

    def forward_backward_func(
        *,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches: int,
        seq_length: int | None,
        micro_batch_size: int | None,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable | None = None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: bool | None = False,
    ):
        call = dict(  # Megatron's keywords, as given
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
            forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
            p2p_communicator=p2p_communicator, pg_collection=pg_collection,
            force_all_reduce=force_all_reduce)
        if num_splits == 1 and schedule == "1f1b" and recorder is None and documents is None \
                and segment_tokens is None:
            from megatron_seq1f1b.runtime.model_hooks import is_prepared

            if seq_length is None or not is_prepared(model):
                # Nothing to cut: Megatron's own schedule, with everything it accepts.
                return megatron_schedule(model, pg_collection)(**call)
        from megatron_seq1f1b.runtime.executor import forward_backward

        return forward_backward(
            **call, num_splits=num_splits, partition=partition, split_lengths=lengths,
            recorder=recorder, schedule=schedule, segment_costs=costs,
            segment_multiple=segment_multiple, documents=documents,
            segment_tokens=segment_tokens, backward_by_documents=backward_by_documents)

    forward_backward_func.num_splits = num_splits
    forward_backward_func.partition = partition
    forward_backward_func.split_lengths = lengths
    forward_backward_func.schedule = schedule
    forward_backward_func.segment_tokens = segment_tokens
    forward_backward_func.backward_by_documents = backward_by_documents
    forward_backward_func.__qualname__ = (
        f"seq1f1b_forward_backward[k={num_splits},{partition},{schedule}]")
    return forward_backward_func


def megatron_schedule(model, pg_collection=None) -> Callable:
    """Megatron-Core's own forward-backward function for this layout, as its getter picks it:
    no pipelining on one stage, interleaving for several model chunks."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    pp_group = getattr(pg_collection, "pp", None)
    stages = (pp_group.size() if pp_group is not None
              else parallel_state.get_pipeline_model_parallel_world_size())
    if stages == 1:
        return schedules.forward_backward_no_pipelining
    if isinstance(model, (list, tuple)) and len(model) > 1:
        return schedules.forward_backward_pipelining_with_interleaving
    return schedules.forward_backward_pipelining_without_interleaving


def install(num_splits: int | Callable, partition: str = "uniform", **kwargs) -> Callable:
    """Make Megatron-Core's ``get_forward_backward_func()`` return Seq1F1B's function.

    ``num_splits`` may also be a ready forward-backward function, e.g.
    :func:`megatron_seq1f1b.planner.auto.auto_forward_backward_func`'s, which plans on its
    first call.

    Rebinds the getter in ``megatron.core.pipeline_parallel`` (and ``.schedules``) and in
    every loaded module that imported it by name before: the user's ``__main__``,
    Megatron-LM's ``megatron.training.training``, Megatron-Bridge's
    ``megatron.bridge.training.train`` and ``eval``. A reference that cannot be rebound (a
    local variable, an attribute taken before ``install()``) raises when called, one line
    naming ``install()``, until :func:`uninstall` (:mod:`megatron_seq1f1b.runtime.getter`).
    Returns the function.
    """
    from megatron.core.pipeline_parallel import schedules

    from megatron_seq1f1b.runtime import getter as holders

    global _original
    ours = (num_splits if callable(num_splits)
            else get_forward_backward_func(num_splits, partition, **kwargs))

    def getter(pp_size=None, vp_size=None, schedule_pg_collection=None):
        # schedule_pg_collection: Megatron-Core 0.19 (Megatron-LM's train() and evaluate() pass it)
        if type(schedule_pg_collection).__name__ == "MultiModuleProcessGroupCollection":
            raise_if([
                "a multi-module (cross-grid) schedule_pg_collection selects Megatron's bridge "
                "schedule; Seq1F1B runs one model on one pipeline grid"
            ])
        return ours

    setattr(getter, holders.MARK, ours)
    if _original is None:
        _original = getattr(schedules, holders.NAME)
    holders.replace(_original, getter)
    holders.guard(_original)
    return ours


def uninstall() -> None:
    """Restore Megatron's own getter everywhere :func:`install` replaced it, and let a
    reference to it taken before ``install()`` run again."""
    from megatron_seq1f1b.runtime import getter as holders

    global _original
    if _original is None:
        return
    holders.unguard(_original)
    holders.restore(_original)
    _original = None
