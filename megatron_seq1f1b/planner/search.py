"""The planner's search: every (k, partition, schedule) predicted as the executor would run
it, and the fastest within the memory budget chosen (:func:`choose_plan`).

Time is what the executor would do: the zero-bubble schedules are built and
their receives placed from the plan's per-segment costs
(:attr:`Plan.segment_costs`, as the executor's ``pipeline_steps`` does with
its costs), and every rank's steps are replayed with the timing of the executor's
transport (``timing``, :data:`~megatron_seq1f1b.schedules.replay.TIMINGS`; by default
NCCL's links transport, where a step posts its transfers once the previous step's sends
completed; docs/design.md says why), a step that exchanges tensors paying the
calibration's message time. Plans the executor would refuse (deadlock, link order) are
left out.

The search costs the same for any number of micro-batches: a candidate is replayed over
a few copies of its steady state (:mod:`megatron_seq1f1b.schedules.steady`), its memory
counted on one; and it times only what its answer needs (:mod:`~.candidates` gives every
candidate a lower bound on its time, from its busiest rank's work and the pipeline's fill
and drain; before timing one, the search raises it to the bound of the candidate's orders,
:mod:`~megatron_seq1f1b.planner.order_bound`, and skips it where that already loses).
Candidates over the memory budget are not timed (unless they might be faster than the chosen
plan: the reason names the fastest of them). Without a tie tolerance the
fastest is the choice: candidates are timed least bound first until no bound can beat it.
With one, they are visited in the tie rule's order (1F1B first, then the partition, then
fewer splits): a plan is chosen once no other plan can be faster than its time over
``1 + tolerance`` (every other bound, and every time taken, at least that), passed over
once one is; in between the candidates whose bound is below that are timed, 1F1B's
first (and where the most robust plan's bound is out of the tolerance of the least bound,
1F1B's least bound before any, so that hopeless robust plans go untimed). The plan chosen
is the one timing every candidate gives (``exhaustive=True``, tested against it); the
candidates left untimed are counted in :class:`PlanChoice`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Sequence

from megatron_seq1f1b.base.checks import segment_multiple
from megatron_seq1f1b.base.collection import collection_paused
from megatron_seq1f1b.planner.candidates import (
    busy_time, memory_schedule, order_graph, predict_time, table_cost, time_lower_bound,
)
from megatron_seq1f1b.planner.choice import (
    PREFERRED_PARTITIONS, Plan, PlanChoice, BudgetError, _memory_key, _pick, _q, _rank_key,
    explain, need_text,
)
from megatron_seq1f1b.planner.costs import Calibration, action_cost_table, placement_costs
from megatron_seq1f1b.planner.memory_model import MemoryModel, activation_peak, bytes_text
from megatron_seq1f1b.schedules.partition import METHODS, CostModel, split_sequence
from megatron_seq1f1b.schedules.replay import TIMINGS, replay, timing_of
from megatron_seq1f1b.schedules.schedule import SCHEDULES, Schedule
from megatron_seq1f1b.schedules.simulate import CostFn, placed_steps

#: The replay's ``send_slack`` of the "slack" timing (a step's compute waits for its receives
#: and the previous step's sends), which the planner used for every transport before it timed
#: each transport as the executor runs it (:data:`RUNTIME_TIMING`).
RUNTIME_SEND_SLACK = 1
#: The timing the planner assumes by default: the executor's NCCL links transport.
RUNTIME_TIMING = "nccl"

__all__ = ["RUNTIME_SEND_SLACK", "RUNTIME_TIMING", "MAX_SPLITS", "predict", "split_counts",
           "choose_plan"]


def predict(schedule: Schedule, num_model_chunks: int, cost: CostFn,
            costs: Sequence[tuple[float, float, float]] | None = None,
            send_slack: int = 0, comm_latency: float = 0.0,
            timing: str | None = None) -> tuple[float, float]:
    """(makespan, bubble) of the executor's steps of a whole schedule: receives placed with
    ``costs`` (zero bubble) or unit costs, replayed with ``cost``, ``comm_latency`` per
    exchanging step and ``timing`` (or ``send_slack``); ScheduleError where it would refuse."""
    timeline = replay(placed_steps(schedule, num_model_chunks, costs), cost,
                      comm_latency=comm_latency, send_slack=send_slack, timing=timing)
    busy = sum(iv.end - iv.start for rank in timeline.compute for iv in rank)
    total = timeline.makespan * len(schedule)
    return timeline.makespan, (1.0 - busy / total if total else 0.0)


MAX_SPLITS = 16  # the most segments a plan tries (and the start-up measurement times)
#: Candidates with more forwards and backwards than this (over all ranks) keep their first
#: bound: their orders' (:mod:`~megatron_seq1f1b.planner.order_bound`) costs 1-2 us per
#: action here (its dataflow compiled once per k and schedule), and such long runs have
#: little bubble for it to see.
ORDER_BOUND_ACTIONS = 100_000


def split_counts(seq_length: int, multiple_of: int, min_segment_length: int,
                 max_splits: int = MAX_SPLITS) -> list[int]:
    """The k a plan may use: 1 up to the most whose segments keep min_segment_length."""
    limit = min(max_splits, seq_length // max(min_segment_length, 1), seq_length // multiple_of)
    return list(range(1, max(limit, 1) + 1))


@dataclass
class _Candidate:
    """One (k, partition, schedule) before and after it is timed."""

    order: int  # enumeration order: ties between equal bounds go the same way everywhere
    partition: str
    lengths: tuple[int, ...]
    schedule: str
    costs: tuple | None  # zero bubble: placement costs
    table: dict
    bound: float  # no prediction of it can be faster
    sharpened: bool = False  # bound raised to its orders' (planner.order_bound)
    memory: tuple | None = None  # (activations in micro-batches, bytes, stages), exact
    floor: tuple | None = None  # the same, a lower bound (zero bubble: 1F1B's)
    plan: Plan | None = None
    refused: bool = False
    first_bound: float = field(init=False)  # the bound it was made with: ranks alike

    def __post_init__(self):
        self.first_bound = self.bound

    @property
    def zero_bubble(self) -> bool:
        return self.schedule != "1f1b"


def choose_plan(
    seq_length: int,
    num_stages: int,
    num_microbatches: int,
    *,
    num_model_chunks: int = 1,
    micro_batch_size: int = 1,
    calibration: Calibration | None = None,
    config=None,
    vocab_size: int | None = None,
    dense_attention: bool = False,
    cost_model: CostModel | None = None,
    memory_budget: float | None = None,
    memory_budget_bytes: float | None = None,
    bytes_per_token: float | None = None,
    min_segment_length: int = 128,
    max_splits: int = MAX_SPLITS,
    multiple_of: int | None = None,
    splits: Sequence[int] | None = None,
    partitions: Sequence[str] | None = None,
    schedules: Sequence[str] | None = None,
    send_slack: int | None = None,
    tie_tolerance: float = 0.0,
    memory_model: MemoryModel | None = None,
    memory_budget_total_bytes: float | None = None,
    documents=None,
    context_parallel_size: int = 1,
    timing: str | None = None,
    top: int = 1,
    exhaustive: bool = False,
) -> PlanChoice:
    """The fastest (k, partition, schedule) within the memory budget, and the candidates timed.

    Costs from ``calibration``, else the FLOP model (``cost_model``, or from
    ``config`` + ``vocab_size``), which the ``"balanced"`` partition needs
    too. ``memory_budget``: peak activations per stage in micro-batches of a
    stage; ``memory_budget_bytes`` needs ``bytes_per_token`` (activation bytes
    one token of one sample leaves on a stage; default: the calibration's). ``k`` runs from 1 to the
    largest with segments of at least ``min_segment_length`` tokens (at most
    ``max_splits``), or over ``splits``. ``timing``: how the executor's transport posts and
    waits (:data:`~megatron_seq1f1b.schedules.replay.TIMINGS`; default
    :data:`RUNTIME_TIMING`, NCCL's links transport); ``send_slack`` 0 or 1 is the older
    way to say "rendezvous" or "slack". Deterministic: ties go to less
    memory, fewer splits, then METHODS and SCHEDULES order. ``tie_tolerance``
    (relative; default 0, the exact fastest; the command line, the start-up measurement and
    the benchmark pass :data:`~megatron_seq1f1b.planner.choice.TIE_TOLERANCE`, 2 %, for
    measured and FLOP costs alike): plans
    predicted within it of the fastest count as equally fast, and the one
    that leans least on the cost model wins (1F1B over zero bubble, then the
    balanced, measured, uniform partition, then the fewest splits). Raises
    :class:`BudgetError` if nothing fits. ``memory_model``: every candidate also gets
    each stage's total bytes (:attr:`Plan.stages`); ``memory_budget_total_bytes`` (needs
    it) bounds the busiest stage's total. ``documents``: a packed micro-batch
    (:class:`~megatron_seq1f1b.segments.documents.Documents`, e.g. the one measured): every
    candidate's attention costs count pairs within its documents, its memory follows
    them, and the ``"documents"`` partition (cut by them) is a candidate too.
    ``context_parallel_size``: each rank holds ``1 / cp`` of a micro-batch's tokens
    (``bytes_per_token`` is per token a rank holds; the FLOP model's work is split over the
    group); segment lengths divide into ``2 * cp`` chunks.

    Which candidates are timed (:attr:`PlanChoice.candidates`; the module doc): what the
    choice needs, the ``top`` fastest within the budget (``top`` > 1), and the fastest over
    the budget where it beats the chosen plan; the others are counted in
    :attr:`PlanChoice.untimed`. ``exhaustive``: time them all.
    """
    if memory_budget_total_bytes is not None and memory_model is None:
        raise ValueError("memory_budget_total_bytes needs memory_model (weights, gradients, "
                         "optimizer states and activations per stage)")
    if not 0 <= tie_tolerance < 1:
        raise ValueError(f"tie_tolerance must be in [0, 1), got {tie_tolerance}")
    if send_slack is not None and timing is not None:
        raise ValueError(f"send_slack={send_slack} and timing={timing!r}: give one of them")
    timing = timing_of(send_slack, None) if send_slack is not None else (timing or RUNTIME_TIMING)
    if timing not in TIMINGS:
        raise ValueError(f"unknown timing {timing!r}; choose one of {TIMINGS}")
    p, m, v = num_stages, num_microbatches, num_model_chunks
    if bytes_per_token is None and calibration is not None:
        bytes_per_token = calibration.bytes_per_token
    if v > 1 and p < 2:
        raise ValueError("interleaving (several model chunks) needs num_stages >= 2")
    if memory_budget_bytes is not None and not bytes_per_token:
        raise ValueError("memory_budget_bytes needs bytes_per_token (activation bytes of one "
                         "token of one sample on a stage)")
    flops = cost_model or (CostModel.from_config(config, vocab_size, dense_attention)
                           if config is not None else None)
    if calibration is None:
        if flops is None:
            raise ValueError("choose_plan needs costs: calibration=..., or config=... / "
                             "cost_model=... for FLOPs")
        calibration = Calibration.from_cost_model(flops, p * v,
                                                  context_parallel_size=context_parallel_size)
    if documents is not None:
        calibration = calibration.with_documents(documents)
    partitions, schedules = _options(partitions, schedules, flops is not None, v,
                                     documents is not None)
    multiple = multiple_of or (segment_multiple(config) if config is not None else 1)
    if context_parallel_size > 1:
        multiple = math.lcm(multiple, 2 * context_parallel_size)
    ks = sorted(set(splits)) if splits else split_counts(seq_length, multiple,
                                                         min_segment_length, max_splits)
    costs_of = {"balanced": flops, "measured": calibration,
                "documents": flops or calibration.cost_model()}
    budgets = [name for name, value in (("microbatches", memory_budget),
                                        ("bytes", memory_budget_bytes),
                                        ("total", memory_budget_total_bytes)) if value is not None]

    candidates: list[_Candidate] = []
    for k in ks:
        seen: set[tuple[int, ...]] = set()
        for partition in partitions:
            try:
                lengths = tuple(split_sequence(seq_length, k, partition, multiple_of=multiple,
                                               cost=costs_of.get(partition),
                                               documents=documents))
            except ValueError:  # e.g. a calibration whose cost does not grow with length
                continue
            if lengths in seen or (k > 1 and min(lengths) < min_segment_length):
                continue  # the same split under an earlier name, or segments too short
            seen.add(lengths)
            for name in schedules:
                zero_bubble = name != "1f1b"
                table = action_cost_table(calibration, lengths, p, v, zero_bubble)
                candidates.append(_Candidate(
                    len(candidates), partition, lengths, name,
                    placement_costs(calibration, lengths, p * v) if zero_bubble else None,
                    table, time_lower_bound(table, p, m, zero_bubble)))
    if not candidates:
        raise ValueError(f"no candidate plan: no split of {seq_length} tokens into segments of "
                         f"at least {min_segment_length} tokens (multiple of {multiple})")
    search = _Search(calibration, p, m, v, timing, micro_batch_size, memory_model, documents,
                     seq_length / context_parallel_size * micro_batch_size * bytes_per_token
                     if bytes_per_token else None,
                     (memory_budget, memory_budget_bytes, memory_budget_total_bytes))
    with collection_paused():  # the search makes only acyclic garbage: one pass at the end
        feasible = search.run(candidates, tie_tolerance, top, exhaustive)
    timed = [c.plan for c in candidates if c.plan is not None]
    ranked = tuple(sorted(timed, key=_rank_key))
    if not feasible:
        limits = _split_limits(seq_length, multiple, min_segment_length, max_splits, splits)
        limits, note = search.more_splits(limits, seq_length, multiple, max(ks),
                                          min_segment_length, max_splits)
        raise _budget_error(search.smallest(candidates), budgets, memory_budget,
                            memory_budget_bytes, memory_budget_total_bytes, limits, note)
    chosen = _pick(sorted(feasible, key=_rank_key), tie_tolerance)
    untimed = [c for c in candidates if c.plan is None and not c.refused]
    return PlanChoice(chosen, ranked, explain(ranked, chosen, tie_tolerance, budgets,
                                              complete=not untimed),
                      calibration.source, len(untimed),
                      sum(1 for c in untimed if search.over(c) or (
                          search.budgeted and c.memory is not None
                          and not search.fits(c.memory))),
                      _kinds(untimed))


def _kinds(candidates: Sequence[_Candidate]) -> str:
    """'k 2-8; partitions uniform, balanced; schedules 1f1b, zb-h1' (first seen first)."""
    if not candidates:
        return ""
    ks = sorted({len(c.lengths) for c in candidates})
    k = f"k {ks[0]}" if len(ks) == 1 else f"k {ks[0]}-{ks[-1]}"
    partitions = ", ".join(dict.fromkeys(c.partition for c in candidates))
    schedules = ", ".join(dict.fromkeys(c.schedule for c in candidates))
    return f"{k}; partitions {partitions}; schedules {schedules}"


class _Search:
    """Times candidates cheapest-bound first until the answer cannot change (module doc)."""

    def __init__(self, calibration, p, m, v, timing, micro_batch_size, memory_model, documents,
                 bytes_per_unit, budgets):
        self.calibration, self.p, self.m, self.v, self.timing = calibration, p, m, v, timing
        self.micro_batch_size, self.memory_model, self.documents = (micro_batch_size,
                                                                    memory_model, documents)
        self.bytes_per_unit = bytes_per_unit  # bytes of one micro-batch of a stage
        self.budgets = budgets
        self.budgeted = any(b is not None for b in budgets)

    # ---------------------------------------------------------------- memory

    def _memory_of(self, c: _Candidate, name: str, costs) -> tuple:
        k = len(c.lengths)
        actions = memory_schedule(self.p, self.m, k, self.v, name, costs)
        peak = activation_peak(actions, c.lengths, self.v)
        stages = None
        if self.memory_model is not None:
            stages = tuple(self.memory_model.stage_bytes(
                actions, c.lengths, self.v, self.micro_batch_size,
                documents=None if self.documents is None else [self.documents]))
        peak_bytes = peak * self.bytes_per_unit if self.bytes_per_unit else None
        return peak, peak_bytes, stages

    def memory(self, c: _Candidate) -> tuple:
        if c.memory is None:
            c.memory = self._memory_of(c, c.schedule, c.costs)
        return c.memory

    def floor(self, c: _Candidate) -> tuple:
        """Memory no less than the candidate's: its own, or (zero bubble) 1F1B's."""
        if c.memory is not None:
            return c.memory
        if c.floor is None:
            c.floor = self._memory_of(c, "1f1b", None) if c.zero_bubble else self.memory(c)
        return c.floor

    def fits(self, memory: tuple) -> bool | None:
        if not self.budgeted:
            return None
        peak, peak_bytes, stages = memory
        micro, by_bytes, total = self.budgets
        return ((micro is None or peak <= micro + 1e-9)
                and (by_bytes is None or peak_bytes <= by_bytes)
                and (total is None or max(s["total"] for s in stages) <= total))

    def over(self, c: _Candidate) -> bool:
        """Known to exceed the budget (from its memory, or its floor)."""
        return self.budgeted and not self.fits(c.memory or self.floor(c))

    # ---------------------------------------------------------------- time

    def sharpen(self, c: _Candidate) -> bool:
        """Raise the candidate's bound to its orders' (once, where that costs less than
        timing it); whether it rose."""
        if c.sharpened:
            return False
        c.sharpened = True
        k = len(c.lengths)
        if 2 * self.p * self.m * k * self.v > ORDER_BOUND_ACTIONS:
            return False
        bound = order_graph(self.p, self.m, k, self.v, c.schedule).bound(c.table)
        if bound <= c.bound:
            return False
        c.bound = bound
        return True

    def time(self, c: _Candidate) -> Plan | None:
        """Time the candidate (its plan, also kept on it); None if the executor refuses it."""
        if c.plan is not None or c.refused:
            return c.plan
        k = len(c.lengths)
        latency = self.calibration.message_latency(c.lengths)
        time = predict_time(self.p, self.m, k, self.v, c.schedule, c.costs,
                            table_cost(c.table, self.p), latency, self.timing)
        if time is None:
            c.refused = True
            return None
        busy = sum(busy_time(c.table, self.p, self.m))
        total = time * self.p
        peak, peak_bytes, stages = self.memory(c)
        c.plan = Plan(k, c.partition, c.lengths, c.schedule, time,
                      1.0 - busy / total if total else 0.0, peak, peak_bytes,
                      self.fits(c.memory), unit=self.calibration.unit,
                      segment_costs=c.costs, stages=stages)
        return c.plan

    def run(self, candidates: list[_Candidate], tolerance: float, top: int,
            exhaustive: bool) -> list[Plan]:
        """Time what the answer needs (module doc); the feasible plans timed."""
        if exhaustive:
            for c in candidates:
                self.time(c)
            return [c.plan for c in candidates if c.plan is not None and c.plan.within_budget
                    is not False]
        by_bound = sorted(candidates, key=_bound_order)
        feasible: list[Plan] = []

        def nth(n: int) -> float:
            times = sorted(plan.time for plan in feasible)
            return times[n - 1] if len(times) >= n else math.inf

        def fits(c: _Candidate) -> bool:  # its memory first: over the budget, never timed
            return not self.over(c) and (not self.budgeted or self.fits(self.memory(c)))

        untimed = [c for c in by_bound]  # least bound first, as bounds sharpen too

        def resort(c: _Candidate) -> None:  # its bound rose: its place in untimed moves
            if c in untimed:
                untimed.remove(c)
                bisect.insort(untimed, c, key=_bound_order)

        def refine(plain: bool = False) -> bool:
            """Sharpen or time the untimed candidate with the least bound (``plain``: 1F1B's,
            where there is one); False: none left."""
            while untimed:
                c = next((d for d in untimed if not d.zero_bubble), untimed[0]) if plain \
                    else untimed[0]
                untimed.remove(c)
                if c.plan is not None or c.refused or not fits(c):
                    continue
                if self.sharpen(c):
                    bisect.insort(untimed, c, key=_bound_order)
                    return True
                plan = self.time(c)
                if plan is not None:
                    feasible.append(plan)
                return True
            return False

        # the ``top`` fastest (without a tie tolerance, the fastest is the choice): cheapest
        # bound first, until no bound could beat the top-th
        if top > 1 or tolerance == 0:
            while untimed and untimed[0].bound <= nth(max(top, 1)) * (1 + 1e-8):
                refine()
        # the tie rule's choice: the most robust plan within the tolerance of the fastest,
        # visited robust first. A timed plan X is in if no plan can be faster than
        # T_X / (1 + tolerance) (every other bound and time at least that), out if one timed
        # is; in between, the plans whose bound is below it are timed, 1F1B's first (cheap,
        # and often enough to put X out), then the rest, least bound first
        if tolerance > 0:
            # where the most robust plan's bound is already out of the tolerance of the least
            # bound (few micro-batches: fewer splits idle more), first 1F1B's least bound
            # (sharpened; its bounds are tight and its timings cheap, where zero bubble's,
            # interleaved or zb-h2, can be 4-5 % under a costly timing): likely near the
            # fastest, so robust plans that cannot come within the tolerance of it are then
            # passed over untimed
            robust = next((c for c in sorted(untimed, key=_robust_order) if fits(c)), None)
            if robust is not None and self.sharpen(robust):
                resort(robust)
            while (robust is not None and untimed and not feasible
                   and robust.bound > untimed[0].bound * (1 + tolerance)):
                refine(plain=True)
            for c in sorted(candidates, key=_robust_order):
                if c.refused or (c.plan is None and not fits(c)):
                    continue
                if c.plan is None:
                    upper = min((plan.time for plan in feasible), default=math.inf)
                    if c.bound <= upper * (1 + tolerance) * (1 + 1e-8) and self.sharpen(c):
                        resort(c)
                    if c.bound > upper * (1 + tolerance) * (1 + 1e-8):
                        continue  # cannot be within the tolerance of a plan already timed
                    plan = self.time(c)
                    if plan is None:
                        continue
                    feasible.append(plan)
                threshold = c.plan.time / (1 + tolerance)
                while True:
                    if min(plan.time for plan in feasible) < threshold * (1 - 1e-9):
                        break  # out
                    below = [d for d in untimed if d.plan is None and not d.refused
                             and d.bound < threshold * (1 + 1e-9)]
                    if not below:
                        break
                    # the likeliest to be faster first: 1F1B's, then by the first bound,
                    # which ranks alike what the sharpened one ranks unlike (a loose
                    # zero-bubble bound would go before a tight, faster one)
                    cheap = [d for d in below if not d.zero_bubble]
                    d = min(cheap or below, key=lambda d: (d.first_bound, d.order))
                    # its floor's memory and its sharpened bound before its exact memory
                    # (zero bubble: that builds its schedule, about a timing's cost)
                    if not self.over(d) and self.sharpen(d):
                        resort(d)
                        continue  # its bound rose: is it still below?
                    untimed.remove(d)
                    if fits(d):
                        plan = self.time(d)
                        if plan is not None:
                            feasible.append(plan)
                if min(plan.time for plan in feasible) >= threshold * (1 - 1e-9):
                    break  # in (or a tie to the last digits, which the tie rule settles)
        # the choice over what was timed is the choice over all: the tie rule needs the
        # fastest only to within the tolerance. Then the fastest plan over the budget, if
        # faster than the chosen one: the reason names it
        if feasible and self.budgeted:
            chosen = _pick(sorted(feasible, key=_rank_key), tolerance)
            best = chosen.time
            for c in sorted(candidates, key=_bound_order):
                if c.bound > best * (1 + 1e-8):
                    break
                # over the budget: by the exact memory where it is cheap or known, else (zero
                # bubble, whose exact memory builds its schedule) by its floor's; this names
                # an example, the choice is made
                over = self.over(c) if c.zero_bubble and c.memory is None else not fits(c)
                if c.plan is None and not c.refused and over:
                    if self.sharpen(c) and c.bound > best * (1 + 1e-8):
                        continue
                    plan = self.time(c)
                    if plan is not None:
                        best = min(best, plan.time)
        return feasible

    def more_splits(self, limits: dict, seq_length: int, multiple: int, tried: int,
                    min_segment_length: int, max_splits: int) -> tuple[dict, str]:
        """Nothing fits and ``limits`` (:func:`_split_limits`) kept the search from more
        splits: the fewest more uniform 1F1B segments that would fit, as the limits' values
        that allow them (never those in force), or none and a note where even the most the
        limits allow would not fit."""
        if not limits:
            return {}, ""
        most = min(limits.get("max_splits", max_splits),
                   seq_length // limits.get("min_segment_length", min_segment_length),
                   seq_length // multiple)
        counts = sorted({min(tried * 2 ** i, most) for i in range(1, 12)} - {tried})
        memory = None
        for k in counts:
            lengths = tuple(split_sequence(seq_length, k, "uniform", multiple_of=multiple))
            trial = _Candidate(-1, "uniform", lengths, "1f1b", None, {}, 0.0)
            memory = self.memory(trial)
            if self.fits(memory):
                found = {}
                if k > max_splits:
                    found["max_splits"] = k
                if min(lengths) < min_segment_length:
                    found["min_segment_length"] = min(lengths)
                return found, ""
        if memory is None:
            return {}, ""
        return {}, (f"; even {counts[-1]} segments (k={counts[-1]} uniform 1f1b) would need "
                    f"{memory[0]:.2f} micro-batches of activations"
                    + (f" and {bytes_text(max(s['total'] for s in memory[2]))} on the busiest "
                       "stage" if memory[2] else "") + ": more splits cannot make it fit")

    def smallest(self, candidates: list[_Candidate]) -> Plan:
        """Nothing fits: the plan nearest to the budgets (the least activations, or with only
        a total budget the least total on the busiest stage), timed for its ties."""
        total_only = self.budgets[0] is None and self.budgets[1] is None

        def need(memory: tuple) -> tuple:
            peak, _, stages = memory
            main = (_q(peak),)
            return ((_q(max(s["total"] for s in stages)),) + main) if total_only else main

        remaining = [c for c in candidates if not c.refused]
        while remaining:
            least = min(need(self.floor(c)) for c in remaining)
            at = [c for c in remaining if need(self.floor(c)) == least]
            exact = [c for c in at if need(self.memory(c)) == least]
            plans = [p for p in (self.time(c) for c in exact) if p is not None]
            if plans:
                key = _memory_key if not total_only else \
                    (lambda plan: (plan.peak_stage_bytes,) + _memory_key(plan))
                return min(plans, key=key)
            remaining = [c for c in remaining if c not in exact]
        raise ValueError("no candidate plan: the executor would refuse every one")


def _bound_order(c: _Candidate) -> tuple:
    return c.bound, c.order


def _robust_order(c: _Candidate) -> tuple:
    """The tie rule's preference (:func:`~megatron_seq1f1b.planner.choice._pick`) before the
    time: 1F1B first, then the partition, then the fewest splits."""
    return (SCHEDULES.index(c.schedule),
            PREFERRED_PARTITIONS.index(c.partition) if len(c.lengths) > 1 else 0,
            len(c.lengths), c.order)


def _budget_error(smallest: Plan, budgets, microbatches, activation_bytes, total_bytes,
                  limits: dict, note: str = "") -> BudgetError:
    """Nothing fits: the budgets and the nearest plan, in the budgets' own units (the least
    activations, or with only a total budget the least total on the busiest stage); ``limits``:
    the search's bounds worth raising, with values that would allow more splits."""
    activations = (([f"{microbatches:.2f} micro-batches"] if microbatches is not None else [])
                   + ([bytes_text(activation_bytes)] if activation_bytes is not None else []))
    words = ([f"activation-memory budget of {' and '.join(activations)} per stage"]
             if activations else [])
    if total_bytes is not None:
        words.append(f"memory budget of {bytes_text(total_bytes)} per GPU (the busiest stage's "
                     "weights, gradients, optimizer states and activations)")
    static = ""
    if total_bytes is not None and smallest.stages:
        fixed = max(s["total"] - s["activations"] for s in smallest.stages)
        if fixed >= total_bytes:
            static = (f"; the busiest stage's weights, gradients and optimizer states alone need "
                      f"{bytes_text(fixed)}, so no number of splits fits: more stages, "
                      "a distributed optimizer or more memory")
            limits = {}
    return BudgetError(
        f"no plan fits the {' and the '.join(words)}: the smallest reachable is "
        f"{need_text(smallest, budgets)}, by {smallest.describe()} (lengths "
        f"{list(smallest.lengths)}){static or note}", smallest, limits)


