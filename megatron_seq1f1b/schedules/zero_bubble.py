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


Producer = Union[tuple[int, int], None]  # (rank, position in its order) of an action's input


def _producers(orders: Sequence[Sequence[Action]], num_model_chunks: int) -> list[list[Producer]]:
    """For every action of every rank's order, where the action whose result it needs stands
    (its rank and its position in that rank's order): a forward the previous stage's forward,
    a backward the next stage's backward, the last stage's backward its micro-batch's last
    forward (the loss); None for the pipeline's first input."""
    p = len(orders)
    last_stage = p * num_model_chunks - 1
    last_segment: dict[int, int] = {}  # per micro-batch
    for action in orders[0]:
        if action.kind == FORWARD:
            last_segment[action.microbatch] = max(action.segment,
                                                  last_segment.get(action.microbatch, 0))
    where = [{action: i for i, action in enumerate(order)} for order in orders]
    producers: list[list[Producer]] = []
    for rank, order in enumerate(orders):
        row: list[Producer] = []
        for kind, microbatch, segment, chunk in order:
            stage = chunk * p + rank
            if kind == FORWARD:
                src = stage - 1
                row.append(None if stage == 0 else (
                    src % p, where[src % p][Action(kind, microbatch, segment, src // p)]))
            elif stage == last_stage:
                row.append((rank, where[rank][Action(FORWARD, microbatch, last_segment[microbatch],
                                                     chunk)]))
            else:
                dst = stage + 1
                row.append((dst % p, where[dst % p][Action(kind, microbatch, segment, dst // p)]))
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
    event is kept in a heap and recomputed only when it acted or the neighbour its next
    input comes from did: the cost grows with the number of actions, not with actions times
    ranks.
    """
    cost = cost or unit_cost
    p = len(orders)
    # Per rank and position in its order: the action's cost, its W's cost (backwards), and
    # where its input comes from as (rank, position): numbers, not actions, in the loop
    sources = _producers(orders, num_model_chunks)
    durations = [[cost(action, r) for action in order] for r, order in enumerate(orders)]
    weights = [[None if action.kind == FORWARD else Action(WEIGHT, *action[1:])
                for action in order] for order in orders]
    weight_costs = [[0.0 if w is None else cost(w, r) for w in row]
                    for r, row in enumerate(weights)]
    ends: list[list[float | None]] = [[None] * len(order) for order in orders]
    position, forwarded, weighted = [0] * p, [0] * p, [0] * p
    free_at = [0.0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]  # positions of backwards owing W
    actions: list[list[Action]] = [[] for _ in range(p)]

    def next_event(rank: int) -> tuple[float, Action] | None:
        now = free_at[rank]
        owed = pending[rank]
        weight = owed[0] if owed else None
        i, order = position[rank], orders[rank]
        if i == len(order):
            return (now, weights[rank][weight]) if weight is not None else None
        action = order[i]
        source = sources[rank][i]
        if source is None:
            ready = earliest = 0.0
        else:
            q, j = source
            ready = ends[q][j]
            # not scheduled yet: the earliest its producer could end
            earliest = ready if ready is not None else free_at[q] + durations[q][j]
        full = action.kind == FORWARD and forwarded[rank] - weighted[rank] >= caps[rank]
        if ready is not None and ready <= now and not full:
            return now, action
        # A W runs when memory demands it or when it surely ends before the input arrives:
        # a W that overlaps the arrival would delay the critical path.
        if weight is not None and (full or earliest >= now + weight_costs[rank][weight]):
            return now, weights[rank][weight]
        if ready is None or full:
            return None
        return ready, action

    # (start, rank, version, action): the earliest first; a rank's newest version is its
    # next event (the versions of a rank differ, so actions are never compared)
    events: list[tuple[float, int, int, Action]] = []
    version = [0] * p
    # the ranks whose inputs may come from r (r itself apart: it is refreshed anyway)
    neighbours = [tuple(q for q in dict.fromkeys(((r - 1) % p, (r + 1) % p)) if q != r)
                  for r in range(p)]

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
        actions[r].append(action)
        if action.kind == WEIGHT:
            free_at[r] = start + weight_costs[r][pending[r].popleft()]
            weighted[r] += 1
        else:
            i = position[r]
            ends[r][i] = free_at[r] = start + durations[r][i]
            position[r] = i + 1
            if action.kind == FORWARD:
                forwarded[r] += 1
            else:
                pending[r].append(i)
        refresh(r)
        for neighbour in neighbours[r]:  # the others only where their next input is r's
            j = position[neighbour]
            if j < len(orders[neighbour]):
                source = sources[neighbour][j]
                if source is not None and source[0] == r:
                    refresh(neighbour)
    stuck = [f"rank {r} before {orders[r][position[r]] if position[r] < len(orders[r]) else 'W'}"
             for r in range(p) if position[r] < len(orders[r]) or pending[r]]
    if stuck:
        raise DeadlockError(f"zero-bubble schedule cannot proceed: {'; '.join(stuck)}")
    return actions


__all__ = ["VARIANTS", "build_zero_bubble", "unit_cost", "segment_cost_fn", "CostTable"]
