"""Zero-bubble Seq1F1B: weight-gradient work (``W``) scheduled into the bubbles.

Zero-bubble pipelining (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024) splits every backward into ``B`` (gradients the previous stage waits
for) and ``W`` (weight gradients, which nobody waits for), so ``W`` can run
later, in time the rank would otherwise idle. Seq1F1B's segments make the
units finer; ``W`` fills what is left.

Every rank keeps a 1F1B order of forwards and backwards (Seq1F1B's: segments
of a micro-batch are backwarded last-in-first-out) and a list scheduler on a
simulated clock inserts the ``W`` of each backward, in backward order:

* the next ``F``/``B`` runs as soon as its input is there, unless it is an
  ``F`` and ``cap`` units are already in flight on the rank (forwarded,
  weight gradient not yet computed: a pending ``W`` still holds the inputs
  and output gradients of its layers);
* otherwise the oldest pending ``W`` runs if the cap demands it, or if it
  ends before that input can arrive (a ``W`` that overlaps the arrival would
  delay the critical path); otherwise the rank waits.

The variants differ in warm-up and cap:

* ``zb-h1``: Seq1F1B's warm-up; every rank may hold as many units as
  Seq1F1B's first stage does, so the pipeline's memory high-water mark (the
  first stage) does not grow, while later stages, which Seq1F1B leaves with
  spare memory, keep ``W`` pending to fill the cool-down. With equal unit
  costs (``F = B = W``) the bubble is ``(p-1)/(3km+p-1)``, a third of
  Seq1F1B's and the least any schedule can have (the last stage starts
  ``p-1`` forwards late and has ``3km`` units of work).
* ``zb-h2``: ZB-H2's longer warm-up, ``p-r-1`` more forwards on rank ``r``
  (``2(p-r-1) + k-1`` without interleaving): up to about twice the first
  stage's memory, in return for slack that absorbs uneven costs
  (attention-heavy segments, B and W of different lengths); with equal unit
  costs it cannot beat ``zb-h1``, which is at the bound.

With one segment these are ZB-H1 and ZB-H2 pipelines. Schedules are computed
with unit costs unless a cost is given; the result is data like every other
schedule: validated by rendezvous replay, simulated, drawn, and run by the
one executor. Pure Python; no torch.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Sequence, Union

from megatron_seq1f1b.schedules.actions import (
    FORWARD,
    WEIGHT,
    Action,
    DeadlockError,
    Schedule,
)

VARIANTS = ("zb-h1", "zb-h2")
CostFn = Callable[[Action, int], float]


def unit_cost(action: Action, rank: int) -> float:
    """``F = B = W = 1``: the zero-bubble paper's reference point."""
    return 1.0


SegmentCosts = Sequence[tuple[float, float, float]]  # per segment: (F, B, W)


def segment_cost_problems(costs: SegmentCosts, num_splits: int) -> list[str]:
    """Given per-segment costs that cannot place W: wrong count, or not positive numbers."""
    try:
        rows = [tuple(float(x) for x in row) for row in costs]
    except (TypeError, ValueError):
        return [f"segment_costs must be one (F, B, W) triple of numbers per segment, got "
                f"{costs!r}"]
    problems = []
    if len(rows) != num_splits:
        problems.append(f"segment_costs has {len(rows)} entries but num_splits is {num_splits}")
    bad = [j for j, row in enumerate(rows)
           if len(row) != 3 or not all(0 < x < float("inf") for x in row)]
    if bad:
        problems.append(f"segment_costs of segments {bad} are not three positive finite numbers "
                        "(F, B, W)")
    return problems


#: Costs that place W: (F, B, W) per segment (every micro-batch alike), or per micro-batch
#: a row of them (micro-batches cut differently: variable lengths, documents).
CostTable = Union[SegmentCosts, Sequence[SegmentCosts]]


def per_microbatch(costs: CostTable) -> bool:
    """Whether ``costs`` holds a row of segment triples per micro-batch."""
    first = costs[0] if len(costs) else None
    return first is not None and len(first) > 0 and isinstance(first[0], (tuple, list))


def segment_cost_fn(costs: CostTable) -> CostFn:
    """cost(action, rank) from (F, B, W) costs per segment (or per micro-batch and
    segment), the same on every rank."""
    index = {FORWARD: 0, "B": 1, WEIGHT: 2}
    if per_microbatch(costs):
        return lambda action, rank: costs[action.microbatch][action.segment][index[action.kind]]
    return lambda action, rank: costs[action.segment][index[action.kind]]


class _Rank:
    """One rank's progress through its F/B order and its pending weight gradients."""

    def __init__(self, order: Sequence[Action], cap: int):
        self.order, self.cap = order, cap
        self.position = self.forwarded = self.weighted = 0
        self.pending: deque[Action] = deque()
        self.free_at = 0.0
        self.actions: list[Action] = []

    @property
    def finished(self) -> bool:
        return self.position == len(self.order) and not self.pending

    def record(self, action: Action) -> None:
        self.actions.append(action)
        if action.kind == WEIGHT:
            self.pending.popleft()
            self.weighted += 1
            return
        self.position += 1
        if action.kind == FORWARD:
            self.forwarded += 1
        else:
            self.pending.append(Action(WEIGHT, *action[1:]))


