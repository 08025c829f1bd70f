"""What one configuration of the executor computes once: checks, lengths, steps, groups.

A forward-backward call's configuration (the model chunks, the config's scalar
fields, the layout and the call's arguments) decides everything here: the
segment lengths, every check (module walks included), this rank's steps and
each action's messages, the process groups. :func:`setup_for` computes it on
the first call of a configuration and keeps it in a small cache (16 entries)
keyed by the chunks (weak references: a dead model's entry can never match
again); the cached :class:`Setup` holds no model, config or process group.
Before the setup, on every call, the pipeline stages all-gather a fingerprint of
what it is computed from, the kind of each stage's attention and whether the stage
refuses the call for reasons of its own (:func:`agree_across_stages`,
:func:`stage_problems`): every stage then cuts from the same inputs, also one
without attention layers, and none goes on where another stops. The executor
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
from typing import Any, NamedTuple, Sequence

import torch

from megatron_seq1f1b.base.checks import (
    raise_if, rounding_multiple, rounding_multiple_of, segment_multiple_problems,
)
from megatron_seq1f1b.base.collection import collection_paused
from megatron_seq1f1b.base.checks import segment_multiple as segment_multiple_of
from megatron_seq1f1b.runtime import te_wgrad, wgrad
from megatron_seq1f1b.runtime.executor_checks import executor_problems, segment_length_problems
from megatron_seq1f1b.runtime.model_hooks import (
    AttentionKind, attention_kind, dense_attention, is_enabled, layer_pattern, model_num_layers,
    unwrap,
)
from megatron_seq1f1b.runtime.p2p import Peers
from megatron_seq1f1b.schedules import plan as plan_mod
from megatron_seq1f1b.schedules.partition import (
    METHODS, CostModel, split_documents, split_documents_by_budget, split_sequence,
)
from megatron_seq1f1b.schedules.schedule import SCHEDULES, Action
from megatron_seq1f1b.schedules.steady import executor_plan, whole_plan
from megatron_seq1f1b.schedules.variable import (
    cut_microbatch, length_problems, segment_count, segment_tokens_problems,
)
from megatron_seq1f1b.schedules.zero_bubble import segment_cost_problems
from megatron_seq1f1b.segments.cp_group import StandInGroup, is_stand_in
from megatron_seq1f1b.segments.document_plan import source_problems


@functools.lru_cache(maxsize=64)
def pipeline_steps(
    num_stages: int, num_microbatches: int, num_splits: int, num_chunks: int, forward_only: bool,
    schedule: str = "1f1b", costs: tuple | None = None,
) -> tuple:
    """Every rank's steps (a pure function of the sizes; cached across iterations).

    ``costs``: per-segment (F, B, W) estimates that place zero-bubble W actions and
    the receives; a plan built from them is replayed (validated) before use. Many
    micro-batches cost what a few do: the steps of a few small counts give every rank's
    warm-up, repeated steady state and cool-down, which are repeated out
    (:func:`~megatron_seq1f1b.schedules.steady.executor_plan`, which says what is checked).
    """
    periodic = executor_plan(num_stages, num_microbatches, num_splits, num_chunks, schedule,
                             costs, forward_only)
    if periodic is not None:
        copies = periodic.copies(num_microbatches)
        return tuple(tuple(periodic.rank_items(rank, copies)) for rank in range(num_stages))
    steps = whole_plan(num_stages, num_microbatches, num_splits, num_chunks, schedule, costs,
                       forward_only)
    return tuple(tuple(rank) for rank in steps)


@functools.lru_cache(maxsize=64)
def rank_steps(num_stages, num_microbatches, num_splits, num_chunks, forward_only, rank,
               schedule: str = "1f1b", costs: tuple | None = None) -> tuple:
    """This rank's steps of :func:`pipeline_steps` (only this rank's are repeated out)."""
    periodic = executor_plan(num_stages, num_microbatches, num_splits, num_chunks, schedule,
                             costs, forward_only)
    if periodic is not None:
        return tuple(periodic.rank_items(rank, periodic.copies(num_microbatches)))
    return pipeline_steps(num_stages, num_microbatches, num_splits, num_chunks, forward_only,
                          schedule, costs)[rank]


def zero_bubble_costs(lengths, chunks, config, vocab_size,
                      attention: AttentionKind | None = None) -> tuple:
    """Per-segment (F, B, W) of this model from its FLOPs (:func:`flop_costs`), with the
    pipeline's ``attention`` (default: these chunks' own; the executor's stages agree on one)."""
    return flop_costs(lengths, model_cost(chunks, config, vocab_size, _dense(chunks, attention)))


