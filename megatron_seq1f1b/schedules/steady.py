"""Schedules of many micro-batches from a few: warm-up, a repeated steady state, cool-down.

Seq1F1B's schedules (plain, interleaved, zero bubble) with the same segments in
every micro-batch are periodic in the micro-batch index: adding ``P`` micro-batches
(``P`` = 1 without interleaving, one group of ``ceil(p / k)`` of them with it)
inserts, on every rank, one more copy of a block of steps whose actions and
messages are the previous copy's shifted by ``P`` micro-batches. So the steps of
``m`` micro-batches are those of a small count ``m0`` (the same ``m mod P``) with
``J = (m - m0) / P`` copies of the block::

    rank r:  prefix_r | block_r | block_r + P | ... | block_r + (J-1)P | suffix_r + JP

:func:`periodic_steps` finds the prefix and block of every rank from the steps the
builders and :func:`~megatron_seq1f1b.schedules.plan.plan_steps` give for ``m0``
and ``m0 + P`` micro-batches, and checks the rule on ``m0 + 2P``. That the rule
holds for every ``J`` is what 1F1B's and the interleaved builders do (their orders
are combinatorial; ``tests/test_steady.py`` compares repeated and built steps over a
grid). Zero bubble's W placement is a list scheduler on a clock, which with uneven
costs can drift between placements for many micro-batches before it settles, so
there the repeated plan is what the executor runs (:func:`executor_plan`), checked
as any plan is, and what the planner predicts. Anything that cannot be cut that way
(schedules whose segments differ between micro-batches, too few micro-batches) gets
``None``, and its callers build and simulate everything.

**Timing** (:func:`steady_makespan`). Replayed, the steps' times satisfy one
equation per step (:func:`~megatron_seq1f1b.schedules.replay.replay_times`), which
refers only to steps of regions (prefix, copies, suffix, in that order) at most
``d`` apart (measured on the steps). If, for some ``J >= 2d + 1``, the times of the last
``2d + 1`` copies are an arithmetic progression, each copy ``lam`` later than the
one before, then with ``J + 1`` copies every step of the prefix and the first
``J`` copies keeps its time and the new copy and the suffix come ``lam`` later:
these times satisfy every equation of ``J + 1`` copies (an equation of a copy
near the end is the one of the copy before it, shifted by ``lam``), the solution
of a dependency graph is unique, and the last ``2d + 1`` copies are again in
progression. By induction the makespan of ``J + n`` copies is ``makespan(J) + n *
lam``, exactly; the busy time is a sum of costs. Where no progression shows, twice as
many copies are replayed, up to all of them. The replay of ``J`` copies never builds
their steps: where each message's other end lies is placed by index from a few
copies (:class:`_Layout`).

The last copies are not always in progression: where a step waits for its receiver to
post (rendezvous, NCCL's posting after sends), the cool-down reaches back into them. So
:func:`steady_makespan` compares two replays, ``J`` and ``J + s`` copies: if inserting
``s`` copies kept the times of every step before a window of ``2d + s`` copies and moved
every later one (and every rank's end) by ``lam``, the same times with the window
repeated satisfy the equations of ``J + 2s`` copies (inside the window both descriptions
agree, and the window is wider than any equation reaches), and so on: the makespan of
``J + n s`` copies is ``makespan(J) + n lam``.

**Memory**. Every block forwards and releases (B, W) each (segment, chunk) equally
often (checked), so the units in flight at the start of every copy are the same
and each copy repeats the same profile: the peak of one copy (``m0 + P``
micro-batches) is the peak of any number of them.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from megatron_seq1f1b.base.collection import collection_paused
from megatron_seq1f1b.schedules.actions import Action
from megatron_seq1f1b.schedules.plan import Message, Step, plan_steps
from megatron_seq1f1b.schedules.replay import message_partners, replay_times
from megatron_seq1f1b.schedules.schedule import Schedule, build_schedule
from megatron_seq1f1b.schedules.validate import check_link_order, check_units
from megatron_seq1f1b.schedules.zero_bubble import segment_cost_fn

__all__ = ["Periodic", "period", "periodic_steps", "periodic_actions", "shift_step",
           "shift_action", "steady_makespan", "whole_plan", "check_plan", "executor_plan"]


def period(num_stages: int, num_splits: int, num_model_chunks: int = 1) -> int:
    """Micro-batches per copy of the steady state: 1, or one interleaved group."""
    return 1 if num_model_chunks == 1 else max(1, -(-num_stages // num_splits))


def shift_step(step: Step, by: int) -> Step:
    """The same step ``by`` micro-batches later (its actions and messages)."""
    if not by:
        return step
    return Step(tuple(Message(m[0], m[1] + by, m[2], m[3], m[4], m[5]) for m in step.sends),
                tuple(Message(m[0], m[1] + by, m[2], m[3], m[4], m[5]) for m in step.recvs),
                tuple(Action(a[0], a[1] + by, a[2], a[3]) for a in step.actions))


def shift_action(action: Action, by: int) -> Action:
    """The same action ``by`` micro-batches later."""
    return Action(action[0], action[1] + by, action[2], action[3]) if by else action


@dataclass
class Periodic:
    """Every rank's steps (or actions) for ``base + J * period`` micro-batches, any ``J >= 0``.

    ``base``: the small count whose items (``small``) are cut into a prefix (the first
    ``prefix[r]`` items of rank ``r``) and a suffix; ``blocks[r]``: the items one copy adds
    there; ``shift(item, by)`` moves an item ``by`` micro-batches. Built by
    :func:`periodic_steps` / :func:`periodic_actions`, which check the cut.
    """

    base: int
    period: int
    small: list[list]
    prefix: list[int]
    blocks: list[list]
    shift: Callable = field(default=shift_step, repr=False)
    _layout: "_Layout | None" = field(default=None, repr=False)

    def copies(self, num_microbatches: int) -> int:
        """``J`` for ``num_microbatches`` (which must be ``base + J * period``)."""
        extra = num_microbatches - self.base
        if extra < 0 or extra % self.period:
            raise ValueError(f"{num_microbatches} micro-batches are not {self.base} + a multiple "
                             f"of {self.period}")
        return extra // self.period

    def rank_items(self, rank: int, copies: int) -> list:
        """Rank ``rank``'s steps (actions) with ``copies`` copies of its block."""
        cut, small, block, shift = self.prefix[rank], self.small[rank], self.blocks[rank], \
            self.shift
        with collection_paused():
            items = list(small[:cut])
            for c in range(copies):
                by = c * self.period
                items += [shift(x, by) for x in block]
            by = copies * self.period
            return items + [shift(x, by) for x in small[cut:]]

    def items(self, copies: int) -> list[list]:
        return [self.rank_items(r, copies) for r in range(len(self.small))]

    def regions(self, copies: int) -> list[list[int]]:
        """Per rank and item of :meth:`items`: -1 prefix, 0.. the copy, ``copies`` suffix."""
        rows = []
        for cut, small, block in zip(self.prefix, self.small, self.blocks):
            rows.append([-1] * cut + [c for c in range(copies) for _ in block]
                        + [copies] * (len(small) - cut))
        return rows

    def layout(self) -> "_Layout":
        if self._layout is None:
            self._layout = _Layout(self)
        return self._layout

    def compiled(self, copies: int) -> tuple[tuple, list[list[int]]]:
        """(:func:`message_partners`, regions) of the steps of ``copies`` copies (the
        messages' other ends placed by index, without building the steps)."""
        return self.layout().partners(copies), self.regions(copies)

    def step_costs(self, action_cost: Callable[[Action, int], float], copies: int) -> list:
        """Per rank and step of ``copies`` copies, the cost of each of its actions (the same
        in every copy: ``action_cost`` must not depend on the micro-batch)."""
        rows = []
        for rank, (cut, small, block) in enumerate(zip(self.prefix, self.small, self.blocks)):
            def of(steps):
                return [tuple(action_cost(a, rank) for a in step.actions) for step in steps]
            rows.append(of(small[:cut]) + of(block) * copies + of(small[cut:]))
        return rows

    def balanced(self) -> bool:
        """Every block forwards and releases each (segment, chunk) equally often."""
        for block in self.blocks:
            counts = Counter((a.kind, a.segment, a.chunk) for a in _actions(block))
            kinds = {kind for kind, _, _ in counts}
            units = {(s, c) for _, s, c in counts}
            if len({counts[(kind, s, c)] for kind in kinds for s, c in units}) > 1:
                return False
        return True


