"""The executor: run this rank's steps of a Seq1F1B schedule on Megatron-Core.

One function serves every variant (pipeline size 1, non-interleaved,
interleaved model chunks, forward-only): it builds the schedule, checks the
configuration before the first message, then walks the steps of this rank
(:mod:`megatron_seq1f1b.plan`): exchange tensors, then forward or backward
one unit inside its segment context.

Megatron-Core's own pieces do the rest: ``backward_step`` and
``deallocate_output_tensor``, ``P2PCommunicator``'s ranks, the embedding
wgrad helpers and ``finalize_model_grads``. Loss normalization is in
:mod:`megatron_seq1f1b.loss`, point-to-point in :mod:`megatron_seq1f1b.p2p`,
the checks in :mod:`megatron_seq1f1b.checks`.

What depends only on the configuration (segment lengths, the checks, the steps
and their messages) is computed once per configuration and reused (:func:`_setup_for`, a small cache keyed by the
model chunks, the config's scalar fields and the call's arguments); an
iteration then only runs its steps, after one tiny all-gather in which the
pipeline stages check that they run the same schedule.

Data parallelism follows Megatron: gradient sync is off (``no_sync_func``)
except for the last gradient-producing action of a model chunk on this rank
(the backward of segment 0 of the last micro-batch). Zero-bubble schedules
(``W`` actions, :mod:`megatron_seq1f1b.wgrad`) produce a chunk's gradients in
two places, so sync is on for both final ones, the last ``B`` (biases, norms,
embeddings) and the last ``W`` (linear weights), and off for the ``W`` of
earlier units in between: Megatron DDP starts a bucket's reduction once every
parameter in it has reported while sync is on, so an earlier report would
start it before the last contribution.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import functools
import hashlib
import itertools
import math
import weakref
from typing import Any, Callable, Iterator, NamedTuple

import torch

from megatron_seq1f1b import compat, moe, te_wgrad, wgrad
from megatron_seq1f1b import plan as plan_mod
from megatron_seq1f1b.checks import (
    ConfigError, executor_problems, raise_if, rounding_multiple, segment_multiple_problems,
)
from megatron_seq1f1b.checks import segment_multiple as segment_multiple_of
from megatron_seq1f1b.context_parallel import ContextParallelCommError, StandInGroup
from megatron_seq1f1b.document_plan import gather_documents, source_problems
from megatron_seq1f1b.loss import SegmentLosses
from megatron_seq1f1b.model import chunks_of, dense_attention, is_enabled, unwrap
from megatron_seq1f1b.p2p import InFlight, Peers, PipelineCommError, exchange
from megatron_seq1f1b.partition import METHODS, CostModel, split_documents, split_sequence
from megatron_seq1f1b.replay import replay
from megatron_seq1f1b.validate import check_link_order
from megatron_seq1f1b.zero_bubble import segment_cost_fn, segment_cost_problems
from megatron_seq1f1b.schedule import SCHEDULES, Action, build_schedule, splits_backward
from megatron_seq1f1b.segments import SegmentData, SegmentRun


@functools.lru_cache(maxsize=64)
def pipeline_steps(
    num_stages: int, num_microbatches: int, num_splits: int, num_chunks: int, forward_only: bool,
    schedule: str = "1f1b", costs: tuple | None = None,
) -> tuple:
    """Every rank's steps (a pure function of the sizes; cached across iterations).

    ``costs``: per-segment (F, B, W) estimates that place zero-bubble W actions and
    the receives; a plan built from them is replayed (validated) before use.
    """
    actions = build_schedule(num_stages, num_microbatches, num_splits, num_chunks,
                             forward_only=forward_only, schedule=schedule, costs=costs)
    cost = segment_cost_fn(costs) if costs is not None and not forward_only else None
    steps = plan_mod.plan_steps(actions, num_chunks, cost=cost)
    if cost is not None:
        check_link_order(steps)
        replay(steps)
    return tuple(tuple(rank) for rank in steps)


def rank_steps(num_stages, num_microbatches, num_splits, num_chunks, forward_only, rank,
               schedule: str = "1f1b", costs: tuple | None = None) -> tuple:
    return pipeline_steps(num_stages, num_microbatches, num_splits, num_chunks, forward_only,
                          schedule, costs)[rank]


def zero_bubble_costs(lengths, chunks, config, vocab_size) -> tuple:
    """Per-segment (F, B, W) of this model from its FLOPs (:class:`CostModel`), mean F = 1.

    W is the linear layers' weight GEMMs; B repeats those GEMMs for the input
    gradients and differentiates attention. Rounded so every rank derives the
    same numbers (and the same schedule) from the same configuration.
    """
    model = CostModel.from_config(config, vocab_size, dense_attention=dense_attention(chunks))
    forwards = model.split_costs(list(lengths))
    mean = sum(forwards) / len(forwards)
    ends = itertools.accumulate(lengths)
    return tuple(
        (round(f / mean, 4),) + tuple(round(x / mean, 4) for x in model.backward_parts(n, end))
        for f, n, end in zip(forwards, lengths, ends)
    )


def resolve_lengths(num_splits: int, partition: str, split_lengths, seq_length: int, chunks,
                    config, vocab_size, segment_multiple: int | None = None) -> list[int]:
    """The segment lengths the executor uses: given ones, else ``split_sequence`` for this model,
    rounded to :func:`~megatron_seq1f1b.checks.rounding_multiple` (64 on CUDA by default).

    (Benchmarks call this too, so that they report the lengths that actually ran.)
    """
    if split_lengths is not None:
        return [int(n) for n in split_lengths]
    dense = partition == "balanced" and dense_attention(chunks)
    multiple = rounding_multiple(config, seq_length, num_splits, segment_multiple)
    return split_sequence(seq_length, num_splits, partition, config=config,
                          vocab_size=vocab_size, multiple_of=multiple, dense_attention=dense)


def _process_groups(config, p2p_communicator, pg_collection):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        if p2p_communicator is not None:
            raise_if(["pass both p2p_communicator and pg_collection, or neither"])
        pg_collection = ProcessGroupCollection()
        pg_collection.tp = parallel_state.get_tensor_model_parallel_group()
        pg_collection.cp = parallel_state.get_context_parallel_group()
        pg_collection.embd = parallel_state.get_embedding_group(check_initialized=False)
        pg_collection.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
        pg_collection.pp = parallel_state.get_pipeline_model_parallel_group()
        pg_collection.dp_cp = parallel_state.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=False
        )
        # finalize_model_grads reduces the routers' token counts over these (expert bias)
        pg_collection.tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(
            with_context_parallel=True
        )
        pg_collection.dp = parallel_state.get_data_parallel_group(
            with_context_parallel=False, partial_data_parallel=False
        )
    if p2p_communicator is None:
        p2p_communicator = P2PCommunicator(pp_group=pg_collection.pp, config=config)
    return p2p_communicator, pg_collection


def _agreement(num_microbatches, lengths, num_chunks, forward_only, schedule, costs) -> tuple:
    """What every pipeline stage must agree on: sizes and a hash of the segment plan."""
    plan = repr((tuple(lengths), schedule, costs)).encode()
    return (num_microbatches, len(lengths), num_chunks, int(forward_only), sum(lengths),
            int.from_bytes(hashlib.sha256(plan).digest()[:7], "big"))


def _agree_across_stages(pp_group, mine: tuple, lengths, num_microbatches, schedule) -> None:
    """All pipeline ranks run the same schedule; otherwise fail before any p2p message.

    One tiny all-gather per call, read at once: a rank whose configuration
    changed alone must stop everyone with this error, not leave its peers
    waiting in a transfer of the wrong shape. Reading it waits for the device,
    once per iteration, where training loops wait anyway (the previous
    optimizer step's norms and losses); pipeline size 1 skips it.
    """
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = torch.empty(pp_group.size() * len(mine), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(gathered, local, group=pp_group)
    rows = gathered.view(pp_group.size(), len(mine)).tolist()
    differ = [stage for stage, row in enumerate(rows) if row != rows[0]]
    if differ:
        raise_if([
            f"pipeline stages {differ} run a different schedule than stage 0 (num_microbatches, "
            f"num_splits, split_lengths, schedule, model chunks or forward_only differ: "
            f"{rows[0]} vs "
            f"{[rows[d] for d in differ]}); this stage has m={num_microbatches}, "
            f"lengths={list(lengths)}, schedule={schedule}"
        ])


def _device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


class _Unit(NamedTuple):
    """One action of a step with what it receives and sends (computed once per configuration)."""

    action: Action
    input: plan_mod.Message | None
    output: plan_mod.Message | None
    last_stage: bool


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What one configuration computes once (see the module docstring).

    It holds no model, config or process group (it must not keep them alive once the user
    drops them); the process groups are looked up per call, which costs microseconds.
    """

    lengths: tuple[int, ...]
    num_microbatches: int
    forward_only: bool
    steps: tuple[plan_mod.Step, ...]
    units: tuple[tuple[_Unit, ...], ...]  # per step
    shapes: tuple[tuple[int, int, int], ...]  # per segment: [tokens on this rank, b, h]
    final_grad_actions: frozenset
    last_grad_action: dict
    first_backward: int  # index of this rank's first backward action (or the action count)
    splits_backward: bool
    te_layers: tuple  # per chunk, weak references to TE layers with delayed weight gradients
    agreement: tuple
    # Packed documents (plan data read every iteration), and with the ``documents`` partition
    # what cuts each micro-batch: the FLOP cost model and the layout's multiple.
    documents: Any = None
    document_costs: CostModel | None = None
    document_multiple: int = 1
    divisor: int = 1  # a segment's tokens over this rank's share of them (CP x SP)
    micro_batch_size: int = 1
    hidden_size: int = 0

    def delayed_te_layers(self) -> list:
        return [[(name, ref()) for name, ref in chunk] for chunk in self.te_layers]


_SETUPS: "collections.OrderedDict[tuple, _Setup]" = collections.OrderedDict()
_MAX_SETUPS = 16
_PLAIN = frozenset((type(None), bool, int, float, str, torch.dtype))


def _config_fingerprint(config) -> tuple:
    """The config's scalar fields (what the checks read); callables and objects are left out.

    (Once per call over a few hundred fields: exact type tests, no generator per field.)
    """
    return tuple([
        (name, value) for name, value in vars(config).items()
        if type(value) in _PLAIN or isinstance(value, enum.Enum)
        or (type(value) is tuple and all(type(v) in _PLAIN for v in value))
    ])


def clear_setups() -> None:
    """Forget every cached setup: the next call checks its configuration again.

    The key sees the config's scalar fields and the call's arguments, not the
    model's structure: after changing a model in place (adding, swapping or
    removing modules) call this, so the checks see the new modules.
    """
    _SETUPS.clear()


def _setup_for(chunks, config, iterators, pg_collection, peers: Peers, **arguments) -> _Setup:
    """The cached setup of this configuration, or a new one (checked).

    Keyed by the chunks (weakly: a dead model's entry can never match again), the
    config's identity and scalar fields, the layout and the call's arguments.
    """
    layout = (peers.pp_size, peers.pp_rank, tuple(peers.stage_to_global),
              pg_collection.cp.size() if pg_collection.cp is not None else 1,
              id(pg_collection.pp))
    try:
        key = (tuple(weakref.ref(chunk) for chunk in chunks), id(config),
               _config_fingerprint(config), tuple(it is None for it in iterators), layout,
               tuple(sorted(arguments.items())))
        hash(key)
    except TypeError:  # unhashable arguments: the checks will say what is wrong
        key = None
    setup = _SETUPS.get(key) if key is not None else None
    if setup is not None:
        _SETUPS.move_to_end(key)
        return setup
    setup = _build_setup(chunks, config, iterators, pg_collection, peers, **arguments)
    if key is not None:
        _SETUPS[key] = setup
        while len(_SETUPS) > _MAX_SETUPS:
            _SETUPS.popitem(last=False)
    return setup


def _build_setup(chunks, config, iterators, pg_collection, peers, *,
                 num_microbatches, seq_length, micro_batch_size, forward_only, num_splits,
                 partition, split_lengths, schedule, segment_costs, adjust_tensor_shapes_fn,
                 segment_multiple=None, documents=None) -> _Setup:
    """Check the configuration (all problems at once) and derive this rank's steps."""
    from megatron.core.utils import get_attr_wrapped_model

    pp_size, pp_rank = peers.pp_size, peers.pp_rank
    if not isinstance(num_splits, int) or num_splits < 1:
        raise_if([f"num_splits must be a positive integer, got {num_splits!r}"])
    if partition not in METHODS:
        raise_if([f"unknown partition {partition!r}; choose one of {METHODS}"])
    if schedule not in SCHEDULES:
        raise_if([f"unknown schedule {schedule!r}; choose one of {SCHEDULES}"])
    if segment_costs is not None:
        raise_if(segment_cost_problems(segment_costs, num_splits))
    raise_if(segment_multiple_problems(segment_multiple))
    raise_if(document_problems(documents, partition, split_lengths, micro_batch_size))
    if documents == "cu_seqlens" and (getattr(config, "context_parallel_size", 1) or 1) > 1:
        raise_if(["packed (THD) documents with context parallelism are not supported (each "
                  "document would need its own CP split); give documents by end-of-document "
                  "tokens, or use context_parallel_size=1"])
    if documents == "cu_seqlens" and getattr(config, "apply_rope_fusion", False) and any(
            getattr(unwrap(chunk), "position_embedding_type", None) == "rope" for chunk in chunks):
        raise_if(["packed (THD) documents with apply_rope_fusion: the fused THD RoPE kernel "
                  "starts every piece of a document at position 0, also the part that crossed "
                  "into a segment from earlier ones; set apply_rope_fusion=False (--no-rope-fusion)"])
    try:
        vocab_size = get_attr_wrapped_model(chunks[0], "vocab_size")
    except RuntimeError:
        vocab_size = None
    by_documents = partition == "documents" and split_lengths is None
    try:
        # The documents partition cuts each micro-batch by its own documents; its nominal
        # lengths (uniform) stand for it where one set is needed (checks, zero-bubble costs).
        lengths = resolve_lengths(num_splits, "uniform" if by_documents else partition,
                                  split_lengths, seq_length, chunks, config, vocab_size,
                                  segment_multiple)
    except ValueError as exc:
        raise_if([f"num_splits={num_splits} with seq_length={seq_length}: {exc}"])
    if len(lengths) != num_splits:
        raise_if([f"split_lengths has {len(lengths)} entries but num_splits is {num_splits}"])
    multiple = rounding_multiple(config, seq_length, num_splits, segment_multiple)
    if segment_multiple is not None and any(n % multiple for n in lengths):
        raise_if([f"split_lengths {list(lengths)} are not all multiples of segment_multiple="
                  f"{segment_multiple} (with the layout's own multiple: {multiple})"])
    raise_if(executor_problems(chunks, iterators, config, num_microbatches, num_splits, lengths,
                               seq_length, pp_size, adjust_tensor_shapes_fn,
                               num_splits == 1 or is_enabled(chunks)))
    if len(chunks) > 1:
        from megatron_seq1f1b.interleaved import interleaved_problems

        raise_if(interleaved_problems(pp_size, num_microbatches, num_splits, len(chunks),
                                      schedule, forward_only))
    if schedule != "1f1b" and not forward_only:
        raise_if(wgrad.deferral_problems(chunks, num_splits))
        wgrad.install()
    elif not forward_only:
        raise_if(wgrad.without_w_problems(chunks))

    costs = None
    if schedule != "1f1b" and not forward_only:
        # the planner's measured costs place W as it predicted; else this model's FLOPs
        costs = (tuple(tuple(float(x) for x in row) for row in segment_costs)
                 if segment_costs is not None
                 else zero_bubble_costs(lengths, chunks, config, vocab_size))
    steps = rank_steps(pp_size, num_microbatches, num_splits, len(chunks), forward_only, pp_rank,
                       schedule, costs)
    topology = plan_mod.Topology(pp_size, len(chunks))
    last_virtual = topology.last_virtual_stage
    units = tuple(
        tuple(_Unit(a, plan_mod.input_message(a, pp_rank, topology),
                    plan_mod.output_message(a, pp_rank, topology),
                    topology.virtual_stage(pp_rank, a.chunk) == last_virtual)
              for a in step.actions)
        for step in steps)
    actions = [a for step in steps for a in step.actions]
    final, last = _final_grad_actions(actions)
    cp = pg_collection.cp.size() if pg_collection.cp is not None else 1
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    split = splits_backward([actions])
    te_layers = tuple(tuple((name, weakref.ref(layer)) for name, layer in chunk)
                      for chunk in te_wgrad.delayed_layers(chunks)) if split else ()
    document_costs, document_multiple = document_cut(chunks, config, vocab_size,
                                                     segment_multiple)
    document_costs = document_costs if by_documents else None
    return _Setup(
        documents=documents, document_costs=document_costs,
        document_multiple=document_multiple, divisor=cp * tp,
        micro_batch_size=micro_batch_size, hidden_size=config.hidden_size,
        lengths=tuple(lengths), num_microbatches=num_microbatches, forward_only=forward_only,
        steps=tuple(steps), units=units,
        shapes=tuple((n // cp // tp, micro_batch_size, config.hidden_size) for n in lengths),
        final_grad_actions=frozenset(final), last_grad_action=last,
        first_backward=next((i for i, a in enumerate(actions) if a.is_backward), len(actions)),
        splits_backward=split, te_layers=te_layers,
        agreement=_agreement(num_microbatches, lengths, len(chunks), forward_only, schedule,
                             costs),
    )


def document_cut(chunks, config, vocab_size, segment_multiple=None) -> tuple[CostModel, int]:
    """What the documents partition cuts a micro-batch with: this model's FLOP costs (as its
    attention computes them) and the layout's multiple (a requested one too; the CUDA
    default of 64 is not forced on cuts that could fall where documents end)."""
    costs = CostModel.from_config(config, vocab_size, dense_attention=dense_attention(chunks))
    multiple = (segment_multiple_of(config) if segment_multiple is None
                else math.lcm(int(segment_multiple), segment_multiple_of(config)))
    return costs, multiple


def document_problems(documents, partition: str, split_lengths, micro_batch_size: int) -> list:
    """A documents source that can be read, and the partition that needs one."""
    problems = source_problems(documents)
    if partition == "documents" and split_lengths is None and documents is None:
        problems.append("partition 'documents' cuts each micro-batch by its documents: pass "
                        "documents='cu_seqlens' or the end-of-document token id")
    if documents == "cu_seqlens" and micro_batch_size != 1:
        problems.append(
            f"packed (THD) batches (documents='cu_seqlens') with micro_batch_size="
            f"{micro_batch_size}: Megatron-LM flattens them into one sequence of "
            f"{micro_batch_size} x seq_length tokens; run micro-batch size 1 (or flatten and "
            "pass seq_length accordingly), or give documents by end-of-document tokens")
    return problems


def _final_grad_actions(actions) -> tuple[set, dict]:
    """Per chunk the last B and the last W (grad sync on), and the very last of them."""
    last_of_kind, last = {}, {}
    for action in actions:
        if not action.is_forward:
            last_of_kind[(action.chunk, action.kind)] = action
            last[action.chunk] = action
    return set(last_of_kind.values()), last


def _rehearsal_groups(config, num_stages: int, stage: int):
    """This rank's process groups with the pipeline group standing in for ``num_stages`` (and the
    context-parallel group for the config's ``context_parallel_size``)."""
    if not (isinstance(num_stages, int) and isinstance(stage, int) and 0 <= stage < num_stages):
        raise_if([f"rehearse=(num_stages, stage) needs 0 <= stage < num_stages, got "
                  f"({num_stages!r}, {stage!r})"])
    _, pg_collection = _process_groups(config, None, None)
    rehearsal = copy.copy(pg_collection)
    rehearsal.pp = _stand_in_group(num_stages, stage)  # one object: the setup cache keys it
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1 and (pg_collection.cp is None or pg_collection.cp.size() == 1):
        rehearsal.cp = _stand_in_group(cp, 0)  # rank 0 of the CP group, made-up peers
    return rehearsal, Peers.stand_ins(num_stages, stage)


@functools.lru_cache(maxsize=None)
def _stand_in_group(size: int, rank: int) -> StandInGroup:
    return StandInGroup(size, rank)


class ActionError(RuntimeError):
    """The forward, backward or weight-gradient work of one unit raised; says which."""


_KINDS = {"F": "forward", "B": "backward", "W": "weight gradients"}


class _Pipeline:
    """State of one forward-backward call on this rank (the configuration's part: ``setup``)."""

    def __init__(self, setup: _Setup, *, config, pg_collection, peers: Peers, forward_step_func,
                 chunks, data, collect_non_loss_data, first_val_step, recorder, documents=None,
                 microbatch_lengths=None):
        self.setup = setup
        self.forward_step_func = forward_step_func
        self.chunks = chunks
        self.device = _device()
        self.data = data
        self.config = config
        self.m = setup.num_microbatches
        self.k = len(setup.lengths)
        self.forward_only = setup.forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.peers = peers
        self.pg_collection = pg_collection
        self.steps = setup.steps
        self.recorder = recorder
        cp_group = pg_collection.cp
        cp = cp_group.size() if cp_group is not None else 1
        self.run = SegmentRun(setup.lengths, forward_only=setup.forward_only,
                              documents=documents, microbatch_lengths=microbatch_lengths,
                              cp_group=cp_group if cp > 1 else None,
                              cp_meter=getattr(recorder, "cp_bytes", None))
        self.microbatch_shapes = None if microbatch_lengths is None else [
            [(n // setup.divisor, setup.micro_batch_size, setup.hidden_size) for n in row]
            for row in microbatch_lengths]
        self.forward_data_store: list = []
        self.losses = SegmentLosses(self.m, self.k, cp, config.calculate_per_token_loss,
                                    self.device, cp_group if cp > 1 else None)
        self.stash: dict[tuple[int, int, int], tuple] = {}  # unit -> (input, output)
        self.outgoing: dict = {}  # message -> tensor to send in the next step
        self.inbox: dict = {}  # received tensors waiting for their unit
        self.no_sync_context = None
        self.forwards_done = 0
        self.weight_grads = (wgrad.WeightGradStore(chunks, te_layers=setup.delayed_te_layers())
                             if setup.splits_backward else None)
        self.final_grad_actions = setup.final_grad_actions
        self.last_grad_action = setup.last_grad_action
        self.checkpoint_window = (
            setup.first_backward + 1
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

    def forward(self, unit: _Unit, input_tensor):
        action, config = unit.action, self.config
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
        if action.segment == self.k - 1 and self.data[action.chunk] is not None:
            self.data[action.chunk].release(action.microbatch)
        if unit.last_stage:
            output = self._loss(action, output, loss_func)
        if config.timers is not None:
            config.timers("forward-compute").stop()
        return output

    def _loss(self, action: Action, output, loss_func):
        """Last stage: keep the loss for backward, store the report (Megatron's cases)."""
        if loss_func is None:
            self.forward_data_store.append(output)
            return output
        if self.collect_non_loss_data:
            self.forward_data_store.append(loss_func(output, non_loss_data=True))
            return output
        loss, report = self.losses.record(action, loss_func(output))
        self.forward_data_store.append(report)
        return loss

    def backward(self, unit: _Unit, input_tensor, output_tensor, output_grad):
        """Megatron's backward step (input gradients only when the schedule splits off W)."""
        action = unit.action
        self._grad_sync_before(action)
        if unit.last_stage:
            output_tensor = self.losses.scaled(action)
        deferred = (self.weight_grads.input_grads_only(action.unit) if self.weight_grads
                    else contextlib.nullcontext())
        with self.run.backward(action.microbatch, action.segment, action.chunk), deferred:
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
        in_flight = InFlight(
            lambda output: deallocate_output_tensor(output, deallocate))
        sent_outputs = []
        for index, (step, units) in enumerate(zip(self.steps, self.setup.units)):
            start = recorder.now() if record is not None else 0.0
            self.inbox.update(exchange(step, index, self.peers, self.outgoing, self.make_buffer,
                                       in_flight, sent_outputs))
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

    def compute(self, unit: _Unit, in_flight: InFlight):
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
        peers = self.peers
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
    rehearse: tuple[int, int] | None = None,
    documents=None,
) -> list:
    """Seq1F1B forward-backward with Megatron-Core's schedule signature (plus our options).

    ``rehearse=(num_stages, stage)``: run that stage's steps of a ``num_stages`` pipeline
    on this rank alone, with made-up receives and dropped sends
    (:mod:`megatron_seq1f1b.rehearse`); the model must be that stage's chunk(s).
    ``documents``: where each micro-batch's packed documents are
    (:data:`~megatron_seq1f1b.document_plan.DocumentSource`); read on the first
    stage and sent to every rank before the iteration (:mod:`megatron_seq1f1b.document_plan`).
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
    if rehearse is None:
        p2p_communicator, pg_collection = _process_groups(config, p2p_communicator,
                                                          pg_collection)
        peers = Peers.build(p2p_communicator, config, wraparound=len(chunks) > 1)
    else:
        pg_collection, peers = _rehearsal_groups(config, *rehearse)
    setup = _setup_for(
        chunks, config, iterators, pg_collection, peers,
        num_microbatches=num_microbatches,
        seq_length=decoder_seq_length if decoder_seq_length is not None else seq_length,
        micro_batch_size=micro_batch_size, forward_only=forward_only, num_splits=num_splits,
        partition=partition, split_lengths=None if split_lengths is None else tuple(split_lengths),
        schedule=schedule, segment_costs=segment_costs,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, segment_multiple=segment_multiple,
        documents=documents)
    if peers.pp_size > 1 and rehearse is None:
        _agree_across_stages(pg_collection.pp, setup.agreement, setup.lengths,
                             num_microbatches, schedule)
    device = _device()
    data = [SegmentData(it, device) if it is not None else None for it in iterators]
    found, microbatch_lengths = None, None
    if setup.documents is not None:
        found = gather_documents(
            setup.documents, data[0], num_microbatches,
            decoder_seq_length if decoder_seq_length is not None else seq_length,
            micro_batch_size, pg_collection, peers.pp_rank, rehearsal=rehearse is not None)
        if setup.document_costs is not None:
            microbatch_lengths = [
                split_documents(docs, len(setup.lengths), setup.document_costs,
                                multiple_of=setup.document_multiple) for docs in found]
    pipeline = _Pipeline(
        setup, config=config, pg_collection=pg_collection, peers=peers,
        forward_step_func=forward_step_func, chunks=chunks, data=data,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        recorder=recorder, documents=found, microbatch_lengths=microbatch_lengths,
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
