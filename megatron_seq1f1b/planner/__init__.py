"""The planner: which k, partition and schedule, from costs and memory, offline or measured.

Which ``k``, partition and schedule is fastest depends on the machine: a fixed
cost per segment (kernel launches, messages) favours few segments, attention
that dominates favours a balanced split, weight gradients that fill bubbles
favour a zero-bubble schedule; more segments also hold fewer activations. So
every combination is simulated with per-segment costs, and the fastest one
that fits the memory budget wins. One job per module:

- :mod:`~megatron_seq1f1b.planner.costs`: per-segment costs (:class:`Calibration`,
  :class:`Fit`), the calibration file (:func:`save_calibration`, :func:`load_calibration`);
  :mod:`~.fit`: fits of timed segments and messages;
- :mod:`~.memory_model`: activations held per stage and each stage's total bytes
  (:func:`activation_peak`, :class:`MemoryModel`, :func:`stage_memory`); :mod:`~.footprint`:
  weights, gradients and optimizer states per stage; :mod:`~.recurrent`: what Mamba-2 and
  gated-delta-net layers hold;
- :mod:`~.search`: every candidate predicted as the executor would run it, the fastest within
  the budget chosen (:func:`choose_plan`, :func:`predict`); :mod:`~.candidates`: one
  candidate's lower bound, memory and time, none of them growing with the micro-batches;
- :mod:`~.choice`: what a candidate is (:class:`Plan`), how candidates rank and ties are won,
  the table and the reason;
- measured on the running model: :mod:`~.timing` and :mod:`~.measure` (per-segment costs at
  start-up), :mod:`~.auto` (``--seq1f1b-splits auto``), :mod:`~.peak_memory` (peaks from real
  allocations), :mod:`~.rehearse` (one stage run alone with stand-in messages:
  ``python -m megatron_seq1f1b.rehearse``);
- :mod:`~.cli`: the offline command line, ``python -m megatron_seq1f1b.planner``;
  :mod:`~.report`: Megatron-Core's own schedules beside its choice, and memory against GPUs.

This package keeps the pure planner's public names importable from
``megatron_seq1f1b.planner``.

May import: every floor below it (:mod:`megatron_seq1f1b.api`, :mod:`~megatron_seq1f1b.runtime`
and down); never ``megatron_lm``, ``trainer`` or ``bench``.
"""

from __future__ import annotations

from megatron_seq1f1b.planner.choice import (
    MEASURED_TIE_TOLERANCE, TIE_TOLERANCE, BudgetError, Plan, PlanChoice, explain, format_table,
)
from megatron_seq1f1b.planner.cli import (
    OFFLINE_FLOP_RATE, OFFLINE_HOST_SECONDS_PER_LAYER, build_parser, main,
)
from megatron_seq1f1b.planner.costs import (
    FORMAT, Calibration, Fit, StageCosts, action_cost, load_calibration, placement_costs,
    save_calibration,
)
from megatron_seq1f1b.planner.memory_model import (
    GIB, MemoryModel, activation_peak, bytes_text, stage_memory,
)
from megatron_seq1f1b.planner.search import (
    MAX_SPLITS, RUNTIME_SEND_SLACK, RUNTIME_TIMING, choose_plan, predict, split_counts,
)

__all__ = [
    "Fit", "StageCosts", "Calibration", "Plan", "PlanChoice", "BudgetError", "choose_plan",
    "format_table", "explain", "TIE_TOLERANCE", "MEASURED_TIE_TOLERANCE", "save_calibration",
    "load_calibration", "activation_peak", "action_cost", "placement_costs", "predict", "main",
    "build_parser", "MemoryModel", "stage_memory", "FORMAT", "GIB", "MAX_SPLITS",
    "RUNTIME_SEND_SLACK", "RUNTIME_TIMING", "OFFLINE_FLOP_RATE", "OFFLINE_HOST_SECONDS_PER_LAYER",
    "bytes_text", "split_counts",
]