def model_cost(chunks, config, vocab_size, dense_attention: bool = False) -> CostModel:
    """The whole model's FLOP costs (:meth:`CostModel.from_config`) on these chunks: a
    HybridModel's pattern, and a GPTModel stage built alone for a rehearsal counted with the
    model's layers, not only its own, so that it cuts and places W as the pipeline does."""
    layers = model_num_layers(chunks)
    if layers is not None and layers != config.num_layers:
        config = copy.copy(config)  # the config's fields alone, not a new validated one
        config.num_layers = layers
    return CostModel.from_config(config, vocab_size, dense_attention=dense_attention,
                                 pattern=layer_pattern(chunks))


def _dense(chunks, attention: AttentionKind | None) -> bool:
    """Whether a cut made outside the stage agreement counts masked scores: by the pipeline's
    ``attention`` where the caller knows it, else by these chunks' own layers."""
    return attention == AttentionKind.DENSE if attention is not None \
        else dense_attention(chunks)


def flop_costs(lengths, model: CostModel) -> tuple:
    """Per-segment (F, B, W) from a FLOP model (:class:`CostModel`), mean F = 1.

    W is the linear layers' weight GEMMs; B repeats those GEMMs for the input
    gradients and differentiates attention. Rounded so every rank derives the
    same numbers (and the same schedule) from the same configuration.
    """
    forwards = model.split_costs(list(lengths))
    mean = sum(forwards) / len(forwards)
    ends = itertools.accumulate(lengths)
    return tuple(
        (round(f / mean, 4),) + tuple(round(x / mean, 4) for x in model.backward_parts(n, end))
        for f, n, end in zip(forwards, lengths, ends)
    )


def resolve_lengths(num_splits: int, partition: str, split_lengths, seq_length: int, chunks,
                    config, vocab_size, segment_multiple: int | None = None,
                    attention: AttentionKind | None = None) -> list[int]:
    """The segment lengths the executor uses: given ones, else ``split_sequence`` for this model,
    rounded to :func:`~megatron_seq1f1b.base.checks.rounding_multiple` (64 on CUDA by default).

    (Benchmarks and a stage rehearsed alone call this; ``attention``: the pipeline's kind,
    which a stage without attention layers cannot see in its own chunks (default: theirs).
    The executor cuts with :func:`cut_lengths` and the attention its stages agreed on.)
    """
    costs = (model_cost(chunks, config, vocab_size, _dense(chunks, attention))
             if partition == "balanced" and split_lengths is None else None)
    multiple = rounding_multiple(config, seq_length, num_splits, segment_multiple)
    return cut_lengths(num_splits, partition, split_lengths, seq_length, costs, multiple)


def cut_lengths(num_splits: int, partition: str, split_lengths, seq_length: int,
                costs: CostModel | None, multiple: int) -> list[int]:
    """Given lengths, else ``split_sequence`` (``costs``: the balanced partition's FLOP model).

    A function of its arguments alone, and the stages agree on those: every stage cuts alike.
    """
    if split_lengths is not None:
        return [int(n) for n in split_lengths]
    return split_sequence(seq_length, num_splits, partition, multiple_of=multiple,
                          cost=costs if partition == "balanced" else None)


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
        # the stages of variable-length micro-batches agree on their lengths over it
        pg_collection.mp = parallel_state.get_model_parallel_group(check_initialized=False)
    if p2p_communicator is None:
        p2p_communicator = P2PCommunicator(pp_group=pg_collection.pp, config=config)
    return p2p_communicator, pg_collection


def length_group(pg_collection):
    """The ranks that agree on variable micro-batch lengths: this replica's tensor- and
    pipeline-parallel ranks (:mod:`megatron_seq1f1b.segments.length_plan`)."""
    group = getattr(pg_collection, "mp", None)
    if group is not None:
        return group
    tp = pg_collection.tp
    if tp is None or tp.size() == 1:
        return pg_collection.pp
    raise_if(["variable_seq_lengths with tensor parallelism and a pg_collection without 'mp' "
              "(the tensor- and pipeline-parallel group): set pg_collection.mp, over which the "
              "stages agree on every micro-batch's length"])


