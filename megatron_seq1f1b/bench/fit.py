"""The benchmark's cost functions from fits: message latency, virtual-stage order, per-action cost.

The fits themselves (:func:`~megatron_seq1f1b.planner.fit.fit_costs` and friends) live in the core,
:mod:`megatron_seq1f1b.planner.fit`, which the planner and the start-up measurement use too.
Pure: no processes, no Megatron.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from megatron_seq1f1b.planner.fit import QUADRATIC, message_bytes_per_token
from megatron_seq1f1b.schedules.schedule import Action
from megatron_seq1f1b.schedules.simulate import CostFn


def message_latency(p2p_fit: dict, lengths: Sequence[int], micro_batch_size: int,
                    config) -> float:
    """Mean one-way time of one schedule's messages (all segments occur equally often)."""
    per_token = message_bytes_per_token(micro_batch_size, config)
    return sum(p2p_fit["alpha"] + p2p_fit["beta"] * per_token * n for n in lengths) / len(lengths)


def virtual_fits(fits: dict, p: int, v: int) -> list[dict]:
    """Fits in pipeline order (virtual stage = chunk * p + rank)."""
    return [fits[(vs % p, vs // p)] for vs in range(p * v)]


def fitted_cost(ordered_fits: list[dict], lengths: list[int], p: int, quadratic: str,
                recompute: bool = False, split_backward: bool = False) -> CostFn:
    """cost(action, rank) from the fits; with full recompute a backward re-runs the forward.

    ``split_backward`` (zero-bubble schedules): W is its own fit where the calibration
    timed it apart, else half of the fitted backward (an assumption: W is the linear
    layers' weight GEMMs, about half of their backward; attention's backward is all in B).
    """
    quad = QUADRATIC[quadratic]
    ends = list(itertools.accumulate(lengths))

    def one(fit, length, end):
        return fit["a"] * length + fit["c"] * quad(length, end) + fit["d"]

    def cost(action: Action, rank: int) -> float:
        fits = ordered_fits[action.chunk * p + rank]
        length, end = lengths[action.segment], ends[action.segment]
        if action.is_forward:
            return one(fits["F"], length, end)
        backward = one(fits["B"], length, end)
        if split_backward:
            recomputed = one(fits["F"], length, end) if recompute and action.is_backward else 0.0
            weight = (min(one(fits["W"], length, end), backward) if fits.get("W")
                      else backward / 2)
            if action.is_weight:
                return weight
            split = one(fits["Bi"], length, end) if fits.get("Bi") else backward - weight
            return split + recomputed
        return backward + (one(fits["F"], length, end) if recompute else 0.0)

    return cost
