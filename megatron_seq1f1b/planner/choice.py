"""The planner's candidates: what one is (:class:`Plan`), how they rank, how a tie is
won, and the table and one line that say why the winner won."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from megatron_seq1f1b.planner.memory_model import GIB, bytes_text
from megatron_seq1f1b.schedules.partition import METHODS
from megatron_seq1f1b.schedules.schedule import SCHEDULES

__all__ = ["Plan", "PlanChoice", "BudgetError", "TIE_TOLERANCE", "MEASURED_TIE_TOLERANCE",
           "explain", "format_table", "need_text", "tie_note"]


@dataclass(frozen=True)
class Plan:
    """One candidate: how to cut and schedule, and what the simulation predicts."""

    num_splits: int
    partition: str
    lengths: tuple[int, ...]
    schedule: str
    time: float  # predicted iteration (calibration unit)
    bubble: float  # idle share of all ranks' time
    memory: float  # peak activations of a stage, in micro-batches of that stage
    memory_bytes: float | None = None  # with bytes_per_token
    within_budget: bool | None = None  # None: no budget given
    unit: str = "s"
    segment_costs: tuple[tuple[float, float, float], ...] | None = None  # zero bubble: (F, B, W)
    # with a MemoryModel: bytes per rank (stage_memory); derived, so not part of equality
    stages: tuple[dict, ...] | None = field(default=None, compare=False)

    @property
    def peak_stage_bytes(self) -> float | None:
        """The busiest stage's predicted total bytes (with a memory model)."""
        return max(s["total"] for s in self.stages) if self.stages else None

    def stages_text(self, busiest_only: bool = False) -> str:
        """One line per stage: its predicted GB and what they are; ``busiest_only``: one line,
        the stage that decides whether the plan fits (a short report)."""
        if not self.stages:
            return ""
        terms = "weights + gradients + optimizer + activations = total"
        if busiest_only:
            rank = max(range(len(self.stages)), key=lambda r: self.stages[r]["total"])
            return (f"predicted memory of the busiest stage ({terms}): stage {rank} of "
                    f"{len(self.stages)}: {self._stage_text(rank)}; --top 0 lists every stage")
        parts = [f"predicted memory per stage ({terms}):"]
        parts += [f"  stage {rank}: {self._stage_text(rank)}" for rank in range(len(self.stages))]
        return "\n".join(parts)

    def _stage_text(self, rank: int) -> str:
        s = self.stages[rank]
        unit, size, decimal, decimal_size = ("GiB", GIB, "GB", 1e9) if s["total"] >= 0.1 * GIB \
            else ("MiB", 2**20, "MB", 1e6)  # small models (tests) in MiB, as bytes_text
        return (f"{s['weights'] / size:.2f} + {s['gradients'] / size:.2f} + "
                f"{s['optimizer'] / size:.2f} + {s['activations'] / size:.2f} = "
                f"{s['total'] / size:.2f} {unit} ({s['total'] / decimal_size:.2f} {decimal})")

    def describe(self) -> str:
        part = f" {self.partition}" if self.num_splits > 1 else ""
        return f"k={self.num_splits}{part} {self.schedule}"

    def memory_text(self) -> str:
        text = f"{self.memory:.2f} micro-batches"
        return text + (f" ({bytes_text(self.memory_bytes)})" if self.memory_bytes else "")


@dataclass(frozen=True)
class PlanChoice:
    """The winner, every candidate (ranked: fastest first) and why the winner won."""

    plan: Plan
    candidates: tuple[Plan, ...]  # those timed (all of them with exhaustive=True)
    reason: str
    source: str = ""  # where the costs came from (the calibration's source)
    untimed: int = 0  # candidates not timed: their bounds could not change the answer
    untimed_over_budget: int = 0  # of which over the memory budget
    untimed_kinds: str = ""  # their partitions and schedules, so the table names what was weighed

    def table(self, top: int = 0) -> str:
        """The candidates (``top``: only the fastest ``top`` and the chosen one), why the
        winner won and its memory per stage (only the busiest where candidates were cut)."""
        text = format_table(self.candidates, self.plan, self.reason, top,
                            self.untimed, self.untimed_over_budget, self.untimed_kinds)
        cut = (len(_shown(self.candidates, self.plan, top)) < len(self.candidates)
               or self.untimed > 0)
        return text + ("\n" + self.plan.stages_text(cut) if self.plan.stages else "")


class BudgetError(ValueError):
    """No candidate plan fits the memory budget: ``smallest`` is the plan nearest to it;
    ``limits``, the search's bounds that kept it from more splits, each with a value that
    allows more (``{"max_splits": 32}``: never the value in force; empty where raising none
    could help), which :meth:`text` names as its caller spells them."""

    def __init__(self, message: str, smallest: Plan, limits: dict | None = None):
        self.message, self.smallest, self.limits = message, smallest, dict(limits or {})
        super().__init__(self.text())

    def text(self, names: dict | None = None) -> str:
        """The message; ``names`` spells the limits (``{"max_splits": "--max-splits"}``:
        ``--max-splits 16``; by default ``max_splits=16``)."""
        if not self.limits:
            return self.message
        names = names or {}
        limits = ", ".join(f"{names[name]} {value}" if name in names else f"{name}={value}"
                           for name, value in self.limits.items())
        return f"{self.message}; raise the budget, or allow more splits ({limits})"


