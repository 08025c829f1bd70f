"""Fits of timed segments and messages: what the planner and the start-up measurement need.

Per (stage, chunk) and direction, ``time = a*len + c*quad(len, end) + d`` with
non-negative coefficients, where ``quad`` is either the causal pairs a
segment attends to or the score rectangle a non-flash kernel computes
(:func:`quadratic_for` says which). Pipeline messages fit ``alpha + beta*bytes``.
Part of the core (the planner and :mod:`megatron_seq1f1b.planner.measure` use it; the
benchmark's :mod:`megatron_seq1f1b.bench.fit` builds on it). Pure: no processes,
no Megatron.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence, TypeVar

from megatron_seq1f1b.schedules.partition import causal_pairs

QUADRATIC: dict[str, Callable[[float, float], float]] = {
    "causal_pairs": lambda length, end: causal_pairs(length, end),
    "rectangle": lambda length, end: length * end,  # score entries a non-flash kernel computes
}


def nonneg_lstsq(features: Sequence[Sequence[float]], target: Sequence[float]) -> list[float]:
    """Least squares with non-negative coefficients (best of all feature subsets).

    Exhaustive over subsets, which is exact and cheap for the three features used here.
    """
    import numpy as np

    X, y = np.asarray(features, dtype=float), np.asarray(target, dtype=float)
    n = X.shape[1]
    best, best_res = [0.0] * n, math.inf
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            coef, *_ = np.linalg.lstsq(X[:, subset], y, rcond=None)
            if (coef < 0).any():
                continue
            res = float(((X[:, subset] @ coef - y) ** 2).sum())
            if res < best_res - 1e-15:
                full = [0.0] * n
                for i, value in zip(subset, coef):
                    full[i] = float(value)
                best, best_res = full, res
    return best


def fit_costs(rows_by_stage: dict, quadratic: str, pairs=None) -> dict:
    """time = a*len + c*quad(len, end) + d per (stage, chunk): forward (F), whole backward
    (B), and where every row has them (:func:`megatron_seq1f1b.planner.measure.time_cases` with
    ``split_weights``) the weight-gradient part W and the input-gradient part Bi that a
    zero-bubble schedule runs with W deferred. ``pairs(len, end)``: the quadratic term of
    segments timed on packed documents (:meth:`~megatron_seq1f1b.segments.documents.Documents.pairs`),
    in place of the named one."""
    quad = pairs or QUADRATIC[quadratic]
    fits = {}
    for key, rows in rows_by_stage.items():
        features = [[r[0], quad(r[0], r[1]), 1.0] for r in rows]
        entry = {}
        columns = [("F", 2), ("B", 3), ("W", 4), ("Bi", 5)][:min(len(r) for r in rows) - 2]
        for name, col in columns:
            target = [r[col] for r in rows]
            coef = nonneg_lstsq(features, target)
            pred = [sum(c * x for c, x in zip(coef, f)) for f in features]
            rel = [abs(p - t) / t for p, t in zip(pred, target) if t > 0]
            entry[name] = {"a": coef[0], "c": coef[1], "d": coef[2],
                           "mean_rel_err": sum(rel) / max(len(rel), 1),
                           "max_rel_err": max(rel, default=0.0)}
        fits[key] = entry
    return fits


def best_quadratic(samples_by_layout: dict) -> tuple[str, dict[str, float]]:
    """The quadratic term that fits better (mean error over stages, F and B), and both errors."""
    fit_error = {}
    for quadratic in QUADRATIC:
        errs = [fit[d]["mean_rel_err"] for rows in samples_by_layout.values()
                for fit in fit_costs(rows, quadratic).values() for d in ("F", "B")]
        fit_error[quadratic] = sum(errs) / len(errs)
    return min(fit_error, key=fit_error.get), fit_error


def quadratic_for(samples_by_layout: dict, dense_attention: bool) -> tuple[str, dict[str, float]]:
    """The quadratic term the fits use, and both terms' fit errors (for the record).

    Megatron's local attention computes every score of the ``len x end`` rectangle, masked
    ones too: the rectangle, whatever the errors say (with a few noisy samples the wrong
    shape sometimes fits better, and it moves the best k). Other kernels (flash attention
    skips masked blocks, by how much depends on its tiling): the better-fitting one.
    """
    best, fit_error = best_quadratic(samples_by_layout)
    return ("rectangle" if dense_attention else best), fit_error


def fit_p2p(rows: list[list[float]]) -> dict:
    """One-way message time ``alpha + beta*bytes`` from [[bytes, seconds], ...]."""
    coef = nonneg_lstsq([[1.0, r[0]] for r in rows], [r[1] for r in rows])
    return {"alpha": coef[0], "beta": coef[1], "samples": rows}


def message_bytes_per_token(micro_batch_size: int, config) -> float:
    """Bytes one token of a segment adds to a pipeline message (a tp shard with sequence
    parallelism)."""
    import torch

    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    element = torch.empty((), dtype=config.pipeline_dtype or torch.float32).element_size()
    return micro_batch_size * config.hidden_size * element / tp


T = TypeVar("T")


def extrapolated_fits(ordered: Sequence[T], stages: int) -> list[T]:
    """Weak scaling: the first and last virtual stage keep their fit, the rest a middle one."""
    ordered = list(ordered)
    if stages == len(ordered):
        return ordered
    middle = ordered[1] if len(ordered) > 2 else ordered[0]
    return [ordered[0]] + [middle] * (stages - 2) + [ordered[-1]] if stages > 1 else [ordered[0]]
