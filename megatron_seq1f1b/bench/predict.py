"""Simulated iterations from the calibrated costs: the measured configuration, and larger pipelines.

For the measured configuration the primary prediction uses the calibration
that matches how the run computed (concurrent when every rank has a core or
device; isolated plus processor sharing when ranks oversubscribe the cores)
and adds the measured p2p time per step; other variants are reported beside
it. Larger pipelines (weak scaling) use plain :func:`simulate`.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable, Optional

from megatron_seq1f1b.bench.calibration import CalibrationSamples
from megatron_seq1f1b.bench.fit import fitted_cost, message_latency, virtual_fits
from megatron_seq1f1b.bench.layouts import Layout
from megatron_seq1f1b.bench.lineup import AUTO_KEY, BenchSchedule, backend_attention
from megatron_seq1f1b.bench.ranks import say
from megatron_seq1f1b.bench.sharing import pipeline_replay
from megatron_seq1f1b.planner.fit import extrapolated_fits, fit_costs, fit_p2p, quadratic_for
from megatron_seq1f1b.runtime.model_hooks import AttentionKind
from megatron_seq1f1b.schedules.replay import Timeline
from megatron_seq1f1b.schedules.schedule import build_schedule
from megatron_seq1f1b.schedules.simulate import SimResult, simulate

# (calibration mode, shared cores or None, with p2p latency)
Variant = tuple[str, Optional[float], bool]


def predict(ordered_fits: list[dict], p: int, m: int, lengths: list[int], v: int,
            quadratic: str, recompute: bool = False, cores: float | None = None,
            latency: float = 0.0, variant: str = "1f1b") -> SimResult:
    """Simulated iteration with fitted costs: simulate(), or pipeline_replay() when p2p
    latency or shared cores (fewer than p) are modelled. ``variant``: Seq1F1B's schedule
    ("1f1b", "zb-h1", "zb-h2")."""
    schedule = build_schedule(p, m, len(lengths), v, schedule=variant)
    cost = fitted_cost(ordered_fits, lengths, p, quadratic, recompute,
                       split_backward=variant != "1f1b")
    if cores is not None and cores >= p:
        cores = None
    if cores is None and not latency:
        return simulate(schedule, cost)
    return pipeline_replay(schedule, cost, cores, latency)


def shared_cores_per_pipeline(pp: int, on_gpu: bool, local_world: int, threads: int,
                              cpu_count: int) -> float | None:
    """Cores available to one pipeline's ranks when this node's ranks oversubscribe its CPU."""
    if not on_gpu and local_world * threads > cpu_count:
        return cpu_count * pp / (local_world * threads)
    return None


def matching_mode(modes: tuple[str, ...], shared_cores: float | None) -> str:
    """The calibration that matches the run: with a core (or device) per rank all stages
    compute at once, as in the concurrent calibration; oversubscribed, the isolated one
    (plus processor sharing in the replay)."""
    if shared_cores and "isolated" in modes:
        return "isolated"
    return "concurrent" if "concurrent" in modes else modes[0]


def variant_name(mode: str, cores: float | None, with_latency: bool) -> str:
    if not with_latency and not cores:
        return f"simulate(), {mode} calibration"
    return (f"{mode} calibration" + (" + p2p latency" if with_latency else "")
            + (f" + {cores:g} shared cores" if cores else ""))


def predict_measured(schedules: list[BenchSchedule], ordered_for: Callable[[str, str], list],
                     args: argparse.Namespace, quadratic: str, p2p_fit: dict | None,
                     variant: Variant) -> tuple[dict[str, dict], dict[str, Timeline]]:
    """Every schedule's predicted iteration in one variant, against its measured median.

    Returns the JSON entries and the simulated timelines, both by schedule key.
    """
    mode, cores, with_latency = variant
    entries, timelines = {}, {}
    for s in schedules:
        layout = s.layout
        latency = message_latency(p2p_fit, s.lengths, args.micro_batch_size, layout.config) \
            if with_latency and p2p_fit else 0.0
        result = predict(ordered_for(mode, layout.name), args.pp, args.microbatches,
                         s.lengths, layout.chunks, quadratic, s.recompute, cores, latency,
                         s.schedule)
        median = statistics.median(s.times)
        entries[s.key] = {
            "makespan_s": result.makespan, "bubble_fraction": result.bubble_fraction,
            "rel_error": result.makespan / median - 1.0, "p2p_latency_s": latency,
            "busy_s": result.busy, "variant": variant_name(*variant),
        }
        timelines[s.key] = result.timeline
    return entries, timelines


def predict_larger(schedules: list[BenchSchedule], args: argparse.Namespace,
                   plain_order: list[dict], inter_order: list[dict] | None,
                   quadratic: str) -> list[dict]:
    """Weak scaling to --predict-pp x --predict-microbatches with one device per stage."""
    seq = {s.key: s for s in schedules}
    candidates = [("1f1b", [args.seq_length], 1, "1f1b")]
    for key in ("seq1f1b-uniform", "seq1f1b-balanced", "seq1f1b-zb-h1", "seq1f1b-zb-h2",
                AUTO_KEY):
        if key in seq:
            candidates.append((key, seq[key].lengths, 1, seq[key].schedule))
    if inter_order is not None:
        candidates.append(("1f1b-interleaved", [args.seq_length], args.vpp, "1f1b"))
        for key in ("seq1f1b-interleaved", "seq1f1b-interleaved-zb-h1"):
            if key in seq:
                candidates.append((key, seq[key].lengths, args.vpp, seq[key].schedule))
    predictions = []
    for p_ in args.predict_pp:
        for m_ in args.predict_microbatches:
            row = {"p": p_, "m": m_, "schedules": {}}
            for key, lengths, v, variant in candidates:
                if v > 1 and p_ < 2:
                    continue
                order = plain_order if v == 1 else inter_order
                stage_fits = extrapolated_fits(order, p_ * v)
                result = predict(stage_fits, p_, m_, lengths, v, quadratic, variant=variant)
                row["schedules"][key] = {"makespan_s": result.makespan,
                                         "bubble_fraction": result.bubble_fraction,
                                         "peak_inflight_rank0_units": result.peak_inflight[0]}
            predictions.append(row)
    return predictions


def _by_stage_name(per_layout: dict) -> dict:
    """{(stage, chunk): x} -> {"stage.chunk": x} per layout, for JSON."""
    return {name: {f"{k[0]}.{k[1]}": v for k, v in per.items()}
            for name, per in per_layout.items()}


def backend_is_dense(args: argparse.Namespace) -> bool:
    """Whether the benchmark's attention computes masked scores too (Megatron's local one)."""
    return backend_attention(args) == AttentionKind.DENSE


def calibrated_predictions(schedules: list[BenchSchedule], layouts: dict[str, Layout],
                           samples: CalibrationSamples, args: argparse.Namespace,
                           shared_cores: float | None
                           ) -> tuple[dict, list[dict], dict[str, Timeline]]:
    """Fit the samples, predict, and set every schedule's ``prediction``.

    Returns the ``calibration`` section of results.json, the larger-pipeline
    predictions and the primary variant's simulated timelines by schedule key.
    """
    modes, raw = samples.modes, samples.raw
    mode_used = matching_mode(modes, shared_cores)
    other_modes = [mode for mode in modes if mode != mode_used]
    p2p_fit = None
    if samples.p2p_rows is not None:
        p2p_fit = fit_p2p(samples.p2p_rows)
        say(f"> p2p one-way time: {p2p_fit['alpha'] * 1e3:.3f} ms + "
            f"{p2p_fit['beta'] * 1e9:.3f} ns/byte ({len(samples.p2p_rows)} samples)")
    quadratic, fit_error = quadratic_for(raw[mode_used], backend_is_dense(args))
    fits = {mode: {name: fit_costs(rows, quadratic) for name, rows in per.items()}
            for mode, per in raw.items()}

    def ordered_for(mode: str, layout_name: str) -> list[dict]:
        return virtual_fits(fits[mode][layout_name], args.pp, layouts[layout_name].chunks)

    has_latency = p2p_fit is not None
    variants: list[Variant] = [(mode_used, shared_cores, has_latency)]
    if shared_cores or has_latency:
        variants.append((mode_used, None, False))
    variants += [(mode, None, has_latency) for mode in other_modes]
    primary = variant_name(*variants[0])
    entries, simulated = predict_measured(schedules, ordered_for, args, quadratic, p2p_fit,
                                          variants[0])
    for s in schedules:
        s.prediction = entries[s.key]
        say(f"> predicted {s.key} ({primary}): {s.prediction['makespan_s'] * 1e3:.0f} ms "
            f"(measured median {statistics.median(s.times) * 1e3:.0f} ms, error "
            f"{s.prediction['rel_error']:+.1%}), bubble {s.prediction['bubble_fraction']:.1%}")
    other = []
    for variant in variants[1:]:
        preds, _ = predict_measured(schedules, ordered_for, args, quadratic, p2p_fit, variant)
        other.append({"variant": variant_name(*variant), "predictions": preds})
        for key, value in preds.items():
            say(f"> predicted {key} ({variant_name(*variant)}): "
                f"{value['makespan_s'] * 1e3:.0f} ms (error {value['rel_error']:+.1%})")

    inter_order = ordered_for(mode_used, "interleaved") if "interleaved" in layouts else None
    predictions = predict_larger(schedules, args, ordered_for(mode_used, "plain"), inter_order,
                                 quadratic)
    calibration = {
        "cases": samples.cases, "mode_used": mode_used, "prediction_variant": primary,
        "shared_cores": shared_cores, "quadratic": quadratic, "p2p": p2p_fit,
        "fit_error": fit_error,
        "fits": _by_stage_name(fits[mode_used]),
        "fits_other_mode": _by_stage_name(fits[other_modes[0]]) if other_modes else None,
        "samples": {mode: _by_stage_name(per_mode) for mode, per_mode in raw.items()},
        "other_variants": other,
    }
    return calibration, predictions, simulated