class _Layout:
    """Where the messages of every step of ``J`` copies go, as indices, for any ``J``.

    Read off the steps of a few copies (``T``, enough that every copy-to-copy relation
    shows in the middle): a step of a copy talks to the step ``y`` of the copy ``delta``
    copies away on another rank, or, near the ends, to a step of the prefix or the suffix;
    prefix and suffix steps talk to the prefix, the first copies, the last copies or the
    suffix. Built once per :class:`Periodic`; checked against the steps built in full
    (``tests/test_steady.py``).
    """

    def __init__(self, periodic: "Periodic"):
        self.periodic = periodic
        self.cuts, self.sizes = periodic.prefix, [len(b) for b in periodic.blocks]
        self.template, self.reach = 5, 1
        while True:  # enough copies that the middle one shows every copy-to-copy relation
            partners = message_partners(periodic.items(self.template))
            self.reach = max(self.reach, _reach(periodic.regions(self.template), partners))
            if self.template >= 2 * self.reach + 3:
                break
            self.template = 2 * self.reach + 3
        try:
            self.rules = [self._rules(partners[side]) for side in (0, 1)]
        except ValueError:  # a relation the rules cannot say: every count built in full
            self.rules = None

    def _where(self, rank: int, index: int, copies: int) -> tuple[int, int]:
        """(region: -1 prefix, 0.. copy, ``copies`` suffix; index in it) of a step."""
        cut, size = self.cuts[rank], self.sizes[rank]
        if index < cut:
            return -1, index
        if index < cut + copies * size:
            return (index - cut) // size, (index - cut) % size
        return copies, index - cut - copies * size

    def _rules(self, refs: list) -> list:
        """Per rank: (prefix rules, block rules, suffix rules), one tuple per step, of
        (rank, kind, a, y) per message: kind "P" prefix step y; "A" copy a (from the start)
        step y; "C" copy ``a`` away, with "over"/"under" tables for the ends; "S" suffix
        step y; "E" copy ``a`` from the end, step y."""
        t, middle = self.template, self.template // 2
        rules = []
        for r, rank_refs in enumerate(refs):
            def convert(index: int, region: int) -> tuple:
                out = []
                for q, j in rank_refs[index]:
                    there, y = self._where(q, j, t)
                    if there == -1:
                        out.append((q, "P", 0, y))
                    elif there == t:
                        out.append((q, "S", 0, y))
                    elif region == -1:
                        out.append((q, "A", there, y))
                    elif region == t:
                        out.append((q, "E", t - there, y))
                    else:
                        out.append((q, "C", there - region, y))
                return tuple(out)

            cut, size = self.cuts[r], self.sizes[r]
            prefix = [convert(i, -1) for i in range(cut)]
            suffix_start = cut + t * size
            suffix = [convert(i, t) for i in range(suffix_start, len(rank_refs))]
            block = []
            for b in range(size):
                generic = convert(cut + middle * size + b, middle)
                ends = []
                for j, (q, kind, delta, y) in enumerate(generic):
                    if kind != "C":
                        raise ValueError("a copy in the middle talks to the prefix or suffix")
                    table = {}
                    for c in range(t):  # where copy c's message goes when c + delta is off
                        if 0 <= c + delta < t:
                            continue
                        there, yy = self._where(q, rank_refs[cut + c * size + b][j][1], t)
                        off = c + delta - (t - 1) if c + delta >= t else c + delta
                        table[off] = yy
                    ends.append(table)
                block.append((generic, tuple(ends)))
            rules.append((prefix, block, suffix))
        return rules

    def partners(self, copies: int) -> tuple[list, list]:
        if copies < self.template or self.rules is None:
            return message_partners(self.periodic.items(copies))
        cuts, sizes = self.cuts, self.sizes

        def index(q: int, kind: str, a: int, y: int) -> int:
            if kind == "P":
                return y
            if kind == "S":
                return cuts[q] + copies * sizes[q] + y
            if kind == "A":
                return cuts[q] + a * sizes[q] + y
            return cuts[q] + (copies - a) * sizes[q] + y  # "E"

        def fixed(steps) -> list[tuple]:
            return [tuple((q, index(q, kind, a, y)) for q, kind, a, y in step) for step in steps]

        sides = []
        for rules in self.rules:
            side = []
            for prefix, block, suffix in rules:
                rows = fixed(prefix)
                # copies whose messages all land in copies: the block's rows, moved along
                span = max((abs(delta) for generic, _ in block for _, _, delta, _ in generic),
                           default=0)
                inner = [tuple((q, cuts[q] + delta * sizes[q] + y, sizes[q])
                               for q, _, delta, y in generic) for generic, _ in block]
                for c in range(copies):
                    if span <= c < copies - span:
                        rows += [tuple((q, base + c * size) for q, base, size in step)
                                 for step in inner]
                        continue
                    for generic, ends in block:
                        row = []
                        for (q, _, delta, y), table in zip(generic, ends):
                            there = c + delta
                            if there < 0:
                                row.append((q, table[there]))
                            elif there >= copies:
                                row.append((q, cuts[q] + copies * sizes[q]
                                            + table[there - (copies - 1)]))
                            else:
                                row.append((q, cuts[q] + there * sizes[q] + y))
                        rows.append(tuple(row))
                rows += fixed(suffix)
                side.append(rows)
            sides.append(side)
        return sides[0], sides[1]