class Facts(NamedTuple):
    """What this stage brings to the stage agreement, computed once per configuration without
    communication (:func:`stage_facts`).

    ``shared`` fingerprints every input of the segment lengths, the zero-bubble costs and the
    p2p shapes: the inputs, not the lengths, since a stage without attention layers cannot cut
    alone. ``attention`` (this stage's own) goes beside it, and every stage cuts with the kind
    of the stages that have attention.
    """

    shared: tuple[int, ...]  # m, k, model chunks, forward_only, seq_length, digest of the rest
    attention: AttentionKind
    reads_attention: bool  # the cut or the zero-bubble costs weigh attention by its kind
    costs: CostModel  # the whole model's FLOPs, from its config; the agreed kind comes later
    multiple: int  # what segment lengths round to (rounding_multiple)
    document_multiple: int  # what the documents partition rounds its cuts to
    described: str  # this stage's call, for the message when stages differ
    problems: tuple[str, ...] = ()  # what only this stage finds wrong (:func:`stage_problems`)


def agree_across_stages(pp_group, facts: Facts) -> bool:
    """All pipeline ranks cut and schedule alike, or all fail here, before any p2p message;
    returns whether the cut counts dense attention (the kind the stages have).

    One tiny all-gather per call, read at once: a rank whose configuration
    changed alone must stop everyone with this error, not leave its peers
    waiting in a transfer of the wrong shape; a stage that refuses the call
    for its own reasons (:func:`stage_problems`) stops everyone alike. Reading
    it waits for the device, once per iteration, where training loops wait anyway (the previous
    optimizer step's norms and losses); pipeline size 1 skips it. A stage
    without attention layers takes the kind of those that have them; where the
    cut reads the kind and the stages' kinds differ, every stage refuses.
    """
    import torch.distributed as dist

    mine = facts.shared + (int(facts.attention), int(bool(facts.problems)))
    local = torch.tensor(mine, dtype=torch.int64, device=device())
    gathered = torch.empty(pp_group.size() * len(mine), dtype=torch.int64, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=pp_group)
    table = gathered.view(pp_group.size(), len(mine)).tolist()
    refusing = [stage for stage, row in enumerate(table) if row[-1]]
    rows = [row[:-1] for row in table]  # the shared facts and the attention kind
    if refusing and not facts.problems:  # this stage's own: all at once, in build_setup
        raise_if([f"pipeline stage(s) {refusing} refused this call (their own errors say why): "
                  "every stage stops here, before any p2p message"])
    kinds = [AttentionKind(row[-1]) for row in rows]
    problems = []
    differ = [stage for stage, row in enumerate(rows) if row[:-1] != rows[0][:-1]]
    if differ:
        problems.append(
            f"pipeline stages {differ} run a different schedule than stage 0 (num_microbatches, "
            f"num_splits, partition, split_lengths, segment_multiple, schedule, model chunks, "
            f"forward_only, seq_length or the model's shape differ: {rows[0][:-1]} vs "
            f"{[rows[d][:-1] for d in differ]}); this stage has {facts.described}")
    if facts.reads_attention and len(set(kinds) - {AttentionKind.NONE}) > 1:
        stages = "; ".join(f"stage {stage}: {kind.describe()}" for stage, kind in enumerate(kinds))
        problems.append(
            f"pipeline stages use different core attention ({stages}), and this call's segment "
            "lengths (partition 'balanced' or 'documents') or zero-bubble costs weigh attention "
            "by it, so the stages would cut differently: build every stage with the same core "
            "attention (one transformer_layer_spec), or pass split_lengths (and segment_costs "
            "for a zero-bubble schedule)")
    raise_if(problems)
    return AttentionKind.DENSE in kinds