def need_text(plan: Plan, budgets: Sequence[str] = ()) -> str:
    """The memory ``plan`` needs, in the units of the budgets given: ``"microbatches"`` and
    ``"bytes"`` (activations: :meth:`Plan.memory_text`), ``"total"`` (its busiest stage's
    weights, gradients, optimizer states and activations); none: :meth:`Plan.memory_text`."""
    parts = []
    if {"microbatches", "bytes"} & set(budgets) or not budgets:
        parts.append(plan.memory_text())
    if "total" in budgets and plan.peak_stage_bytes is not None:
        parts.append(f"{bytes_text(plan.peak_stage_bytes)} on its busiest stage")
    return " and ".join(parts) or plan.memory_text()


def _q(x: float) -> float:
    """Ten significant digits: equal predictions tie whatever the summation order."""
    return float(f"{x:.10g}")


def _rank_key(plan: Plan) -> tuple:
    """Fastest; then less memory, fewer splits, partition order, schedule order."""
    return (_q(plan.time), _q(plan.memory), plan.num_splits, METHODS.index(plan.partition),
            SCHEDULES.index(plan.schedule))


def _memory_key(plan: Plan) -> tuple:
    return (_q(plan.memory),) + _rank_key(plan)


# Within the tie tolerance, the plan that leans least on the cost model: the 1F1B schedule
# (zero bubble's win rests on the B/W split and W placement), then the partition cut by the
# packed documents' own FLOPs (where documents are known), the FLOP-balanced partition
# (machine-independent), then the fitted one; then the fewest segments (fewer
# steps, messages and small kernels: what per-segment fits capture worst).
PREFERRED_PARTITIONS = ("documents", "balanced", "measured", "uniform")
#: Predictions this close to the fastest are a tie, for measured and FLOP costs alike: a
#: calibration's noise and the FLOP model's assumed rate and host time are both larger, so a
#: smaller lead is no evidence (FLOP costs once chose k=16 by 0.1 % over k=15).
TIE_TOLERANCE = 0.02
MEASURED_TIE_TOLERANCE = TIE_TOLERANCE  # its earlier name, from when only measured costs tied


def _robust_key(plan: Plan) -> tuple:
    return (SCHEDULES.index(plan.schedule), PREFERRED_PARTITIONS.index(plan.partition)
            if plan.num_splits > 1 else 0, plan.num_splits) + _rank_key(plan)


def _pick(feasible: Sequence[Plan], tie_tolerance: float) -> Plan:
    """The fastest plan, or with a tolerance, the most robust one predicted that close to it."""
    limit = feasible[0].time * (1 + tie_tolerance)
    return min((c for c in feasible if _q(c.time) <= _q(limit)), key=_robust_key)


def _tie_reason(chosen: Plan, other: Plan) -> str:
    if _q(chosen.memory) != _q(other.memory):
        return "less memory"
    if chosen.num_splits != other.num_splits:
        return "fewer splits"
    if chosen.partition != other.partition:
        return f"partition order {METHODS}"
    return f"schedule order {SCHEDULES}"


def tie_note(candidates: Sequence[Plan], chosen: Plan, tie_tolerance: float,
             complete: bool = True) -> str:
    """Where the tie rule kept a plan slower than the fastest within the budget: by how much
    and why, in one phrase for a report's first lines ("" where the chosen plan is the
    fastest: nothing was overridden). ``complete``: as :func:`explain` takes it."""
    ranked = sorted(candidates, key=_rank_key)
    fastest = next(c for c in ranked if c.within_budget is not False)
    if fastest == chosen:
        return ""
    within = " within the budget" if ranked[0].within_budget is False else ""
    timed = "" if complete else " timed"
    return (f"{chosen.time / fastest.time - 1:.1%} slower than the fastest{timed}{within}, "
            f"{fastest.describe()}; kept because that is within the {tie_tolerance * 100:g}% "
            f"tie tolerance and it leans less on the cost model "
            f"({_robust_reason(chosen, fastest)})")


