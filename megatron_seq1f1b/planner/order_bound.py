"""A lower bound on a candidate's time from its ranks' orders of forwards and backwards.

The search (:mod:`~megatron_seq1f1b.planner.search`) times a candidate only when its bound
says it might win, so the tighter the bound, the fewer schedules it builds and replays.
:func:`~megatron_seq1f1b.planner.candidates.time_lower_bound` looks at one rank's work;
this one sees the stalls that uneven segment costs cause in a 1F1B order (a uniform cut of
attention-heavy work), which zero bubble's ``W`` fills only in part.

Each forward and backward starts no earlier than in the orders replayed as pure dataflow
(messages free, every ``W`` left out: adding work and waits only delays), except that with
a cap (zero bubble: the most units a rank holds until their ``W``) a rank's ``n``-th
forward also waits for the ``W`` of its ``(n - cap)``-th backward, which runs after that
backward. After its ``i``-th action a rank still runs the rest of its order and the ``W``
of every backward in it: the latest such end over ranks and ``i`` is the bound (``i = 0``
gives the busiest rank's work after its first input, the simpler bound without its tail).

The orders' dependencies are the same for every partition of a ``k``: :class:`OrderGraph`
compiles them once into a list in dataflow order, so a bound is one pass over the actions
with the candidate's costs. Pure Python; no torch.
"""

from __future__ import annotations

from typing import Sequence

from megatron_seq1f1b.schedules.actions import FORWARD, Action

__all__ = ["OrderGraph", "order_lower_bound"]

#: ``{(virtual stage, segment): {"F": .., "B": .., "W": ..}}``, as the planner's cost tables
CostTable = dict


class OrderGraph:
    """Every rank's orders as dataflow: for each action (numbered rank by rank, in order) the
    action before it on its rank, the one whose result it needs, and (zero bubble's cap) the
    backward whose ``W`` it waits for; listed so that each comes after all three."""

    def __init__(self, orders: Sequence[Sequence[Action]], num_stages: int,
                 cap: int | None = None):
        p = num_stages
        last_stage = p * (1 + max(a.chunk for order in orders for a in order)) - 1
        self.keys: list[tuple[tuple[int, int], str]] = []  # ((virtual stage, segment), kind)
        self.rank_ids: list[range] = []
        ids: dict[tuple, int] = {}
        for r, order in enumerate(orders):
            first = len(self.keys)
            for kind, mb, segment, chunk in order:
                stage = chunk * p + r
                ids[kind, mb, segment, stage] = len(self.keys)
                self.keys.append(((stage, segment), kind))
            self.rank_ids.append(range(first, len(self.keys)))
        # per rank: (action, previous on its rank, source, backward whose W it waits for);
        # -1: none
        edges: list[list[tuple[int, int, int, int]]] = []
        for r, order in enumerate(orders):
            rank_edges: list[tuple[int, int, int, int]] = []
            backwards: list[int] = []
            forwards = 0
            for i, ((kind, mb, segment, chunk), me) in enumerate(zip(order, self.rank_ids[r])):
                stage = chunk * p + r
                if kind == FORWARD:
                    source = ids[kind, mb, segment, stage - 1] if stage else -1
                    held = backwards[forwards - cap] if cap is not None and forwards >= cap \
                        else -1
                    forwards += 1
                else:
                    source = ids[kind, mb, segment, stage + 1] if stage < last_stage else -1
                    held = -1
                    backwards.append(me)
                rank_edges.append((me, me - 1 if i else -1, source, held))
            edges.append(rank_edges)
        self.flow = _dataflow_order(edges, len(self.keys))

    def bound(self, table: CostTable) -> float:
        """No schedule keeping these orders ends sooner than this, with ``table``'s costs."""
        cost = [table[key][kind] for key, kind in self.keys]
        weight = [table[key]["W"] if kind != FORWARD else 0.0 for key, kind in self.keys]
        start = [0.0] * len(cost)
        end = [0.0] * len(cost)
        for me, previous, source, held in self.flow:
            t = end[previous] if previous >= 0 else 0.0
            if source >= 0 and end[source] > t:
                t = end[source]
            if held >= 0 and end[held] + weight[held] > t:
                t = end[held] + weight[held]
            start[me] = t
            end[me] = t + cost[me]
        bound = 0.0
        for ids in self.rank_ids:
            rest = 0.0  # the rank's work from an action on, with the W of its backwards
            for me in reversed(ids):
                rest += cost[me] + weight[me]
                if start[me] + rest > bound:
                    bound = start[me] + rest
        return bound


def _dataflow_order(by_rank: list[list[tuple[int, int, int, int]]], count: int) -> list:
    """Every rank's edges in one list where each action comes after its three dependencies
    (ranks advanced in turn as far as their inputs allow); ValueError where none can."""
    ready = [False] * count
    position = [0] * len(by_rank)
    flow: list = []
    while len(flow) < count:
        before = len(flow)
        for r, rank_edges in enumerate(by_rank):
            i = position[r]
            while i < len(rank_edges):
                edge = rank_edges[i]
                if (edge[2] >= 0 and not ready[edge[2]]) or (edge[3] >= 0 and not ready[edge[3]]):
                    break
                ready[edge[0]] = True
                flow.append(edge)
                i += 1
            position[r] = i
        if len(flow) == before:
            raise ValueError("the orders cannot proceed (a rank waits for an input that never "
                             "comes)")
    return flow


def order_lower_bound(orders: Sequence[Sequence[Action]], table: CostTable, num_stages: int,
                      cap: int | None = None) -> float:
    """No schedule keeping these forward/backward orders (and, zero bubble, at most ``cap``
    units held per rank) ends sooner (module doc)."""
    return OrderGraph(orders, num_stages, cap).bound(table)