Producer = Union[tuple[Action, int], None]  # (action, rank) whose result an action needs


def _producers(orders: Sequence[Sequence[Action]], num_model_chunks: int) -> list[list[Producer]]:
    """For every action of every rank's order, the action (and its rank) whose result it
    needs: a forward the previous stage's forward, a backward the next stage's backward, the
    last stage's backward its micro-batch's last forward (the loss); None for the pipeline's
    first input."""
    p = len(orders)
    last_stage = p * num_model_chunks - 1
    last_segment: dict[int, int] = {}  # per micro-batch
    for action in orders[0]:
        if action.kind == FORWARD:
            last_segment[action.microbatch] = max(action.segment,
                                                  last_segment.get(action.microbatch, 0))
    producers: list[list[Producer]] = []
    for rank, order in enumerate(orders):
        row: list[Producer] = []
        for kind, microbatch, segment, chunk in order:
            stage = chunk * p + rank
            if kind == FORWARD:
                src = stage - 1
                row.append(None if stage == 0
                           else (Action(kind, microbatch, segment, src // p), src % p))
            elif stage == last_stage:
                row.append((Action(FORWARD, microbatch, last_segment[microbatch], chunk), rank))
            else:
                dst = stage + 1
                row.append((Action(kind, microbatch, segment, dst // p), dst % p))
        producers.append(row)
    return producers


def build_zero_bubble(
    orders: Sequence[Sequence[Action]],
    caps: Sequence[int],
    num_model_chunks: int = 1,
    cost: CostFn | None = None,
) -> Schedule:
    """Per-rank actions: 1F1B orders with ``W`` inserted (see the module docstring).

    ``orders[r]``: rank ``r``'s forwards and backwards in Seq1F1B's order (the variant's
    warm-up); ``caps[r]``: most units in flight there. Raises :class:`DeadlockError`
    if a rank can never proceed.

    The clock advances event by event: the earliest next action of any rank runs (ties to
    the lower rank). A rank's next action depends only on its own state and on its
    neighbours' (its inputs come from the stages before and after it), so each rank's next
    event is kept in a heap and recomputed only when it or a neighbour acted: the cost
    grows with the number of actions, not with actions times ranks.
    """
    cost = cost or unit_cost
    p = len(orders)
    producers = _producers(orders, num_model_chunks)
    ranks = [_Rank(order, cap) for order, cap in zip(orders, caps)]
    done: dict[tuple[Action, int], float] = {}  # (action, rank) -> end time

    def next_event(rank: int) -> tuple[float, Action] | None:
        state = ranks[rank]
        now = state.free_at
        weight = state.pending[0] if state.pending else None
        if state.position == len(state.order):
            return (now, weight) if weight else None
        action = state.order[state.position]
        source = producers[rank][state.position]
        if source is None:
            ready = earliest = 0.0
        elif source in done:
            ready = earliest = done[source]
        else:  # not scheduled yet: the earliest its producer could end
            ready, earliest = None, ranks[source[1]].free_at + cost(*source)
        full = action.kind == FORWARD and state.forwarded - state.weighted >= state.cap
        if ready is not None and ready <= now and not full:
            return now, action
        # A W runs when memory demands it or when it surely ends before the input arrives:
        # a W that overlaps the arrival would delay the critical path.
        if weight and (full or earliest >= now + cost(weight, rank)):
            return now, weight
        if ready is None or full:
            return None
        return ready, action

    # (start, rank, version, action): the earliest first; a rank's newest version is its
    # next event (the versions of a rank differ, so actions are never compared)
    events: list[tuple[float, int, int, Action]] = []
    version = [0] * p

    def refresh(rank: int) -> None:
        version[rank] += 1
        event = next_event(rank)
        if event is not None:
            heapq.heappush(events, (event[0], rank, version[rank], event[1]))

    for r in range(p):
        refresh(r)
    while events:
        start, r, seen, action = heapq.heappop(events)
        if seen != version[r]:
            continue  # superseded by a newer event of the rank
        done[(action, r)] = ranks[r].free_at = start + cost(action, r)
        ranks[r].record(action)
        for neighbour in {r, (r - 1) % p, (r + 1) % p}:
            refresh(neighbour)
    stuck = [f"rank {r} before {s.order[s.position] if s.position < len(s.order) else 'W'}"
             for r, s in enumerate(ranks) if not s.finished]
    if stuck:
        raise DeadlockError(f"zero-bubble schedule cannot proceed: {'; '.join(stuck)}")
    return [state.actions for state in ranks]


__all__ = ["VARIANTS", "build_zero_bubble", "unit_cost", "segment_cost_fn", "CostTable"]
