"""results.md: the result rows, measured timelines, calibration and predictions as tables."""

from __future__ import annotations

import argparse

from megatron_seq1f1b.bench import cp_report
from megatron_seq1f1b.bench.units import fmt_mib
from megatron_seq1f1b.planner.peak_memory import MMAP_THRESHOLD_HINT


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _header(args: argparse.Namespace, meta: dict) -> list[str]:
    backend = meta.get("attention_backend", getattr(args, "attention_backend", "local"))
    length = meta.get("document_length", getattr(args, "document_length", None))
    lines = [f"# Benchmark: p={args.pp}, m={args.microbatches}, k={args.splits}"
             + (f", v={args.vpp}" if args.vpp else "") + f", {backend} attention"
             + (f", packed documents (mean {length:g} tokens)" if length is not None
                else ", unpacked"), ""]
    lines.append(
        f"Model: {args.num_layers} layers, hidden {args.hidden_size}, "
        f"{args.num_attention_heads} heads, vocabulary {args.vocab_size}, "
        f"{args.position_embedding_type}"
        + (f", sliding window {args.window_size}" if getattr(args, "window_size", None) is not None
           else "")
        + (f" (every {args.window_attn_skip_freq}th layer full)"
           if getattr(args, "window_attn_skip_freq", None) else "")
        + (f", MoE {args.num_experts} experts top-{args.moe_router_topk} (aux loss "
           f"{args.moe_aux_loss_coeff})" if getattr(args, "num_experts", None) else "")
        + f"; sequence {args.seq_length}, micro-batch size "
        f"{args.micro_batch_size}, tp {args.tp}, dp {meta['dp']}. {meta['device']}, "
        f"{meta['world_size']} ranks, {meta['cpu_count']} CPU cores, "
        f"{meta['threads_per_rank']} thread(s) per rank; torch {meta['torch']}, Megatron-Core "
        f"{meta.get('megatron_core', '?')}. {args.iters} measured runs per "
        f"schedule after {args.warmup} warm-up runs, alternating; forward-backward only "
        "(no optimizer step).")
    if not meta["memory_valid"]:
        lines += ["", f"**Peak memory is not valid in this run**: CPU without "
                  f"{MMAP_THRESHOLD_HINT} (freed tensors stay resident)."]
    return lines


def _schedule_table(rows: list[dict], meta: dict) -> list[str]:
    lines = [""]
    lines.append("| schedule | segments | median ms (min–max) | tokens/s | × 1F1B | paired × 1F1B "
                 "(min–max) | bubble part × busy part | CPU s per stage | CPU × 1F1B | peak MiB "
                 "per stage | stage-0 mem × 1F1B | predicted ms | pred. error |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|")
    for r in rows:
        ref = "vs_1f1b_interleaved" if r["vpp"] and "speedup_vs_1f1b_interleaved" in r \
            else "vs_1f1b"
        mem = (r.get(f"peak_ratio_{ref}") or [None])[0]
        pred = r.get("prediction") or {}
        segs = ("-" if r["megatron"] else "per micro-batch" if r["partition"] == "documents"
                else "/".join(str(n) for n in r["lengths"]))
        paired = "-"
        if r.get(f"paired_speedup_{ref}") is not None:
            low, high = r[f"paired_speedup_{ref}_range"]
            paired = f"{r[f'paired_speedup_{ref}']:.3f} ({low:.2f}–{high:.2f})"
        parts = r.get(f"parts_{ref}")
        split = f"{parts[0]:.2f} × {parts[1]:.2f}" if parts else "-"
        flag = " ⚠" if r.get("fairness") else ""
        lines.append(
            f"| {r['label']}{flag} | {segs} | {r['median_s'] * 1e3:.0f} ({r['min_s'] * 1e3:.0f}–"
            f"{r['max_s'] * 1e3:.0f}) | {r['tokens_per_s']:.0f} | "
            f"{_num(r.get(f'speedup_{ref}'), '.3f')} | {paired} | {split} | "
            f"{' / '.join(f'{x:.2f}' for x in r['cpu_s_per_stage'])} | "
            f"{_num(r.get(f'cpu_ratio_{ref}'), '.3f')} | "
            f"{' / '.join(fmt_mib(x) for x in r['peak_bytes_per_stage'])} | {_num(mem, '.2f')} | "
            f"{_num(pred.get('makespan_s') and pred['makespan_s'] * 1e3, '.0f')} | "
            f"{_num(pred.get('rel_error'), '+.1%')} |")
    lines.append("")
    reference = meta.get("reference", "1f1b")
    lines.append("Ratios of interleaved schedules are against Megatron interleaved 1F1B when it "
                 "ran, of the others against "
                 + ("Megatron 1F1B" if reference == "1f1b" else
                    f"the reference row {reference} (× 1F1B columns; Megatron 1F1B did not run)")
                 + ". Paired: median over rounds of the "
                 "ratio of the two schedules' times in the same round. CPU s: process CPU time "
                 "of the forward-backward per stage (insensitive to other processes' load; "
                 "includes p2p threads). Peak memory: real allocations above the resident set at "
                 "the start of the run (median over runs). Load average before/after: "
                 f"{meta['loadavg_start']:.1f} / {meta['loadavg_end']:.1f}. Bubble part × "
                 "busy part: the speed-up of the recorded timelines split into the schedule's "
                 "part (less idle time) and the compute's (busy time).")
    flagged = [r for r in rows if r.get("fairness")]
    if flagged:
        lines += ["", "⚠ A baseline defect, not a result:"]
        lines += [f"- {r['label']}: {r['fairness']}." for r in flagged]
    return lines