def _split_limits(seq_length: int, multiple: int, min_segment_length: int, max_splits: int,
                  splits) -> dict:
    """The search's bounds that kept it from more splits, each with a value that allows more
    (never the one in force): ``max_splits`` where ``min_segment_length`` allows more
    segments, ``min_segment_length`` where it stopped ``k`` below ``max_splits``."""
    if splits:  # the caller chose the segment counts
        return {}
    most = seq_length // multiple  # segments of one multiple each
    by_length = seq_length // max(min_segment_length, 1)
    limits = {}
    if max_splits < min(by_length, most):
        limits["max_splits"] = min(by_length, most)
    if by_length < min(max_splits, most):
        shorter = max(multiple, seq_length // min(max_splits, most) // multiple * multiple)
        if shorter < min_segment_length:
            limits["min_segment_length"] = shorter
    return limits


def _options(partitions, schedules, have_flops: bool, chunks: int,
             have_documents: bool = False) -> tuple[list, list]:
    """The partitions and schedules to try, in METHODS / SCHEDULES order; asking for one
    that cannot be built is an error (leaving it out silently would hide it)."""
    available = [x for x in METHODS if (x != "balanced" or have_flops)
                 and (x != "documents" or have_documents)]
    allowed = [s for s in SCHEDULES if not (s == "zb-h2" and chunks > 1)]  # ZB_H2_PROBLEM
    for name in partitions or ():
        if name not in available:
            raise ValueError(f"partition {name!r} is not available here; choose from {available}"
                             " ('balanced' needs config= or cost_model=, 'documents' documents=)")
    for name in schedules or ():
        if name not in allowed:
            raise ValueError(f"schedule {name!r} is not available with {chunks} model chunk(s); "
                             f"choose from {allowed}")
    return ([x for x in METHODS if x in (partitions or available)],
            [s for s in SCHEDULES if s in (schedules or allowed)])