def stage_facts(chunks, config, pg_collection, *, num_microbatches, seq_length,
                micro_batch_size, forward_only, num_splits, partition, split_lengths, schedule,
                segment_costs, adjust_tensor_shapes_fn, segment_multiple=None,
                documents=None, segment_tokens=None, variable=False) -> Facts:
    """Check the call's arguments and fingerprint what the setup is computed from (no
    communication: it runs before the stages agree). ``variable``: micro-batches of
    different lengths (``config.variable_seq_lengths``; ``seq_length`` is then None)."""
    from megatron.core.utils import get_attr_wrapped_model

    del adjust_tensor_shapes_fn  # checked with the setup
    if not isinstance(num_splits, int) or num_splits < 1:
        raise_if([f"num_splits must be a positive integer, got {num_splits!r}"])
    if partition not in METHODS:
        raise_if([f"unknown partition {partition!r}; choose one of {METHODS}"])
    if schedule not in SCHEDULES:
        raise_if([f"unknown schedule {schedule!r}; choose one of {SCHEDULES}"])
    if segment_costs is not None:
        raise_if(segment_cost_problems(segment_costs, num_splits))
        segment_costs = tuple(tuple(float(x) for x in row) for row in segment_costs)
    raise_if(segment_multiple_problems(segment_multiple))
    raise_if(segment_tokens_problems(segment_tokens))
    if variable:
        raise_if(variable_problems(split_lengths, segment_costs, partition))
    raise_if(document_problems(documents, partition, split_lengths, micro_batch_size))
    if documents == "cu_seqlens" and (getattr(config, "context_parallel_size", 1) or 1) > 1:
        raise_if(["packed (THD) documents with context parallelism are not supported (each "
                  "document would need its own CP split); give documents by end-of-document "
                  "tokens, or use context_parallel_size=1"])
    if documents == "cu_seqlens" and getattr(config, "apply_rope_fusion", False) and any(
            getattr(unwrap(chunk), "position_embedding_type", None) == "rope" for chunk in chunks):
        raise_if(["packed (THD) documents with apply_rope_fusion: the fused THD RoPE kernel "
                  "starts every piece of a document at position 0, also the part that crossed "
                  "into a segment from earlier ones; set apply_rope_fusion=False "
                  "(--no-rope-fusion)"])
    try:
        vocab_size = get_attr_wrapped_model(chunks[0], "vocab_size")
    except RuntimeError:
        vocab_size = None
    costs = model_cost(chunks, config, vocab_size)
    if variable:  # each micro-batch rounds alone, by its own length and count
        multiple = _document_multiple(config, segment_multiple)
    else:  # with a budget, the count the budget gives (num_splits is its cap)
        count = num_splits if segment_tokens is None or not isinstance(seq_length, int) \
            else segment_count(seq_length, num_splits, segment_tokens,
                               segment_multiple_of(config))
        multiple = rounding_multiple(config, seq_length, count, segment_multiple)
    document_multiple = _document_multiple(config, segment_multiple)
    cp = pg_collection.cp.size() if pg_collection.cp is not None else 1
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    split_lengths = None if split_lengths is None else tuple(int(n) for n in split_lengths)
    rest = repr((partition, split_lengths, schedule, segment_costs, _named(documents), multiple,
                 document_multiple, dataclasses.astuple(costs), micro_batch_size,
                 config.hidden_size, cp * tp, segment_tokens, bool(variable))).encode()
    shared = (_number(num_microbatches), num_splits, len(chunks), int(bool(forward_only)),
              _number(seq_length), int.from_bytes(hashlib.sha256(rest).digest()[:7], "big"))
    cut_reads = num_splits > 1 and split_lengths is None and partition in ("balanced", "documents")
    described = (f"m={num_microbatches}, num_splits={num_splits}, partition={partition!r}, "
                 f"split_lengths={None if split_lengths is None else list(split_lengths)}, "
                 f"segment_multiple={segment_multiple}, schedule={schedule}")
    if segment_tokens is not None or variable:
        described += f", segment_tokens={segment_tokens}, variable_seq_lengths={bool(variable)}"
    return Facts(
        shared=shared, attention=attention_kind(chunks),
        reads_attention=cut_reads or (schedule != "1f1b" and not forward_only
                                      and segment_costs is None),
        costs=costs, multiple=multiple, document_multiple=document_multiple,
        described=described,
    )


def variable_problems(split_lengths, segment_costs, partition: str) -> list[str]:
    """What variable-length micro-batches cannot take: one cut or one cost row for all."""
    problems = []
    if split_lengths is not None:
        problems.append("split_lengths fixes one cut for every micro-batch; with "
                        "variable_seq_lengths each micro-batch is cut by its own length: use "
                        "num_splits or segment_tokens with a partition")
    if segment_costs is not None:
        problems.append("segment_costs are one (F, B, W) row for every micro-batch; with "
                        "variable_seq_lengths the zero-bubble schedule places W by each "
                        "micro-batch's FLOPs: leave segment_costs out")
    if partition == "measured":
        problems.append("partition 'measured' cuts with calibrated costs the executor does not "
                        "have; with variable_seq_lengths use 'balanced', 'uniform' or "
                        "'documents'")
    return problems


def _named(documents):
    """The documents source as every stage names it: a callable by its qualified name (its
    repr holds an address, different in every process)."""
    if not callable(documents):
        return documents
    return (f"{getattr(documents, '__module__', '')}."
            f"{getattr(documents, '__qualname__', type(documents).__qualname__)}")


