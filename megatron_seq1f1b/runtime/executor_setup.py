"""What one configuration of the executor computes once: checks, lengths, steps, groups.

A forward-backward call's configuration (the model chunks, the config's scalar
fields, the layout and the call's arguments) decides everything here: the
segment lengths, every check (module walks included), this rank's steps and
each action's messages, the process groups. :func:`setup_for` computes it on
the first call of a configuration and keeps it in a small cache (16 entries)
keyed by the chunks (weak references: a dead model's entry can never match
again); the cached :class:`Setup` holds no model, config or process group.
Before the first message of an iteration the pipeline stages all-gather a
fingerprint of it (:func:`agree_across_stages`). The executor
(:mod:`megatron_seq1f1b.runtime.executor`) then only runs the steps.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import hashlib
import itertools
import math
import weakref
from typing import Any, NamedTuple

import torch

from megatron_seq1f1b.base.checks import (
    raise_if, rounding_multiple, segment_multiple_problems,
)
from megatron_seq1f1b.base.checks import segment_multiple as segment_multiple_of
from megatron_seq1f1b.runtime import te_wgrad, wgrad
from megatron_seq1f1b.runtime.executor_checks import executor_problems
from megatron_seq1f1b.runtime.model_hooks import dense_attention, is_enabled, unwrap
from megatron_seq1f1b.runtime.p2p import Peers
from megatron_seq1f1b.schedules import plan as plan_mod
from megatron_seq1f1b.schedules.partition import METHODS, CostModel, split_sequence
from megatron_seq1f1b.schedules.replay import replay
from megatron_seq1f1b.schedules.schedule import SCHEDULES, Action, build_schedule, splits_backward
from megatron_seq1f1b.schedules.validate import check_link_order
from megatron_seq1f1b.schedules.zero_bubble import segment_cost_fn, segment_cost_problems
from megatron_seq1f1b.segments.cp_group import StandInGroup
from megatron_seq1f1b.segments.document_plan import source_problems


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
    rounded to :func:`~megatron_seq1f1b.base.checks.rounding_multiple` (64 on CUDA by default).

    (Benchmarks call this too, so that they report the lengths that actually ran.)
    """
    if split_lengths is not None:
        return [int(n) for n in split_lengths]
    dense = partition == "balanced" and dense_attention(chunks)
    multiple = rounding_multiple(config, seq_length, num_splits, segment_multiple)
    return split_sequence(seq_length, num_splits, partition, config=config,
                          vocab_size=vocab_size, multiple_of=multiple, dense_attention=dense)


def process_groups(config, p2p_communicator, pg_collection):
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


def agree_across_stages(pp_group, mine: tuple, lengths, num_microbatches, schedule) -> None:
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


def device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


class Unit(NamedTuple):
    """One action of a step with what it receives and sends (computed once per configuration)."""

    action: Action
    input: plan_mod.Message | None
    output: plan_mod.Message | None
    last_stage: bool


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one configuration computes once (see the module docstring).

    It holds no model, config or process group (it must not keep them alive once the user
    drops them); the process groups are looked up per call, which costs microseconds.
    """

    lengths: tuple[int, ...]
    num_microbatches: int
    forward_only: bool
    steps: tuple[plan_mod.Step, ...]
    units: tuple[tuple[Unit, ...], ...]  # per step
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


_SETUPS: "collections.OrderedDict[tuple, Setup]" = collections.OrderedDict()
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


def setup_for(chunks, config, iterators, pg_collection, peers: Peers, **arguments) -> Setup:
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
    setup = build_setup(chunks, config, iterators, pg_collection, peers, **arguments)
    if key is not None:
        _SETUPS[key] = setup
        while len(_SETUPS) > _MAX_SETUPS:
            _SETUPS.popitem(last=False)
    return setup


def build_setup(chunks, config, iterators, pg_collection, peers, *,
                 num_microbatches, seq_length, micro_batch_size, forward_only, num_splits,
                 partition, split_lengths, schedule, segment_costs, adjust_tensor_shapes_fn,
                 segment_multiple=None, documents=None) -> Setup:
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
        from megatron_seq1f1b.schedules.interleaved import interleaved_problems

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
        tuple(Unit(a, plan_mod.input_message(a, pp_rank, topology),
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
    return Setup(
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


def rehearsal_groups(config, num_stages: int, stage: int):
    """This rank's process groups with the pipeline group standing in for ``num_stages`` (and the
    context-parallel group for the config's ``context_parallel_size``)."""
    if not (isinstance(num_stages, int) and isinstance(stage, int) and 0 <= stage < num_stages):
        raise_if([f"rehearse=(num_stages, stage) needs 0 <= stage < num_stages, got "
                  f"({num_stages!r}, {stage!r})"])
    _, pg_collection = process_groups(config, None, None)
    rehearsal = copy.copy(pg_collection)
    rehearsal.pp = _stand_in_group(num_stages, stage)  # one object: the setup cache keys it
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1 and (pg_collection.cp is None or pg_collection.cp.size() == 1):
        rehearsal.cp = _stand_in_group(cp, 0)  # rank 0 of the CP group, made-up peers
    return rehearsal, Peers.stand_ins(num_stages, stage)


@functools.lru_cache(maxsize=None)
def _stand_in_group(size: int, rank: int) -> StandInGroup:
    return StandInGroup(size, rank)