def explain(candidates: Sequence[Plan], chosen: Plan, tie_tolerance: float = 0.0,
            budgets: Sequence[str] = (), complete: bool = True) -> str:
    """One line: why `chosen` won over the others; memory in the units of ``budgets``
    (:func:`need_text`). ``complete``: ``candidates`` are all there were; otherwise only those
    the search timed (counts become "at least", the next one "the next timed")."""
    ranked = sorted(candidates, key=_rank_key)
    faster = [c for c in ranked if _rank_key(c) < _rank_key(chosen)]
    over = [c for c in faster if c.within_budget is False]
    least = "" if complete else "at least "
    timed = "" if complete else " timed"
    budget = (f"; {least}{len(over)} faster plan(s) exceed the memory budget, e.g. "
              f"{over[0].describe()} (needs {need_text(over[0], budgets)})" if over else "")
    fastest = next(c for c in ranked if c.within_budget is not False)
    if fastest != chosen:
        return (f"{chosen.describe()} wins: predicted {chosen.time / fastest.time - 1:.1%} "
                f"slower than the fastest{timed}{' within the budget' if over else ''}, "
                f"{fastest.describe()}, which is within the tie tolerance of "
                f"{tie_tolerance:.0%}, and it leans less on the cost model "
                f"({_robust_reason(chosen, fastest)}){budget}")
    rest = [c for c in ranked if _rank_key(c) > _rank_key(chosen)
            and c.within_budget is not False]
    if rest:
        nxt = rest[0]
        if _q(nxt.time) == _q(chosen.time):
            versus = f"as fast as {nxt.describe()}, and wins the tie on {_tie_reason(chosen, nxt)}"
        else:
            versus = (f"{nxt.time / chosen.time - 1:.1%} faster than the next{timed}"
                      f"{' within the budget' if faster else ''}, {nxt.describe()}")
    else:
        versus = f"the only candidate{timed}" + (" within the budget" if faster else "")
    if not faster:
        return f"{chosen.describe()} wins: fastest; {versus}"
    best = faster[0]
    return (f"{chosen.describe()} wins: fastest within the memory budget "
            f"({need_text(chosen, budgets)}); {least}{len(faster)} faster plan(s) exceed it, e.g. "
            f"{best.describe()} ({chosen.time / best.time - 1:.1%} faster, needs "
            f"{need_text(best, budgets)}); {versus}")


def _robust_reason(chosen: Plan, fastest: Plan) -> str:
    if chosen.schedule != fastest.schedule:
        return f"{chosen.schedule} rather than {fastest.schedule}"
    if chosen.partition != fastest.partition and chosen.num_splits > 1:
        return f"the {chosen.partition} partition rather than the {fastest.partition} one"
    return f"{chosen.num_splits} segments rather than {fastest.num_splits}"


def _time_text(value: float, unit: str) -> str:
    return f"{value * 1e3:.2f} ms" if unit == "s" else f"{value:.4g} {unit}"


def _lengths_text(lengths: Sequence[int]) -> str:
    if len(lengths) <= 4:
        return ",".join(map(str, lengths))
    return f"{lengths[0]},{lengths[1]},..,{lengths[-1]}"


def _shown(candidates: Sequence[Plan], chosen: Plan, top: int) -> list[Plan]:
    """The rows of a table: all candidates, fastest first, or the ``top`` fastest and the
    chosen one (``top`` 0: all)."""
    ranked = sorted(candidates, key=_rank_key)
    if not top or top >= len(ranked):
        return ranked
    return ranked[:top] + ([] if chosen in ranked[:top] else [chosen])


def format_table(candidates: Sequence[Plan], chosen: Plan, reason: str | None = None,
                 top: int = 0, untimed: int = 0, untimed_over_budget: int = 0,
                 untimed_kinds: str = "") -> str:
    """All candidates, fastest first (``*`` = chosen), then why the winner won; ``top``:
    only the fastest ``top`` and the chosen one, and a line counting the others;
    ``untimed``: a line counting the candidates the search did not time."""
    ranked = sorted(candidates, key=_rank_key)
    shown = _shown(ranked, chosen, top)
    best = ranked[0].time
    with_bytes = any(c.memory_bytes for c in ranked)
    with_stages = any(c.stages for c in ranked)
    header = (f"  {'k':>3} {'partition':<9} {'schedule':<8} {'time':>14} {'vs best':>8} "
              f"{'bubble':>7} {'act. (micro-batches)':>20}"
              + (f" {'act. bytes':>10}" if with_bytes else "")
              + (f" {'max stage':>10}" if with_stages else "") + f" {'budget':>6}  lengths")
    lines = [header, "-" * len(header)]
    for c in shown:
        budget = {None: "-", True: "ok", False: "over"}[c.within_budget]
        gib = f" {bytes_text(c.memory_bytes):>10}" if with_bytes and c.memory_bytes else ""
        if with_stages:
            gib += f" {bytes_text(c.peak_stage_bytes):>10}" if c.stages else f" {'-':>10}"
        lines.append(
            f"{'*' if c == chosen else ' '} {c.num_splits:>3} {c.partition:<9} {c.schedule:<8} "
            f"{_time_text(c.time, c.unit):>14} {c.time / best - 1:>+8.1%} {c.bubble:>7.1%} "
            f"{c.memory:>20.2f}{gib} {budget:>6}  {_lengths_text(c.lengths)}")
    if len(shown) < len(ranked):
        lines.append(f"  ... {len(ranked) - len(shown)} more candidates not shown "
                     "(--top 0 lists all)")
    if untimed:
        over = (f", {untimed_over_budget} of them over the memory budget"
                if untimed_over_budget else "")
        kinds = f" ({untimed_kinds})" if untimed_kinds else ""
        lines.append(f"  ... {untimed} more candidates not timed{kinds}: their lower bounds "
                     f"cannot change this answer{over} (--top 0 times them all)")
    lines.append(reason or explain(ranked, chosen))
    return "\n".join(lines)


# ------------------------------------------------------------------ command line