def _number(value) -> int:
    """An integer argument as the agreement carries it; -1 for anything else (the checks that
    follow the agreement say what is wrong with it)."""
    return value if isinstance(value, int) else -1


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
class StepPlan:
    """This rank's steps for one set of segment counts (:func:`step_plan`)."""

    counts: tuple[int, ...]  # segments per micro-batch
    steps: tuple[plan_mod.Step, ...]
    units: tuple[tuple[Unit, ...], ...]  # per step
    final_grad_actions: frozenset
    last_grad_action: dict
    first_backward: int  # index of this rank's first backward action (or the action count)


@functools.lru_cache(maxsize=16)
def step_plan(pp_size: int, pp_rank: int, num_microbatches: int, counts: tuple[int, ...],
              num_chunks: int, forward_only: bool, schedule: str = "1f1b",
              costs: tuple | None = None) -> StepPlan:
    """This rank's steps, units and grad-sync actions for ``counts`` segments per micro-batch
    (a pure function of its arguments; cached, so iterations of one configuration, or
    variable-length ones with the same counts, reuse it). Counts that differ between
    micro-batches have no steady state to repeat: every rank's steps are built whole, once,
    with the collector paused, and only this rank's kept."""
    if len(set(counts)) > 1:
        with collection_paused():
            steps = whole_plan(pp_size, num_microbatches, counts, num_chunks, schedule, costs,
                               forward_only)[pp_rank]
    else:
        steps = rank_steps(pp_size, num_microbatches, counts[0], num_chunks, forward_only,
                           pp_rank, schedule, costs)
    topology = plan_mod.Topology(pp_size, num_chunks)
    last_virtual = topology.last_virtual_stage
    units = tuple(
        tuple(Unit(a, plan_mod.input_message(a, pp_rank, topology),
                   plan_mod.output_message(a, pp_rank, topology),
                   topology.virtual_stage(pp_rank, a.chunk) == last_virtual)
              for a in step.actions)
        for step in steps)
    actions = [a for step in steps for a in step.actions]
    final, last = _final_grad_actions(actions)
    return StepPlan(
        counts=counts, steps=tuple(steps), units=units, final_grad_actions=frozenset(final),
        last_grad_action=last,
        first_backward=next((i for i, a in enumerate(actions) if a.is_backward), len(actions)))


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one configuration computes once (see the module docstring).

    It holds no model, config or process group (it must not keep them alive once the user
    drops them); the process groups are looked up per call, which costs microseconds.
    With fixed-length micro-batches ``plan`` holds the steps; with variable lengths
    (``variable``) each iteration cuts its micro-batches (:meth:`cut`) and takes the
    plan of their segment counts (:meth:`plan_for`).
    """

    lengths: tuple[int, ...]  # the segments of every micro-batch (fixed lengths), else ()
    num_microbatches: int
    forward_only: bool
    plan: StepPlan | None  # fixed lengths; None with variable lengths
    shapes: tuple[tuple[int, int, int], ...]  # per segment: [tokens on this rank, b, h]
    splits_backward: bool
    te_layers: tuple  # per chunk, weak references to TE layers with delayed weight gradients
    # Packed documents (plan data read every iteration), and with the ``documents`` partition
    # what cuts each micro-batch: the FLOP cost model and the layout's multiple.
    documents: Any = None
    document_costs: CostModel | None = None
    document_multiple: int = 1
    divisor: int = 1  # a segment's tokens over this rank's share of them (CP x SP)
    micro_batch_size: int = 1
    hidden_size: int = 0
    # Variable-length micro-batches (``config.variable_seq_lengths``): how each is cut.
    variable: bool = False
    num_splits: int = 1  # segments per micro-batch; with segment_tokens the most
    split_cap: int = 1  # num_splits as asked (fixed lengths turn a budget into num_splits)
    segment_tokens: int | None = None
    partition: str = "uniform"
    cut_costs: CostModel | None = None  # the balanced partition's and zero-bubble's FLOPs
    own_multiple: int = 1  # the layout's (segment_multiple); cuts round to it or more
    requested_multiple: int | None = None
    on_cuda: bool = False
    pp_size: int = 1
    pp_rank: int = 0
    num_chunks: int = 1
    schedule: str = "1f1b"

    def delayed_te_layers(self) -> list:
        return [[(name, ref()) for name, ref in chunk] for chunk in self.te_layers]

    def cut(self, seq_lengths: Sequence[int], documents=None,
            runs_apart: bool = False) -> tuple[tuple[int, ...], ...]:
        """Variable lengths: every micro-batch's segment lengths (uniform, balanced, or by
        its ``documents``), the same function of the same lengths on every rank.
        ``runs_apart`` (backward_by_documents): the documents partition with a budget cuts
        where documents end wherever it can."""
        raise_if(length_problems(seq_lengths, self.own_multiple))
        by_documents = self.document_costs is not None
        own = self.document_multiple if by_documents else self.own_multiple
        rows = []
        for index, length in enumerate(seq_lengths):
            count = segment_count(length, self.num_splits, self.segment_tokens, own)
            try:
                if by_documents and runs_apart and self.segment_tokens is not None:
                    rows.append(tuple(split_documents_by_budget(
                        documents[index], self.segment_tokens, self.document_costs,
                        multiple_of=own, max_splits=self.split_cap)))
                    continue
                if by_documents:
                    rows.append(tuple(split_documents(documents[index], count,
                                                      self.document_costs, multiple_of=own)))
                    continue
                multiple = rounding_multiple_of(own, length, count, self.requested_multiple,
                                                self.on_cuda)
                rows.append(cut_microbatch(length, count, self.partition, self.cut_costs,
                                           multiple))
            except ValueError as exc:
                raise_if([f"variable-length micro-batches: micro-batch {index} ({length} "
                          f"tokens) cannot be cut: {exc}"])
        return tuple(rows)

    def plan_for(self, rows: Sequence[Sequence[int]]) -> StepPlan:
        """The steps for these segment lengths, one row per micro-batch of the schedule (variable
        lengths, or runs of documents): cached by their counts, and by the lengths where a
        zero-bubble schedule places W by their FLOPs."""
        counts = tuple(len(row) for row in rows)
        costs = None
        if self.splits_backward:
            costs = tuple(flop_costs(row, self.cut_costs) for row in rows)
        return step_plan(self.pp_size, self.pp_rank, len(counts), counts,
                         self.num_chunks, self.forward_only, self.schedule, costs)


_SETUPS: "collections.OrderedDict[tuple, Setup]" = collections.OrderedDict()
_FACTS: "collections.OrderedDict[tuple, Facts]" = collections.OrderedDict()
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
    _FACTS.clear()
    step_plan.cache_clear()


def _cached(cache: collections.OrderedDict, key):
    """The entry of ``key`` (None: an unhashable call, never cached), now the most recent."""
    value = cache.get(key) if key is not None else None
    if value is not None:
        cache.move_to_end(key)
    return value


def _remember(cache: collections.OrderedDict, key, value) -> None:
    if key is not None:
        cache[key] = value
        while len(cache) > _MAX_SETUPS:
            cache.popitem(last=False)


def setup_for(chunks, config, iterators, pg_collection, peers: Peers, **arguments) -> Setup:
    """The cached setup of this configuration, or a new one (checked), once the stages agreed.

    Keyed by the chunks (weakly: a dead model's entry can never match again), the
    config's identity and scalar fields, the layout and the call's arguments; this
    stage's :class:`Facts` under that key, the setup under it and the agreed attention.
    The agreement runs on every call of a pipeline (not of a stage rehearsed alone)
    and never inside a cache miss: a rank that lost an entry alone rebuilds it alone.
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
    facts = _cached(_FACTS, key)
    if facts is None:
        facts = stage_facts(chunks, config, pg_collection, **arguments)
        facts = facts._replace(problems=tuple(stage_problems(
            chunks, config, iterators, peers.pp_size, facts, **arguments)))
        if not facts.problems:  # a refused call is checked again (the model may be enabled)
            _remember(_FACTS, key, facts)
    if peers.pp_size > 1 and not is_stand_in(pg_collection.pp):
        dense = agree_across_stages(pg_collection.pp, facts)
    else:
        pipeline = getattr(pg_collection.pp, "attention", None)
        dense = rehearsed_attention(facts, pipeline, layer_pattern(chunks)) == AttentionKind.DENSE
    setup_key = None if key is None or facts.problems else (key, dense)
    setup = _cached(_SETUPS, setup_key)
    if setup is None:
        setup = build_setup(chunks, config, iterators, pg_collection, peers, facts, dense,
                            **arguments)
        _remember(_SETUPS, setup_key, setup)
    return setup


def _effective_splits(num_splits: int, seq_length, segment_tokens, facts: Facts,
                      variable: bool) -> int:
    """Segments per micro-batch: ``num_splits``, or with a token budget the count it gives a
    micro-batch of ``seq_length`` tokens (variable lengths, or no length: the cap)."""
    if variable or segment_tokens is None or not isinstance(seq_length, int):
        return num_splits
    return segment_count(seq_length, num_splits, segment_tokens, facts.multiple)


def stage_problems(chunks, config, iterators, pp_size: int, facts: Facts, *, num_microbatches,
                   seq_length, num_splits, schedule, forward_only, adjust_tensor_shapes_fn,
                   segment_tokens=None, variable=False, **_) -> list[str]:
    """What this stage's own chunks, iterators and layers make wrong with the call: found before
    the stages agree, which tells every stage, so that none goes on into a p2p transfer that
    the refusing stage never joins (checks of the agreed facts come after, alike everywhere)."""
    count = _effective_splits(num_splits, seq_length, segment_tokens, facts, variable)
    problems = executor_problems(chunks, iterators, config, num_microbatches, count, None,
                                 seq_length, pp_size, adjust_tensor_shapes_fn,
                                 count == 1 or is_enabled(chunks))
    if schedule != "1f1b" and not forward_only:
        problems += wgrad.deferral_problems(chunks, count)
    elif not forward_only:
        problems += wgrad.without_w_problems(chunks)
    return problems


def build_setup(chunks, config, iterators, pg_collection, peers, facts: Facts, dense: bool, *,
                num_microbatches, seq_length, micro_batch_size, forward_only, num_splits,
                partition, split_lengths, schedule, segment_costs, adjust_tensor_shapes_fn,
                segment_multiple=None, documents=None, segment_tokens=None,
                variable=False) -> Setup:
    """Check the configuration (all problems at once) and derive this rank's steps from the
    agreed facts (``dense``: the stages' attention computes masked scores too)."""
    pp_size, pp_rank = peers.pp_size, peers.pp_rank
    by_documents = partition == "documents" and split_lengths is None
    flops = dataclasses.replace(facts.costs, dense_attention=dense)
    lengths: list[int] = []
    split_cap = num_splits
    problems = list(facts.problems)  # this stage's own (stage_problems), with the cut's: at once
    if not variable:  # with a token budget, every micro-batch has seq_length tokens
        num_splits = _effective_splits(num_splits, seq_length, segment_tokens, facts, variable)
        try:
            # The documents partition cuts each micro-batch by its own documents; its nominal
            # lengths (uniform) stand for it where one set is needed (checks, zero-bubble costs).
            lengths = cut_lengths(num_splits, "uniform" if by_documents else partition,
                                  split_lengths, seq_length, flops, facts.multiple)
        except ValueError as exc:
            problems.append(f"num_splits={num_splits} with seq_length={seq_length}: {exc}")
        else:
            if len(lengths) != num_splits:
                problems.append(f"split_lengths has {len(lengths)} entries but num_splits is "
                                f"{num_splits}")
            if segment_multiple is not None and any(n % facts.multiple for n in lengths):
                problems.append(f"split_lengths {list(lengths)} are not all multiples of "
                                f"segment_multiple={segment_multiple} (with the layout's own "
                                f"multiple: {facts.multiple})")
            problems += segment_length_problems(lengths, seq_length, config)
    raise_if(problems)
    if len(chunks) > 1:
        from megatron_seq1f1b.schedules.interleaved import interleaved_problems

        raise_if(interleaved_problems(pp_size, num_microbatches, num_splits, len(chunks),
                                      schedule, forward_only))
    if schedule != "1f1b" and not forward_only:
        wgrad.install()

    plan = None
    if not variable:
        costs = None
        if schedule != "1f1b" and not forward_only:
            # the planner's measured costs place W as it predicted; else this model's FLOPs
            costs = (tuple(tuple(float(x) for x in row) for row in segment_costs)
                     if segment_costs is not None else flop_costs(lengths, flops))
        plan = step_plan(pp_size, pp_rank, num_microbatches, (num_splits,) * num_microbatches,
                         len(chunks), forward_only, schedule, costs)
    cp = pg_collection.cp.size() if pg_collection.cp is not None else 1
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    split = schedule != "1f1b" and not forward_only
    te_layers = tuple(tuple((name, weakref.ref(layer)) for name, layer in chunk)
                      for chunk in te_wgrad.delayed_layers(chunks)) if split else ()
    return Setup(
        documents=documents, document_costs=flops if by_documents else None,
        document_multiple=facts.document_multiple, divisor=cp * tp,
        micro_batch_size=micro_batch_size, hidden_size=config.hidden_size,
        lengths=tuple(lengths), num_microbatches=num_microbatches, forward_only=forward_only,
        plan=plan,
        shapes=tuple((n // cp // tp, micro_batch_size, config.hidden_size) for n in lengths),
        splits_backward=split, te_layers=te_layers,
        variable=variable, num_splits=num_splits, split_cap=split_cap,
        segment_tokens=segment_tokens,
        partition=partition, cut_costs=flops, own_multiple=facts.multiple,
        requested_multiple=segment_multiple, on_cuda=torch.cuda.is_available(),
        pp_size=pp_size, pp_rank=pp_rank, num_chunks=len(chunks), schedule=schedule,
    )


def document_cut(chunks, config, vocab_size, segment_multiple=None,
                 attention: AttentionKind | None = None) -> tuple[CostModel, int]:
    """What the documents partition cuts a micro-batch with: this model's FLOP costs (as the
    pipeline's ``attention`` computes them; default: these chunks' own) and the layout's
    multiple (a requested one too; the CUDA default of 64 is not forced on cuts that could
    fall where documents end)."""
    return (model_cost(chunks, config, vocab_size, _dense(chunks, attention)),
            _document_multiple(config, segment_multiple))


def _document_multiple(config, segment_multiple: int | None) -> int:
    return (segment_multiple_of(config) if segment_multiple is None
            else math.lcm(int(segment_multiple), segment_multiple_of(config)))


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


def rehearsal_groups(config, num_stages: int, stage: int,
                     attention: AttentionKind | None = None):
    """This rank's process groups with the pipeline group standing in for ``num_stages`` (and the
    context-parallel group for the config's ``context_parallel_size``); the stand-in pipeline
    group holds the pipeline's ``attention`` (:func:`rehearsed_attention`)."""
    if not (isinstance(num_stages, int) and isinstance(stage, int) and 0 <= stage < num_stages):
        raise_if([f"rehearse=(num_stages, stage) needs 0 <= stage < num_stages, got "
                  f"({num_stages!r}, {stage!r})"])
    if attention is not None and attention not in list(AttentionKind):
        raise_if([f"rehearse=(num_stages, stage, attention): attention must be an AttentionKind, "
                  f"got {attention!r}"])
    _, pg_collection = process_groups(config, None, None)
    rehearsal = copy.copy(pg_collection)
    rehearsal.pp = _stand_in_group(num_stages, stage,  # one object: the setup cache keys it
                                   None if attention is None else AttentionKind(attention))
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1 and (pg_collection.cp is None or pg_collection.cp.size() == 1):
        rehearsal.cp = _stand_in_group(cp, 0)  # rank 0 of the CP group, made-up peers
    return rehearsal, Peers.stand_ins(num_stages, stage)


@functools.lru_cache(maxsize=None)
def _stand_in_group(size: int, rank: int, attention: AttentionKind | None = None) -> StandInGroup:
    return StandInGroup(size, rank, attention)


def rehearsed_attention(facts: Facts, pipeline: AttentionKind | None,
                        pattern: str | None) -> AttentionKind:
    """The attention a stage rehearsed alone cuts with: the pipeline's (what its stages would
    agree on, and checked as the agreement checks: a stage with attention of another kind
    is refused where the cut reads it), else the stage's own. A stage without attention
    layers in a model that has them elsewhere cannot know their kind: where its cut reads
    it, it is refused unless told."""
    own = facts.attention
    if not facts.reads_attention:
        return own if pipeline is None else AttentionKind(pipeline)
    if pipeline is None:
        elsewhere = pattern is None or any(symbol in pattern for symbol in "*+")
        if own == AttentionKind.NONE and elsewhere:
            raise_if(["this rehearsed stage has no attention layer, and its segment lengths "
                      "(partition 'balanced' or 'documents') or zero-bubble costs weigh "
                      "attention by the kind the other stages have: pass it "
                      "(rehearse=(num_stages, stage, AttentionKind...), rehearse_stage's "
                      "attention=), or split_lengths"])
        return own
    if own not in (AttentionKind.NONE, pipeline):
        raise_if([f"this rehearsed stage has {own.describe()}, but the pipeline it stands for "
                  f"has {AttentionKind(pipeline).describe()}; its segment lengths or "
                  "zero-bubble costs weigh attention by that kind, so the real stages would "
                  "refuse to run together: build the stage with the pipeline's attention"])
    return AttentionKind(pipeline)