def _timeline_table(rows: list[dict], timeline_runs: int) -> list[str]:
    timed = [r for r in rows if r.get("timeline")]
    if not timed:
        return []
    lines = ["", f"## Measured timelines (median of {timeline_runs} recorded "
             "iteration(s))", "",
             "Busy: time inside compute actions; bubble: idle share of ranks × makespan; "
             "busy ÷ simulated busy > 1 means the actions ran slower in the pipeline than "
             "the calibration predicts.", "",
             "| schedule | makespan ms | bubble (idle share) | busy ms per rank | p2p wait ms "
             "per rank | simulated bubble | busy ÷ simulated busy |",
             "|---|---:|---:|---|---|---:|---:|"]
    for r in timed:
        t = r["timeline"]
        sim = (r.get("prediction") or {}).get("bubble_fraction")
        sim_busy = (r.get("prediction") or {}).get("busy_s")
        inflation = f"{sum(t['busy_s']) / sum(sim_busy):.2f}" if sim_busy else "-"
        lines.append(
            f"| {r['label']} | {t['makespan_s'] * 1e3:.0f} | {t['bubble_fraction']:.1%} | "
            f"{' / '.join(f'{x * 1e3:.0f}' for x in t['busy_s'])} | "
            f"{' / '.join(f'{x * 1e3:.0f}' for x in t['p2p_wait_s']) or '-'} | "
            f"{'-' if sim is None else f'{sim:.1%}'} | {inflation} |")
    return lines