def _actions(items: Sequence) -> list[Action]:
    return [a for x in items for a in (x.actions if isinstance(x, Step) else (x,))]


def _cut(small: list, bigger: list, by: int, shift: Callable) -> tuple[int, list] | None:
    """(prefix length, block) such that ``bigger`` = small's prefix + block + small's rest
    shifted by ``by`` micro-batches; None if there is no such cut."""
    extra = len(bigger) - len(small)
    if extra < 0:
        return None
    common = 0
    for a, b in zip(small, bigger):
        if a != b:
            break
        common += 1
    tail = 0  # how many of small's last items reappear, shifted, at bigger's end
    for a, b in zip(reversed(small), reversed(bigger)):
        if shift(a, by) != b:
            break
        tail += 1
    cut = min(common, len(small))
    if cut + tail < len(small):
        return None
    return cut, bigger[cut:cut + extra]


def _base_count(p: int, m: int, k: int, v: int, schedule: str) -> int | None:
    """The smallest count with a steady state and ``m``'s remainder (and, interleaved, its
    groups): None where ``m`` itself is too small for one."""
    per = period(p, k, v)
    units = k * v
    warmup = (v - 1) * (per + 1) * k + 2 * (p - 1) + k - 1 if v > 1 else p + k - 2
    if schedule == "zb-h2":
        warmup += p - 1
    need = -(-(warmup + units) // units)  # micro-batches past the first stage's warm-up
    if schedule != "1f1b":
        need += 2  # zero bubble defers W: its pattern settles a little later
    rest = m % per
    copies = max(-(-(need - rest) // per), rest + 1 if v > 1 else 0, 1)
    base = rest + copies * per
    return base if base + 3 * per <= m else None


Build = Callable[[int], Sequence[Sequence]]


#: Multiples of the period tried where the schedule's shape depends on its costs (zero
#: bubble: a list scheduler places W on a clock, and uneven costs can repeat its choices
#: only every few micro-batches).
TIMED_MULTIPLES = (1, 2, 3, 4)


def _periodic(build: Build, shift: Callable, p: int, m: int, k: int, v: int, schedule: str,
              tries: int, check: Callable | None,
              actions: Callable[[int], Sequence[Sequence[Action]]] | None = None
              ) -> Periodic | None:
    """The cut of ``build``'s small counts (see :func:`periodic_steps`). ``actions(count)``:
    the action lists ``build(count)``'s steps run; a pair of counts whose actions have no cut
    has none in steps either (a step cut is one of its actions), so the steps are built only
    for pairs whose actions cut (zero bubble's placement can take many tries to settle)."""
    base = _base_count(p, m, k, v, schedule)
    if base is None:
        return None
    step = period(p, k, v)
    # 1F1B's orders repeat by construction: its repeated items must equal those built for
    # two copies. Zero bubble's W placement is a simulation that may settle late: its
    # repeated items are checked (``check``) on two and three copies instead.
    timed = schedule != "1f1b"
    multiples = TIMED_MULTIPLES if timed else (1,)
    built: dict[int, list] = {}

    def at(count: int) -> list:
        if count not in built:
            built[count] = [list(rank) for rank in build(count)]
        return built[count]

    # later starts first (zero bubble's pattern can settle late; building a few more
    # micro-batches costs far less than building all of them), then longer periods
    starts = _late_starts(base, step, m) if timed else range(tries)
    with collection_paused():
        for multiple in multiples:
            for attempt in starts:
                if attempt > LONGER_PERIODS_UNTIL and multiple > 1:
                    break  # late starts with one period only: their builds are long
                per = multiple * step
                m0 = base + attempt * step
                m0 += (m - m0) % per  # m's remainder: m is m0 + a whole number of copies
                if m0 + 3 * per > m:
                    break
                if actions is not None and any(
                        _cut(s, o, per, shift_action) is None
                        for s, o in zip(actions(m0), actions(m0 + per))):
                    continue
                cuts = [_cut(s, o, per, shift) for s, o in zip(at(m0), at(m0 + per))]
                if any(c is None for c in cuts):
                    continue
                result = Periodic(m0, per, at(m0), [c[0] for c in cuts], [c[1] for c in cuts],
                                  shift)
                if min(result.prefix) < 1 or not all(result.blocks) or not result.balanced():
                    continue  # every rank starts in its prefix and repeats something
                if timed:
                    try:
                        for copies in (2, 3):
                            if check is not None:
                                check(result.items(copies), m0 + copies * per)
                    except ValueError:
                        continue
                    return _rolled_back(result, base)
                if result.items(2) == at(m0 + 2 * per):
                    if check is not None:
                        check(at(m0 + 2 * per), m0 + 2 * per)
                    return result
    return None


#: The latest start (in periods after the base count) tried with longer periods too.
LONGER_PERIODS_UNTIL = 16


def _rolled_back(periodic: Periodic, floor: int) -> Periodic:
    """The same items for every count from ``periodic.base`` on, with a shorter prefix:
    while every rank's prefix ends in a copy of its block (a placement that settled before
    the count it was cut at) and the base stays at least ``floor`` (a count past the
    warm-up), that copy moves into the repeated part (``base`` one period less). Replays of
    a few copies then cover the steady state, not a long warm-up."""
    per, shift = periodic.period, periodic.shift
    small, prefix, blocks = periodic.small, list(periodic.prefix), periodic.blocks
    base, back = periodic.base, 0
    while base - (back + 1) * per >= floor and all(
            cut - (back + 1) * len(block) >= 1
            and rank[cut - (back + 1) * len(block):cut - back * len(block)]
            == [shift(x, -(back + 1) * per) for x in block]
            for rank, cut, block in zip(small, prefix, blocks)):
        back += 1
    if not back:
        return periodic
    by = -back * per
    cuts = [cut - back * len(block) for cut, block in zip(prefix, blocks)]
    return Periodic(base - back * per, per,
                    [rank[:cut] + [shift(x, by) for x in rank[old:]]
                     for rank, cut, old in zip(small, cuts, prefix)],
                    cuts, [[shift(x, by) for x in block] for block in blocks], shift)


def _late_starts(base: int, step: int, m: int) -> list[int]:
    """Zero bubble's tried starts, in periods after ``base``: 0, 1, 2, 4, .., 16 (each with
    every multiple of the period), and on, doubling, with one period, while the small
    counts stay within a quarter of ``m``: a placement that settles after 30 micro-batches,
    as some do at 32 stages, then costs two small builds, not the whole one, and one that
    never settles costs those late tries (two builds each, doubling) about the whole build
    at most."""
    starts = [0, 1, 2, 4, 8, LONGER_PERIODS_UNTIL]
    while 4 * (base + 2 * starts[-1] * step) <= m:
        starts.append(2 * starts[-1])
    return starts


def periodic_steps(build: Build, num_stages: int, num_microbatches: int, num_splits: int,
                   num_model_chunks: int = 1, schedule: str = "1f1b", tries: int = 3,
                   check: Callable | None = None) -> Periodic | None:
    """The periodic form of the steps ``build(m)`` gives for ``m`` micro-batches, from the
    steps of three small counts (``m0``, ``m0 + P``, ``m0 + 2P`` with ``m0 = m mod P``
    plus enough copies for the warm-up); None where ``num_microbatches`` is too small or no
    cut fits (a few larger ``m0`` are tried first). ``check(steps, count)`` runs on two
    copies of every block (zero bubble: on two and three, and a cut whose copies it refuses,
    raising ValueError, is not taken); otherwise what it raises goes through."""
    return _periodic(build, shift_step, num_stages, num_microbatches, num_splits,
                     num_model_chunks, schedule, tries, check)


def periodic_actions(build: Build, num_stages: int, num_microbatches: int, num_splits: int,
                     num_model_chunks: int = 1, schedule: str = "1f1b",
                     tries: int = 3) -> Periodic | None:
    """:func:`periodic_steps` for action lists (what memory is counted on)."""
    return _periodic(build, shift_action, num_stages, num_microbatches, num_splits,
                     num_model_chunks, schedule, tries, None)


# ------------------------------------------------------------------ the executor's plan


def whole_plan(num_stages: int, num_microbatches: int, num_splits: int,
               num_model_chunks: int = 1, schedule: str = "1f1b", costs: tuple | None = None,
               forward_only: bool = False, check: bool = True) -> list[list[Step]]:
    """Every rank's steps built whole, as the executor plans them: zero-bubble W and receives
    placed with ``costs`` (per segment F, B, W), and (``check``) their link order checked and
    their rendezvous replay run (ScheduleError if either fails)."""
    actions = build_schedule(num_stages, num_microbatches, num_splits, num_model_chunks,
                             forward_only=forward_only, schedule=schedule, costs=costs)
    place = segment_cost_fn(costs) if costs is not None and not forward_only else None
    steps = plan_steps(actions, num_model_chunks, cost=place)
    if place is not None and check:
        check_plan(steps)
    return steps


def check_plan(steps: Sequence[Sequence[Step]], partners: tuple | None = None) -> None:
    """What the executor checks of a zero-bubble plan before it runs it: link order, and a
    rendezvous replay (no deadlock; ``partners``: the steps' :func:`message_partners`, where
    the caller has them)."""
    check_link_order(steps)
    replay_times(steps, partners=partners)  # the times alone: a deadlock raises


@functools.lru_cache(maxsize=64)
def executor_plan(num_stages: int, num_microbatches: int, num_splits: int,
                  num_model_chunks: int = 1, schedule: str = "1f1b", costs: tuple | None = None,
                  forward_only: bool = False) -> Periodic | None:
    """The steps the executor runs for ``num_microbatches``, in periodic form: built for a
    few small counts and repeated; None where there are too few micro-batches for a steady
    state, or no cut fits (then it builds them whole: :func:`whole_plan`).

    1F1B's and the interleaved orders, and their receives, repeat by construction: the
    repeated steps are the ones built whole (checked on two copies here, and on a grid of
    counts in ``tests/test_steady.py``). Zero bubble's W placement is a list scheduler on a
    clock, which with uneven costs can drift between placements for many micro-batches
    before it settles: its repeated steps are the small count's pattern, with two and three
    copies checked as a plan built whole is (every unit once, in order, W after B in B's
    order; link order; a rendezvous replay), so the executor runs, and the planner
    predicts, that repeated plan, which can differ from the one built whole.
    """
    if not isinstance(num_splits, int):  # a count per micro-batch: no period to repeat
        return None
    zero_bubble = costs is not None and not forward_only
    place = segment_cost_fn(costs) if zero_bubble else None
    built: dict[int, Schedule] = {}

    def actions(count: int) -> Schedule:
        if count not in built:
            built[count] = build_schedule(num_stages, count, num_splits, num_model_chunks,
                                          forward_only=forward_only, schedule=schedule,
                                          costs=costs)
        return built[count]

    def check(steps, count):
        check_units([[a for step in rank for a in step.actions] for rank in steps], count,
                    num_splits, num_model_chunks)
        check_plan(steps)

    return _periodic(lambda count: plan_steps(actions(count), num_model_chunks, cost=place),
                     shift_step, num_stages, num_microbatches, num_splits, num_model_chunks,
                     schedule if zero_bubble else "1f1b", tries=3,
                     check=check if zero_bubble else None, actions=actions)


# ------------------------------------------------------------------ timing


def _reach(regions: list[list[int]], partners: tuple) -> int:
    """How many regions apart a step and a step its times refer to can be: its own previous
    step, and the other ends of its and its previous step's messages."""
    senders, receivers = partners
    far = 1
    for r, rank_regions in enumerate(regions):
        for i, here in enumerate(rank_regions):
            for j in (i, i - 1):
                if j < 0:
                    continue
                for q, jj in senders[r][j] + receivers[r][j]:
                    # the other end's times, and (receives posted ahead) its previous step's
                    far = max(far, abs(regions[q][jj] - here),
                              abs(regions[q][jj - 1] - here) if jj else 0)
    return far


def _progression(values: Sequence[list[float]], regions: list[list[int]], first: int,
                 last: int, stride: int, tolerance: float) -> float | None:
    """What every value of copy ``c + stride`` adds to copy ``c``'s, for the copies
    ``first..last`` of every rank (one list of values per rank, one per step), if that is one
    number; else None."""
    lam = None
    for rank_values, rank_regions in zip(values, regions):
        where = [i for i, c in enumerate(rank_regions) if first <= c <= last]
        shift = len(where) // (last - first + 1) * stride
        for i in where[shift:]:
            step = rank_values[i] - rank_values[i - shift]
            if lam is None:
                lam = step
            elif abs(step - lam) > tolerance:
                return None
    return lam


#: The periods (in copies) a replay's times are tried for: max-plus systems such as these
#: settle into cycles of a few copies (each copy alternating, say), not always of one.
STRIDES = (1, 2, 3, 4, 6)


def steady_makespan(periodic: Periodic, num_microbatches: int,
                    action_cost: Callable[[Action, int], float], comm_latency: float = 0.0,
                    timing: str = "rendezvous") -> float:
    """The makespan of ``num_microbatches`` (module doc): replay ``J`` copies and ``J + s``
    (``s`` the period of their times in copies, :data:`STRIDES`); where inserting the ``s``
    copies left the times before an inserted window of ``2d + s`` copies as they were and
    moved those after it by one number, extend that; else replay twice as many copies, up
    to all of them. ``action_cost(action, rank)`` must not depend on the action's
    micro-batch. DeadlockError as the replay raises it."""
    target = periodic.copies(num_microbatches)
    reach = periodic.layout().reach
    copies = 4 * reach + 4

    def replay_of(count: int):
        partners, _ = periodic.compiled(count)
        return replay_times(None, comm_latency=comm_latency, timing=timing, partners=partners,
                            costs=periodic.step_costs(action_cost, count))

    while True:
        if 2 * copies + max(STRIDES) >= target:  # a try replays about 2 copies + s: no
            return max(replay_of(target).end)     # cheaper than every copy, replayed once
        times = replay_of(copies)
        tolerance = 1e-9 * max(max(times.end), 1e-300)
        regions = periodic.regions(copies)
        for stride in STRIDES:
            window = 2 * reach + stride
            middle = (copies - window) // 2
            if middle < 0 or _copy_step(times, regions, middle, middle + window - 1, stride,
                                        tolerance) is None:
                continue
            start = copies + (target - copies) % stride  # a whole number of strides away
            base = replay_of(start) if start != copies else times
            more = replay_of(start + stride)
            lam = _inserted(periodic, base, more, start, stride, window, tolerance)
            if lam is not None:
                return max(base.end) + (target - start) // stride * lam
        copies *= 2


def _inserted(periodic: Periodic, base, more, copies: int, stride: int, window: int,
              tolerance: float) -> float | None:
    """Whether ``more`` (the times of ``copies + stride`` copies) is ``base`` (of ``copies``)
    with ``stride`` copies inserted: every step before some copy ``a + window`` kept its
    times, every step from copy ``a`` on (and every rank's end) moved by one number,
    ``lam``; that number, or None."""
    lam = None
    keep_until, move_from = copies, 0  # in copies, over all ranks
    quantities = ("reach", "post", "recv_post", "start")
    for r, (cut, block) in enumerate(zip(periodic.prefix, periodic.blocks)):
        size, n = len(block), len(base.start[r])
        shift = stride * size
        if lam is None:
            lam = more.end[r] - base.end[r]
        if abs(more.end[r] - base.end[r] - lam) > tolerance:
            return None
        # from first_moved on this rank's steps moved by lam, before first_changed they kept
        # their times (each quantity scanned only as far as the others left open)
        last_deviation, first_changed = -1, n
        for q in quantities:
            before, after = getattr(base, q)[r], getattr(more, q)[r]
            for i in range(n - 1, last_deviation, -1):
                if abs(after[i + shift] - before[i] - lam) > tolerance:
                    last_deviation = i
                    break
            for i in range(first_changed):
                if abs(after[i] - before[i]) > tolerance:
                    first_changed = i
                    break
        if first_changed < cut:
            return None
        first_moved = last_deviation + 1
        move_from = max(move_from, -(-(first_moved - cut) // size))
        keep_until = min(keep_until, (first_changed - cut) // size)
    return lam if keep_until - move_from >= window else None


def _copy_step(times, regions, first: int, last: int, stride: int,
               tolerance: float) -> float | None:
    """What each of the copies ``first..last`` adds to every time of the copy ``stride``
    before it, if that is one number (an arithmetic progression); else None."""
    lam = None
    for values in (times.reach, times.post, times.recv_post, times.start):
        step = _progression(values, regions, first, last, stride, tolerance)
        if step is None or (lam is not None and abs(step - lam) > tolerance):
            return None
        lam = step
    return lam
