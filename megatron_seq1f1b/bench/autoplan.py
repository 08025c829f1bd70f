"""``--splits auto``: the plan ``--seq1f1b-splits auto`` would run, from the bench calibration.

The trainer measures at start-up and calls :func:`~megatron_seq1f1b.planner.choose_plan`
(:mod:`megatron_seq1f1b.trainer.auto_plan`); here the same call gets the benchmark's own
samples (same cases, the calibration mode its predictions use), so the ``seq1f1b-auto`` row
checks the planner's choice against a measured sweep of k in the same processes.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from megatron_seq1f1b.base.checks import segment_multiple
from megatron_seq1f1b.bench.calibration import CalibrationSamples
from megatron_seq1f1b.bench.predict import matching_mode
from megatron_seq1f1b.bench.ranks import say
from megatron_seq1f1b.planner import (
    TIE_TOLERANCE, BudgetError, Calibration, Plan, choose_plan,
)
from megatron_seq1f1b.planner.measure import message_fit
from megatron_seq1f1b.runtime.p2p import replay_timing


def choose(samples: CalibrationSamples, args: argparse.Namespace, config,
           shared_cores: float | None, dense_attention: bool = False) -> tuple[Plan, dict]:
    """The planner's choice for the plain layout, and its record for results.json.

    Identical on every rank (same samples, deterministic planner); prints every candidate.
    """
    from megatron.core import parallel_state

    mode = matching_mode(samples.modes, shared_cores)
    timing = replay_timing(parallel_state.get_pipeline_model_parallel_group())
    calibration = Calibration.from_samples(
        samples.raw[mode]["plain"], source=f"benchmark calibration ({mode}), cases {samples.cases}",
        dense_attention=dense_attention)
    if samples.p2p_rows:  # messages timed as the start-up measurement times them
        calibration = replace(calibration, message=message_fit(
            samples.p2p_rows, args.micro_batch_size, config))
    try:
        choice = choose_plan(
            args.seq_length, args.pp, args.microbatches, micro_batch_size=args.micro_batch_size,
            calibration=calibration, memory_budget=args.memory_budget_microbatches,
            config=config, vocab_size=args.vocab_size,  # adds the FLOP-balanced partition
            dense_attention=dense_attention,
            min_segment_length=args.min_segment_length, multiple_of=segment_multiple(config),
            timing=timing,  # the executor's transport, as the start-up measurement plans
            tie_tolerance=TIE_TOLERANCE,  # as the start-up measurement's plan
        )
    except BudgetError as exc:  # the same on every rank: all stop
        raise SystemExit(f"--memory-budget-microbatches {args.memory_budget_microbatches}: "
                         f"{exc}") from None
    say(f"> auto plan from the {mode} calibration ({calibration.quadratic}):\n{choice.table()}")
    plan = choice.plan
    return plan, {"k": plan.num_splits, "partition": plan.partition, "schedule": plan.schedule,
                  "lengths": list(plan.lengths), "predicted_s": plan.time, "bubble": plan.bubble,
                  "memory_microbatches": plan.memory, "calibration_mode": mode,
                  "timing": timing, "reason": choice.reason,
                  "table": choice.table()}
