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
    """
    cost = cost or unit_cost
    p = len(orders)
    last_stage = p * num_model_chunks - 1
    last_segment: dict[int, int] = {}  # per micro-batch
    for action in orders[0]:
        if action.kind == FORWARD:
            last_segment[action.microbatch] = max(action.segment,
                                                  last_segment.get(action.microbatch, 0))
    ranks = [_Rank(order, cap) for order, cap in zip(orders, caps)]
    done: dict[tuple[Action, int], float] = {}  # (action, rank) -> end time

    def producer(action: Action, rank: int) -> tuple[Action, int] | None:
        """The action whose result `action` needs (None: the pipeline's first input)."""
        stage = action.chunk * p + rank
        if action.kind == FORWARD:
            if stage == 0:
                return None
            src = stage - 1
            return action._replace(chunk=src // p), src % p
        if stage == last_stage:  # the loss needs the micro-batch's last segment forwarded
            return (Action(FORWARD, action.microbatch, last_segment[action.microbatch],
                           action.chunk), rank)
        dst = stage + 1
        return action._replace(chunk=dst // p), dst % p

    def arrival(action: Action, rank: int) -> tuple[float | None, float]:
        """(when `action`'s input exists or None if not scheduled yet, earliest it can)."""
        source = producer(action, rank)
        if source is None:
            return 0.0, 0.0
        if source in done:
            return done[source], done[source]
        src_action, src_rank = source
        return None, ranks[src_rank].free_at + cost(src_action, src_rank)

    def next_event(state: _Rank, rank: int) -> tuple[float, Action] | None:
        now = state.free_at
        weight = state.pending[0] if state.pending else None
        if state.position == len(state.order):
            return (now, weight) if weight else None
        action = state.order[state.position]
        ready, earliest = arrival(action, rank)
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

    while not all(state.finished for state in ranks):
        events = [(event, r) for r, state in enumerate(ranks) if not state.finished
                  for event in [next_event(state, r)] if event is not None]
        if not events:
            stuck = "; ".join(
                f"rank {r} before {s.order[s.position] if s.position < len(s.order) else 'W'}"
                for r, s in enumerate(ranks) if not s.finished)
            raise DeadlockError(f"zero-bubble schedule cannot proceed: {stuck}")
        (start, action), r = min(events, key=lambda item: (item[0][0], item[1]))
        done[(action, r)] = ranks[r].free_at = start + cost(action, r)
        ranks[r].record(action)
    return [state.actions for state in ranks]


__all__ = ["VARIANTS", "build_zero_bubble", "unit_cost", "segment_cost_fn", "CostTable"]
