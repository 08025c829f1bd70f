"""The executor: run this rank's steps of a Seq1F1B schedule on Megatron-Core.

One function serves every variant (pipeline size 1, non-interleaved,
interleaved model chunks, forward-only): it builds the schedule, checks the
configuration before the first message, then walks the steps of this rank
(:mod:`megatron_seq1f1b.schedules.plan`): exchange tensors, then forward or backward
one unit inside its segment context.

Megatron-Core's own pieces do the rest: ``backward_step`` and
``deallocate_output_tensor``, ``P2PCommunicator``'s ranks, the embedding
wgrad helpers and ``finalize_model_grads``. Loss normalization is in
:mod:`megatron_seq1f1b.segments.loss`, point-to-point in :mod:`megatron_seq1f1b.runtime.p2p`,
the checks in :mod:`megatron_seq1f1b.base.checks`.

What depends only on the configuration (segment lengths, the checks, the steps
and their messages) is computed once per configuration and reused
(:mod:`megatron_seq1f1b.runtime.executor_setup`); an iteration then only runs its
steps, after one tiny all-gather in which the pipeline stages check that they
run the same schedule (and none refuses it alone); micro-batches of their own
lengths add one all-gather of the lengths, documents two broadcasts of them
(:mod:`megatron_seq1f1b.segments.length_plan`, :mod:`megatron_seq1f1b.segments.document_plan`).

Data parallelism follows Megatron: gradient sync is off (``no_sync_func``)
except for the last gradient-producing action of a model chunk on this rank
(the last micro-batch's final backward: segment 0, or with
``backward_by_documents`` its last run's first segment). Zero-bubble schedules
(``W`` actions, :mod:`megatron_seq1f1b.runtime.wgrad`) produce a chunk's gradients in
two places, so sync is on for both final ones, the last ``B`` (biases, norms,
embeddings) and the last ``W`` (linear weights), and off for the ``W`` of
earlier units in between: Megatron DDP starts a bucket's reduction once every
parameter in it has reported while sync is on, so an earlier report would
start it before the last contribution.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch

from megatron_seq1f1b.base import compat

from megatron_seq1f1b.segments import moe, mtp

from megatron_seq1f1b.base.checks import ConfigError, raise_if
from megatron_seq1f1b.runtime import wgrad
from megatron_seq1f1b.runtime.executor_setup import (  # noqa: F401 - public names kept here too
    Setup, StepPlan, Unit, agree_across_stages, clear_setups, device, document_cut, document_problems,
    length_group, pipeline_steps, process_groups, rank_steps, rehearsal_groups, resolve_lengths,
    setup_for, zero_bubble_costs,
)
from megatron_seq1f1b.runtime.model_hooks import chunks_of, layer_pattern
from megatron_seq1f1b.runtime.p2p import EarlyReceives, InFlight, Peers, PipelineCommError, exchange
from megatron_seq1f1b.schedules import plan as plan_mod
from megatron_seq1f1b.schedules.partition import split_documents
from megatron_seq1f1b.schedules.schedule import Action
from megatron_seq1f1b.segments.cp_group import ContextParallelCommError
from megatron_seq1f1b.segments.document_plan import gather_documents
from megatron_seq1f1b.segments.document_runs import (
    Runs, backward_by_documents_problems, document_runs,
)
from megatron_seq1f1b.segments.length_plan import gather_lengths
from megatron_seq1f1b.segments.loss import SegmentLosses
from megatron_seq1f1b.segments.reports import MicrobatchReports
from megatron_seq1f1b.segments.run import SegmentData, SegmentRun


class ActionError(RuntimeError):
    """The forward, backward or weight-gradient work of one unit raised; says which."""


_KINDS = {"F": "forward", "B": "backward", "W": "weight gradients"}


class _Pipeline:
    """State of one forward-backward call on this rank (the configuration's part: ``setup``)."""

    def __init__(self, setup: Setup, plan: StepPlan, *, config, pg_collection, peers: Peers,
                 forward_step_func, chunks, data, collect_non_loss_data, first_val_step,
                 recorder, documents=None, microbatch_lengths=None, runs: Runs | None = None):
        self.setup, self.plan = setup, plan
        self.forward_step_func = forward_step_func
        self.chunks = chunks
        self.device = device()
        self.data = data
        self.config = config
        self.m = setup.num_microbatches
        self.forward_only = setup.forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.peers = peers
        self.pg_collection = pg_collection
        self.steps = plan.steps
        self.recorder = recorder
        cp_group = pg_collection.cp
        cp = cp_group.size() if cp_group is not None else 1
        self.run = SegmentRun(setup.lengths or None, forward_only=setup.forward_only,
                              documents=documents, microbatch_lengths=microbatch_lengths,
                              cp_group=cp_group if cp > 1 else None,
                              cp_meter=getattr(recorder, "cp_bytes", None))
        self.microbatch_lengths = (tuple(tuple(row) for row in microbatch_lengths)
                                   if microbatch_lengths is not None
                                   else (setup.lengths,) * setup.num_microbatches)
        self.counts = tuple(len(row) for row in self.microbatch_lengths)  # per micro-batch
        # backward_by_documents: the schedule's micro-batches are runs of documents; ``owners``
        # maps one back to its micro-batch and first segment (the data, loss and segment side).
        self.owners = runs.owners if runs is not None else None
        self.schedule_lengths = runs.rows if runs is not None else self.microbatch_lengths
        if runs is not None:
            self.run.last_backward = runs.last_backward
        self.microbatch_shapes = None if microbatch_lengths is None and runs is None else [
            [(n // setup.divisor, setup.micro_batch_size, setup.hidden_size) for n in row]
            for row in self.schedule_lengths]
        self.forward_data_store: list = []
        self.reports = MicrobatchReports(self.microbatch_lengths, setup.micro_batch_size, cp)
        self.losses = SegmentLosses(self.m, self.counts, cp, config.calculate_per_token_loss,
                                    self.device, cp_group if cp > 1 else None)
        self.stash: dict[tuple[int, int, int], tuple] = {}  # unit -> (input, output)
        self.outgoing: dict = {}  # message -> tensor to send in the next step
        self.inbox: dict = {}  # received tensors waiting for their unit
        self.no_sync_context = None
        self.forwards_done = 0
        self.weight_grads = (wgrad.WeightGradStore(chunks, te_layers=setup.delayed_te_layers())
                             if setup.splits_backward else None)
        self.final_grad_actions = plan.final_grad_actions
        self.last_grad_action = plan.last_grad_action
        self.checkpoint_window = (
            plan.first_backward + 1
            if config.num_microbatches_with_partial_activation_checkpoints is not None
            and not self.forward_only else None)
        self.grad_sync_funcs = self._grad_sync_funcs()
        self.autocast = (functools.partial(torch.autocast, "cuda", dtype=config.autocast_dtype)
                         if config.enable_autocast else contextlib.nullcontext)
        from megatron.core.pipeline_parallel.schedules import set_current_microbatch
        from megatron.core.utils import get_attr_wrapped_model

        self.set_current_microbatch = set_current_microbatch
        self.set_input = [get_attr_wrapped_model(chunk, "set_input_tensor") for chunk in chunks]

    # ---------------------------------------------------------------- helpers

    def data_action(self, action: Action) -> Action:
        """The action on its micro-batch's own segments (a run's, with backward_by_documents)."""
        if self.owners is None:
            return action
        microbatch, first = self.owners[action.microbatch]
        return Action(action.kind, microbatch, first + action.segment, action.chunk)

    def make_buffer(self, message: plan_mod.Message) -> torch.Tensor:
        shapes = (self.setup.shapes if self.microbatch_shapes is None
                  else self.microbatch_shapes[message.microbatch])
        return torch.empty(shapes[message.segment], requires_grad=True,
                           device=self.device, dtype=self.config.pipeline_dtype)

    def disable_grad_sync(self) -> None:
        if self.no_sync_context is None:
            no_sync = self.config.no_sync_func
            if isinstance(no_sync, list):
                stack = contextlib.ExitStack()
                for fn in no_sync:
                    stack.enter_context(fn())
                self.no_sync_context = stack
            else:
                self.no_sync_context = (no_sync or contextlib.nullcontext)()
                self.no_sync_context.__enter__()

    def enable_grad_sync(self) -> None:
        if self.no_sync_context is not None:
            self.no_sync_context.__exit__(None, None, None)
            self.no_sync_context = None

    def _grad_sync_funcs(self) -> list | None:
        funcs = self.config.grad_sync_func
        if funcs is None:
            return None
        return list(funcs) if isinstance(funcs, list) else [funcs] * len(self.chunks)

    # ---------------------------------------------------------------- compute

    def forward(self, unit: Unit, input_tensor):
        action, config = self.data_action(unit.action), self.config
        chunk = self.chunks[action.chunk]
        if config.timers is not None:
            config.timers("forward-compute", log_level=2).start()
        first = action.microbatch == 0 and action.segment == 0
        if self.first_val_step is not None and self.forward_only:
            first = first and self.first_val_step
        if first and hasattr(chunk, "set_is_first_microbatch"):
            chunk.set_is_first_microbatch()
        self.set_current_microbatch(chunk, action.microbatch)
        self.set_input[action.chunk]([input_tensor])
        args = (self.data[action.chunk], chunk)
        if self.checkpoint_window is not None:
            flag = (self.forwards_done % self.checkpoint_window
                    >= config.num_microbatches_with_partial_activation_checkpoints)
            args += (flag,)
        with self.run.forward(action.microbatch, action.segment, action.chunk), self.autocast():
            output, loss_func = self.forward_step_func(*args)
        self.forwards_done += 1
        if action.segment == self.counts[action.microbatch] - 1 \
                and self.data[action.chunk] is not None:
            self.data[action.chunk].release(action.microbatch)
        if unit.last_stage:
            output = self._loss(action, output, loss_func)
        if config.timers is not None:
            config.timers("forward-compute").stop()
        return output

    def _loss(self, action: Action, output, loss_func):
        """Last stage: keep the loss for backward, store the report per micro-batch."""
        if loss_func is None:
            self._store(action, output, free_form=True)
            return output
        if self.collect_non_loss_data:
            self._store(action, loss_func(output, non_loss_data=True), free_form=True)
            return output
        result = loss_func(output)
        if self.forward_only:  # nothing to backpropagate: the loss is not kept
            loss, report = result[0], result[-1]
        else:
            loss, report = self.losses.record(action, result)
        self._store(action, report, mean_form=len(result) == 2)
        return loss

    def _store(self, action: Action, value, mean_form: bool = False,
               free_form: bool = False) -> None:
        entry = self.reports.add(action.microbatch, action.segment, action.chunk, value,
                                 mean_form=mean_form, free_form=free_form)
        if entry is not None:
            self.forward_data_store.append(entry)

    def backward(self, unit: Unit, input_tensor, output_tensor, output_grad):
        """Megatron's backward step (input gradients only when the schedule splits off W)."""
        action, own = unit.action, self.data_action(unit.action)
        self._grad_sync_before(action)
        if unit.last_stage:
            output_tensor = self.losses.scaled(own)
        deferred = (self.weight_grads.input_grads_only(action.unit) if self.weight_grads
                    else contextlib.nullcontext())
        with self.run.backward(own.microbatch, own.segment, own.chunk), deferred:
            grad = compat.backward_step(input_tensor, output_tensor, output_grad, self.config)
        self._grad_sync_after(action)
        return grad

    def weight(self, action: Action) -> None:
        """Zero-bubble W: the weight gradients the unit's B left (wgrad.WeightGradStore)."""
        self._grad_sync_before(action)
        self.weight_grads.run(action.unit)
        self._grad_sync_after(action)

    def _grad_sync_before(self, action: Action) -> None:
        """Sync on only for a chunk's final B and W (module docstring), as Megatron allows."""
        funcs = self.grad_sync_funcs
        own_launch = funcs is None or (len(self.chunks) == 1 and self.peers.pp_rank == 0)
        if action in self.final_grad_actions and own_launch:
            self.enable_grad_sync()
        else:
            self.disable_grad_sync()

    def _grad_sync_after(self, action: Action) -> None:
        """Interleaved with grad_sync_func: launch a chunk's reductions after its last action."""
        funcs = self.grad_sync_funcs
        if len(self.chunks) > 1 and funcs is not None \
                and action == self.last_grad_action[action.chunk]:
            self.enable_grad_sync()
            funcs[action.chunk](self.chunks[action.chunk].parameters())
            self.disable_grad_sync()

    # ---------------------------------------------------------------- the loop

    def execute(self) -> None:
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        deallocate = self.config.deallocate_pipeline_outputs
        recorder = self.recorder
        record = recorder.begin(self.peers.global_rank) if recorder else None
        if record is not None:
            record.lengths = self.schedule_lengths
        in_flight = InFlight(
            lambda output: deallocate_output_tensor(output, deallocate))
        sent_outputs = []
        early = EarlyReceives() if self.peers.early_receives else None
        steps = self.steps
        for index, (step, units) in enumerate(zip(steps, self.plan.units)):
            start = recorder.now() if record is not None else 0.0
            self.inbox.update(exchange(
                step, index, self.peers, self.outgoing, self.make_buffer, in_flight,
                sent_outputs, early, steps[index + 1] if index + 1 < len(steps) else None))
            if record is not None and (step.sends or step.recvs):
                recorder.wait(start, index)
            sent_outputs = []
            for unit in units:
                start = recorder.now() if record is not None else 0.0
                try:
                    sent = self.compute(unit, in_flight)
                except (PipelineCommError, ContextParallelCommError, ConfigError, ActionError):
                    raise
                except Exception as exc:  # noqa: BLE001 - re-raised with where and what
                    raise self._failure(unit.action, index, exc) from exc
                if sent is not None:
                    sent_outputs.append(sent)
                if record is not None:
                    recorder.compute(start, unit.action, index, len(self.stash))
        start = recorder.now() if record is not None else 0.0
        in_flight.finish(self.peers)
        if record is not None:
            recorder.wait(start, len(self.steps))

    def compute(self, unit: Unit, in_flight: InFlight):
        """Run one action with its input; returns a forward output to free once it is sent."""
        action = unit.action
        incoming = self.inbox.pop(unit.input) if unit.input is not None else None
        if action.is_forward:
            output = self.forward(unit, incoming)
            if not self.forward_only:
                self.stash[action.unit] = (incoming, output)
            if unit.output is not None:
                self.outgoing[unit.output] = output
                return None if self.forward_only else output
        elif action.is_backward:
            input_tensor, output = self.stash.pop(action.unit)
            if in_flight.holds(output):  # its send must finish before it is freed
                in_flight.finish(self.peers)
            grad = self.backward(unit, input_tensor, output, incoming)
            if unit.output is not None:
                self.outgoing[unit.output] = grad
        else:
            self.weight(action)
        return None

    def _failure(self, action: Action, index: int, exc: Exception) -> ActionError:
        """An exception in the user's code or the model, naming this rank, unit and step."""
        peers, action = self.peers, self.data_action(action)
        return ActionError(
            f"Seq1F1B: rank {peers.global_rank} (pipeline stage {peers.pp_rank}) failed in "
            f"{action} ({_KINDS[action.kind]} of micro-batch {action.microbatch}, segment "
            f"{action.segment}, model chunk {action.chunk}) at step {index}: "
            f"{type(exc).__name__}: {exc}"
        )

    def close(self) -> None:
        self.run.close()
        if not self.forward_only:
            self.losses.close()
        if self.weight_grads is not None:
            self.weight_grads.close()
        if self.stash or self.outgoing or self.inbox:
            raise RuntimeError("Seq1F1B: units left over at the end of the schedule")


def forward_backward(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator | list | None,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
    num_splits: int = 1,
    partition: str = "uniform",
    split_lengths=None,
    recorder=None,
    schedule: str = "1f1b",
    segment_costs=None,
    segment_multiple: int | None = None,
    rehearse: tuple | None = None,
    documents=None,
    segment_tokens: int | None = None,
    backward_by_documents: bool = False,
) -> list:
    """Seq1F1B forward-backward with Megatron-Core's schedule signature (plus our options).

    ``rehearse=(num_stages, stage)``: run that stage's steps of a ``num_stages`` pipeline
    on this rank alone, with made-up receives and dropped sends
    (:mod:`megatron_seq1f1b.planner.rehearse`); the model must be that stage's chunk(s).
    A third entry, the pipeline's :class:`~megatron_seq1f1b.runtime.model_hooks.AttentionKind`,
    is what the stage cuts with (one without attention layers cannot see it).
    ``documents``: where each micro-batch's packed documents are
    (:data:`~megatron_seq1f1b.segments.document_plan.DocumentSource`); read on the first
    stage and sent to every rank before the iteration (:mod:`megatron_seq1f1b.segments.document_plan`).
    ``segment_tokens``: a token budget per segment (:mod:`megatron_seq1f1b.schedules.variable`;
    ``num_splits`` is then the most segments a micro-batch gets). With
    ``config.variable_seq_lengths`` every micro-batch has its own length: ``seq_length``
    is ignored (as Megatron ignores it), the stages agree on the lengths once per
    iteration (:mod:`megatron_seq1f1b.segments.length_plan`) and cut each micro-batch by its own.
    ``backward_by_documents``: a micro-batch's runs of documents that no cut links go backward
    apart, the schedule's micro-batches (:mod:`megatron_seq1f1b.segments.document_runs`).
    """
    from megatron.core.pipeline_parallel.schedules import (
        clear_embedding_activation_buffer,
        finish_embedding_wgrad_compute,
    )
    from megatron.core.pipeline_parallel.utils import is_pp_last_stage
    from megatron.core.utils import get_model_config

    chunks = chunks_of(model)
    iterators = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator]
    config = get_model_config(chunks[0])
    variable = bool(getattr(config, "variable_seq_lengths", False))
    if rehearse is None:
        p2p_communicator, pg_collection = process_groups(config, p2p_communicator,
                                                          pg_collection)
        peers = Peers.build(p2p_communicator, config, wraparound=len(chunks) > 1)
    else:
        pg_collection, peers = rehearsal_groups(config, *rehearse)
    runs_apart = backward_by_documents and not forward_only
    if runs_apart:
        raise_if(backward_by_documents_problems(config, num_chunks=len(chunks),
                                                documents=documents,
                                                layer_pattern=layer_pattern(chunks)))
    sequence = decoder_seq_length if decoder_seq_length is not None else seq_length
    setup = setup_for(
        chunks, config, iterators, pg_collection, peers,
        num_microbatches=num_microbatches, seq_length=None if variable else sequence,
        micro_batch_size=micro_batch_size, forward_only=forward_only, num_splits=num_splits,
        partition=partition, split_lengths=None if split_lengths is None else tuple(split_lengths),
        schedule=schedule, segment_costs=segment_costs,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, segment_multiple=segment_multiple,
        documents=documents, segment_tokens=segment_tokens, variable=variable)
    here = device()
    data = [SegmentData(it, here) if it is not None else None for it in iterators]
    found, microbatch_lengths, plan = None, None, setup.plan
    seq_lengths = None
    if variable:
        seq_lengths = gather_lengths(
            data, num_microbatches, None if rehearse is not None else length_group(pg_collection),
            peers.pp_rank, here)
    if setup.documents is not None:
        found = gather_documents(
            setup.documents, data[0], num_microbatches,
            seq_lengths if seq_lengths is not None else sequence,
            micro_batch_size, pg_collection, peers.pp_rank, rehearsal=rehearse is not None)
    if variable:
        microbatch_lengths = setup.cut(seq_lengths, found, runs_apart)
        if not runs_apart:  # else the runs' plan, below
            plan = setup.plan_for(microbatch_lengths)
    elif setup.document_costs is not None:
        if runs_apart and setup.segment_tokens is not None:  # cut where documents end
            microbatch_lengths = setup.cut([docs.seq_length for docs in found], found, True)
        else:
            microbatch_lengths = [
                split_documents(docs, len(setup.lengths), setup.document_costs,
                                multiple_of=setup.document_multiple) for docs in found]
    runs = None
    if runs_apart:
        runs = document_runs(microbatch_lengths if microbatch_lengths is not None
                             else (setup.lengths,) * num_microbatches, found)
        plan = setup.plan_for(runs.rows)
    pipeline = _Pipeline(
        setup, plan, config=config, pg_collection=pg_collection, peers=peers,
        forward_step_func=forward_step_func, chunks=chunks, data=data,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        recorder=recorder, documents=found, microbatch_lengths=microbatch_lengths, runs=runs,
    )

    embedding_module = None
    if config.finalize_model_grads_func is not None and not forward_only:
        embedding_module = clear_embedding_activation_buffer(
            config, chunks, is_pp_last_stage(pg_collection.pp)
        )
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    param_sync = config.param_sync_func
    if not forward_only and param_sync is not None and len(chunks) > 1:
        funcs = param_sync if isinstance(param_sync, list) else [param_sync] * len(chunks)
        for fn, chunk in zip(funcs, chunks):
            fn(chunk.parameters())
    if not forward_only:
        pipeline.disable_grad_sync()
        moe.set_aux_loss_scale(config, num_microbatches)  # as Megatron's forward_step does
        mtp.set_loss_scale(config, num_microbatches)  # likewise
    with wgrad.deferring() if pipeline.weight_grads is not None else contextlib.nullcontext():
        pipeline.execute()
    if not forward_only and pipeline.no_sync_context is not None:
        # Launch any remaining grad reductions (as Megatron does).
        pipeline.enable_grad_sync()
        funcs = pipeline.grad_sync_funcs
        if funcs is not None and len(chunks) == 1:
            funcs[0](chunks[0].parameters())
    pipeline.close()

    if config.finalize_model_grads_func is not None and not forward_only:
        finish_embedding_wgrad_compute(
            config, embedding_module, is_pp_last_stage(pg_collection.pp), pg_collection.tp
        )
        config.finalize_model_grads_func(
            chunks,
            pipeline.losses.total_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return pipeline.forward_data_store