def _calibration_section(rows: list[dict], calibration: dict) -> list[str]:
    lines = ["", "## Cost calibration", ""]
    lines.append(f"Predictions: {calibration['prediction_variant']}; quadratic term: "
                 f"{calibration['quadratic']} (mean relative fit error of both: "
                 + ", ".join(f"{q} {e:.1%}" for q, e in calibration["fit_error"].items())
                 + "). time = a·len + c·quad + d per stage, forward / backward:")
    if calibration.get("p2p"):
        p2p = calibration["p2p"]
        lines += ["", f"Pipeline message (ping-pong between neighbouring stages): "
                  f"{p2p['alpha'] * 1e3:.3f} ms + {p2p['beta'] * 1e9:.3f} ns/byte one "
                  "way; used as the per-step latency of the replay."]
    lines += ["",
              "| layout | stage.chunk | F a (µs/token) | F c (ns/quad) | F d (ms) | "
              "B a (µs/token) | B c (ns/quad) | B d (ms) | fit error F / B |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for layout, fits in calibration["fits"].items():
        for key, fit in fits.items():
            f_, b_ = fit["F"], fit["B"]
            lines.append(
                f"| {layout} | {key} | {f_['a'] * 1e6:.2f} | {f_['c'] * 1e9:.2f} | "
                f"{f_['d'] * 1e3:.2f} | {b_['a'] * 1e6:.2f} | {b_['c'] * 1e9:.2f} | "
                f"{b_['d'] * 1e3:.2f} | {f_['mean_rel_err']:.1%} / {b_['mean_rel_err']:.1%} |")
    if calibration.get("other_variants"):
        lines += ["", "Predictions of the measured configuration (primary: "
                  f"{calibration['prediction_variant']}) and with the other variants:", "",
                  "| schedule | measured ms | " + " | ".join(
                      [calibration["prediction_variant"]]
                      + [o["variant"] for o in calibration["other_variants"]]) + " |",
                  "|---|---:|" + "---:|" * (1 + len(calibration["other_variants"]))]
        for r in rows:
            cells = [r["prediction"]] + [o["predictions"][r["key"]]
                                         for o in calibration["other_variants"]]
            lines.append(f"| {r['label']} | {r['median_s'] * 1e3:.0f} | " + " | ".join(
                f"{c['makespan_s'] * 1e3:.0f} ({c['rel_error']:+.1%})" for c in cells)
                + " |")
    return lines


def _larger_pipelines(predictions: list[dict], calibration: dict) -> list[str]:
    lines = ["", "## Calibrated predictions for larger pipelines", "",
             "simulate() with the fitted costs; weak scaling (every stage holds the measured "
             "per-stage layers, first/last stage as measured); one device per stage; "
             f"{calibration['mode_used']} calibration; no p2p latency.", ""]
    keys = [k for k in predictions[0]["schedules"]]
    lines.append("| p | m | " + " | ".join(f"{k} bubble" for k in keys) + " | "
                 + " | ".join(f"{k} × 1F1B" for k in keys if k != "1f1b") + " |")
    lines.append("|---:|---:|" + "---:|" * (2 * len(keys) - ("1f1b" in keys)))
    for row in predictions:
        sch = row["schedules"]
        base = sch.get("1f1b", {}).get("makespan_s")
        cells = [f"{sch[k]['bubble_fraction']:.1%}" for k in keys]
        cells += [f"{base / sch[k]['makespan_s']:.3f}" if base else "-"
                  for k in keys if k != "1f1b"]
        lines.append(f"| {row['p']} | {row['m']} | " + " | ".join(cells) + " |")
    return lines


def _zero_bubble_table(rows: list[dict]) -> list[str]:
    compared = [r for r in rows if r.get("vs_seq1f1b")]
    if not compared:
        return []
    lines = ["", "## Zero bubble against Seq1F1B", "",
             "| schedule | against | tokens/s × | paired × (min–max) | measured bubble × | "
             "stage-0 peak memory × |", "|---|---|---:|---:|---:|---:|"]
    for r in compared:
        v = r["vs_seq1f1b"]
        low, high = v["paired_range"]
        lines.append(f"| {r['label']} | {v['key']} | {v['speedup']:.3f} | "
                     f"{v['paired_speedup']:.3f} ({low:.2f}–{high:.2f}) | "
                     f"{_num(v['bubble_ratio'], '.2f')} | {_num(v['stage0_peak_ratio'], '.2f')} |")
    return lines


def _documents_table(rows: list[dict], meta: dict) -> list[str]:
    """Per row: predicted segment cost spread and attention work skipped on the packed
    documents (bench/document_stats.py), beside tokens/s, speedup, memory and bubble."""
    have = [r for r in rows if r.get("documents")]
    if not have:
        return []
    backend = meta.get("attention_backend", "local")
    lines = ["", "## Packed documents", "",
             f"{backend} attention. Cost spread: max / min predicted segment cost (the cost "
             "model the documents partition cuts with, on each micro-batch's documents), "
             "worst micro-batch (mean); 1.00 with one segment. Pairs skipped: the share of "
             "a dense causal run's attention pairs (same segments, one document per sample) "
             "that documents let this row skip.", "",
             "| schedule | segments (first micro-batch) | cost spread worst (mean) | "
             "attention pairs per sample | pairs skipped | tokens/s | × 1F1B | stage-0 peak "
             "MiB | bubble |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in have:
        d = r["documents"]
        bubble = (r.get("timeline") or {}).get("bubble_fraction")
        lines.append(
            f"| {r['label']} | {'/'.join(map(str, d['segments_per_microbatch'][0]))} | "
            f"{d['cost_spread']:.2f} ({d['cost_spread_mean']:.2f}) | "
            f"{d['attention_pairs']:.0f} | {d['attention_pairs_skipped']:.1%} | "
            f"{r['tokens_per_s']:.0f} | {_num(r.get('speedup_vs_1f1b'), '.3f')} | "
            f"{fmt_mib(r['peak_bytes_per_stage'][0])} | {_num(bubble, '.1%')} |")
    return lines


def auto_plan_lines(auto: dict) -> list[str]:
    """The planner's choice against the measured sweep: ratio (hit/miss) and prediction error."""
    plan = auto["plan"]
    lines = ["", "## Automatic plan vs a sweep of k", "",
             f"Chosen (from the {plan['calibration_mode']} calibration, {plan['timing']} "
             f"timing): k={plan['k']} {plan['partition']} {plan['schedule']}, "
             f"segments {'/'.join(map(str, plan['lengths']))}; predicted "
             f"{plan['predicted_s'] * 1e3:.0f} ms (the planner's replay, with its message time), "
             f"measured median {auto['auto_median_s'] * 1e3:.0f} ms: prediction error "
             f"**{auto['prediction_error']:+.1%}**.", ""]
    if auto["best_key"] is None:
        lines.append(f"Auto: {auto['auto_tokens_per_s']:.0f} tokens/s; no sweep row "
                     "(--sweep-splits) to compare with.")
    else:
        verdict = "hit" if auto["ratio"] >= auto["target"] else "miss"  # of the sweep's runs
        lines.append(
            f"Auto {auto['auto_tokens_per_s']:.0f} tokens/s, best measured k={auto['best_k']} "
            f"({auto['best_key']}) {auto['best_tokens_per_s']:.0f} tokens/s: auto / best = "
            f"**{auto['ratio']:.3f}** (paired {auto['paired_ratio']:.3f}); target ≥ "
            f"{auto['target']:.2f}: **{verdict}**. Sweep tokens/s: "
            + ", ".join(f"k={k} {t:.0f}" for k, t in auto["sweep"]) + ".")
    if auto.get("confirmation"):
        lines += [""] + confirmation_lines(auto["confirmation"], auto["target"])
    lines += ["", "```", plan["table"], "```"]
    return lines


def confirmation_lines(confirmed: dict, target: float) -> list[str]:
    """The confirmation race: auto / rival per rival, when each left, and the verdict."""
    low, high = confirmed["interval"]
    looks = confirmed.get("looks") or [confirmed["rounds"]]
    lines = [f"Confirmation ({confirmed['rounds']} of at most "
             f"{confirmed.get('max_rounds', confirmed['rounds'])} more rounds of auto and its "
             "closest rivals alone, mirrored order; a rival leaves once its interval is on one "
             f"side of the target, looks after rounds {', '.join(map(str, looks))}, intervals "
             f"widened for {len(looks)} look(s) to 95 % overall, z={confirmed.get('z', 1.96):.3f})"
             f": auto / {confirmed['against']} = **{confirmed['ratio']:.3f}** (interval "
             f"{low:.3f}–{high:.3f}); target ≥ {target:.2f}: **{confirmed['verdict']}**.", "",
             "| rival | rounds | median ms | auto / rival (geometric mean) | interval | decided |",
             "|---|---:|---:|---:|---|---|"]
    for key, r in confirmed["rivals"].items():
        rounds = r.get("rounds", len(r["ratios"]))
        lines.append(f"| {key} | {rounds} | {r['median_s'] * 1e3:.0f} | {r['ratio']:.3f} | "
                     f"{r['low']:.3f}–{r['high']:.3f} | {r.get('decided') or '-'} |")
    control = confirmed.get("same_plan")
    if control:
        lines.append(f"| {control['key']} (same plan as auto: control, true ratio 1) | "
                     f"{len(control['ratios'])} | {control['median_s'] * 1e3:.0f} | "
                     f"{control['ratio']:.3f} | {control['low']:.3f}–{control['high']:.3f} | - |")
        lines += ["", f"{control['key']} runs auto's own plan: its ratio differs from 1 by "
                  "noise alone, and per round auto's time is the geometric mean of both rows' "
                  "runs (samples of one plan)."]
    return lines


def markdown(rows: list[dict], args: argparse.Namespace, meta: dict, calibration: dict | None,
             predictions: list[dict], auto: dict | None = None) -> str:
    """The whole results.md."""
    lines = _header(args, meta) + _schedule_table(rows, meta)
    if auto:
        lines += auto_plan_lines(auto)
    lines += _zero_bubble_table(rows)
    if meta.get("context_parallel_size", 1) > 1 or any(
            r.get("stage0_predicted_bytes") is not None for r in rows):
        lines += cp_report.table(rows, meta)
    lines += _timeline_table(rows, args.timeline_runs)
    lines += _documents_table(rows, meta)
    if calibration:
        lines += _calibration_section(rows, calibration)
    if predictions:
        lines += _larger_pipelines(predictions, calibration)
    return "\n".join(lines) + "\n"
