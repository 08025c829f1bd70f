"""``scripts/benchmark.py --variable-lengths``: micro-batches of different lengths, framed honestly.

The iteration's global batch is ``m x g`` sequences with seeded log-normal lengths
(``--length-mu``, ``--length-sigma``, clipped to ``--length-min`` .. ``--length-max``; ``g`` =
``--sequences-per-microbatch``), each a packed THD micro-batch (flash attention) with
one document per sequence, and ``config.variable_seq_lengths=True`` for every row:

* ``1f1b``: Megatron's 1F1B on the micro-batches as they come (``g`` consecutive
  sequences each), exchanging a shape before every message;
* ``1f1b-regrouped``: Megatron's 1F1B on the same sequences regrouped into ``m``
  micro-batches of about equal tokens (:func:`~megatron_seq1f1b.planner.variable.regroup`):
  what careful users do today against imbalance;
* ``seq1f1b-k{K}``: Seq1F1B, ``K`` segments per micro-batch (``--splits``), cut at
  document ends (the ``documents`` partition);
* ``seq1f1b-{T}tok``: Seq1F1B with a token budget per segment (``--segment-tokens``);
* ``seq1f1b-{T}tok-runs`` (``--backward-by-documents``): the same cuts, each micro-batch's
  runs of documents going backward apart (:mod:`megatron_seq1f1b.segments.document_runs`).
  Every row then runs with ``calculate_per_token_loss=True``, which that needs.

Rows alternate run by run (:mod:`~megatron_seq1f1b.bench.runner`); every row's timeline
splits its speed-up into the bubble part and the busy-time part; stage peaks come from
real allocations; after the timed runs a calibration (segments of one sequence timed on
every stage) predicts every row with :mod:`megatron_seq1f1b.planner.variable`, which cuts
as the executor cuts. Every row reports the same loss (the reports are sums, so
regrouping does not change it): the first run checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_seq1f1b.bench.lineup import BenchSchedule
from megatron_seq1f1b.bench.ranks import rank0, say

KEYS = ("1f1b", "1f1b-regrouped")


def add_arguments(parser) -> None:
    """The variable-length flags of scripts/benchmark.py."""
    from megatron_seq1f1b.base.flags import positive_float, positive_int

    group = parser.add_argument_group(
        "variable-length micro-batches (--variable-lengths; docs/variable_lengths.md)")
    group.add_argument("--variable-lengths", choices=["lognormal"], default=None,
                       help="micro-batches of different lengths: sequences of seeded log-normal "
                            "lengths, packed g per micro-batch; rows: Megatron's 1F1B as they "
                            "come and regrouped to equal tokens, Seq1F1B with --splits and with "
                            "each --segment-tokens")
    group.add_argument("--length-min", type=positive_int, default=256,
                       help="shortest sequence: lengths are clipped to [MIN, MAX] (default 256)")
    group.add_argument("--length-max", type=positive_int, default=4096,
                       help="longest sequence (default 4096; --seq-length is raised to it)")
    group.add_argument("--length-mu", type=positive_float, default=7.0,
                       help="log-normal mu of the sequence lengths (default 7.0: median ~1100)")
    group.add_argument("--length-sigma", type=positive_float, default=0.8,
                       help="log-normal sigma (default 0.8)")
    group.add_argument("--sequences-per-microbatch", type=positive_int, default=2,
                       help="sequences packed into each micro-batch as they come (default 2)")
    group.add_argument("--segment-tokens", type=positive_int, nargs="+", default=[1024],
                       metavar="T", help="Seq1F1B rows with these token budgets per segment "
                                         "(default 1024)")
    group.add_argument("--backward-by-documents", action="store_true",
                       help="add a row per budget whose micro-batches' runs of documents go "
                            "backward apart; every row then uses per-token loss")
    group.add_argument("--max-splits", type=positive_int, default=64,
                       help="the most segments a budget row gives a micro-batch (default 64)")


def sequence_lengths(args: argparse.Namespace, multiple: int = 16) -> list[int]:
    """The iteration's sequence lengths (seeded; multiples of ``multiple``)."""
    low, high = args.length_min, args.length_max
    rng = random.Random(args.seed)
    count = args.microbatches * args.sequences_per_microbatch
    return [max(low, min(high, int(rng.lognormvariate(args.length_mu, args.length_sigma))
                         // multiple * multiple)) for _ in range(count)]


def pack(samples: list[dict], lengths: list[int]) -> dict:
    """Sequences (dataset samples cut to ``lengths``) packed into one THD micro-batch: one
    document each, positions restarting, ``cu_seqlens`` and ``max_seqlen`` as Megatron-LM
    and post-training frameworks give them."""
    keys = ("tokens", "labels", "loss_mask")
    out = {key: torch.cat([s[key][0, :n] for s, n in zip(samples, lengths)]).unsqueeze(0)
           for key in keys}
    out["position_ids"] = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    out["cu_seqlens"] = torch.tensor([cu], dtype=torch.int32)
    out["max_seqlen"] = torch.tensor([max(lengths)], dtype=torch.int32)
    return out


def _documents(lengths_by_microbatch: list[list[int]]):
    from megatron_seq1f1b.segments.documents import Documents

    out = []
    for lengths in lengths_by_microbatch:
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        out.append(Documents((tuple(starts),), sum(lengths)))
    return out


def main(args: argparse.Namespace, *, model_provider: Callable, forward_step: Callable) -> int:
    """The variable-length benchmark in this torchrun process (module docstring)."""
    from megatron.core.pipeline_parallel import schedules as msched

    from megatron_seq1f1b.base.compat import megatron_core_version
    from megatron_seq1f1b.bench.layouts import build_layouts, trainer_argv
    from megatron_seq1f1b.bench.runner import diagnostic_runs, measure_rounds
    from megatron_seq1f1b.bench.summary import summarize
    from megatron_seq1f1b.bench.timelines import record_timelines
    from megatron_seq1f1b.planner.peak_memory import PeakMemory
    from megatron_seq1f1b.planner.variable import regroup
    from megatron_seq1f1b.trainer import arguments, data, setup

    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.seq_length = max(args.seq_length, args.length_max)
    plain_args = arguments.parse(trainer_argv(args, False), world)
    data.quiet_logs()
    device = setup.init_distributed(plain_args)
    out = Path(args.out)
    if rank0():
        out.mkdir(parents=True, exist_ok=True)
    layouts = build_layouts(args, plain_args, model_provider, world)
    layout = layouts["plain"]
    layout.config.variable_seq_lengths = True  # every row: Megatron's contract
    if args.backward_by_documents:  # what runs apart need; every row alike
        layout.config.calculate_per_token_loss = True
    if plain_args.data_parallel_size != 1:
        raise SystemExit("--variable-lengths: run one pipeline (world = tp x pp)")

    seqs = sequence_lengths(args)
    g, m = args.sequences_per_microbatch, args.microbatches
    tokenizer = data.make_tokenizer(plain_args)
    train, _ = data.build_datasets(plain_args, tokenizer, train_samples=len(seqs),
                                   eval_samples=1)
    stream = data.batches(train, 1, 0, 1)
    samples = [next(stream) for _ in seqs]
    came = [list(range(i * g, (i + 1) * g)) for i in range(m)]
    regrouped = regroup(seqs, m)

    def batches_of(groups):
        return [pack([samples[j] for j in group], [seqs[j] for j in group]) for group in groups]

    def rows_of(groups):
        return [[seqs[j] for j in group] for group in groups]

    batches, batches_regrouped = batches_of(came), batches_of(regrouped)
    megatron_fb = msched.get_forward_backward_func(args.pp, None)
    schedules = []
    for key, groups, made in (("1f1b", came, batches), ("1f1b-regrouped", regrouped,
                                                        batches_regrouped)):
        label = "Megatron 1F1B, " + ("as they come" if key == "1f1b"
                                      else "regrouped to equal tokens")
        row = BenchSchedule(key, label, layout, True, 1, None, [sum(r) for r in rows_of(groups)],
                            batches=made, form="packed")
        row.fb = megatron_fb
        schedules.append(row)
    seq1f1b_rows = [(f"seq1f1b-k{args.splits}", f"Seq1F1B k={args.splits} documents",
                     args.splits, None, False)]
    for t in args.segment_tokens:
        seq1f1b_rows.append((f"seq1f1b-{t}tok", f"Seq1F1B {t} tokens/segment", args.max_splits,
                             t, False))
        if args.backward_by_documents:
            seq1f1b_rows.append((f"seq1f1b-{t}tok-runs", f"Seq1F1B {t} tokens/segment, runs "
                                 "apart", args.max_splits, t, True))
    for key, label, k, tokens, apart in seq1f1b_rows:
        row = BenchSchedule(key, label, layout, False, k, "documents", [], documents="cu_seqlens",
                            batches=batches, form="packed")
        row.segment_tokens, row.backward_by_documents = tokens, apart
        row.fb = row.forward_backward()
        schedules.append(row)

    memory = PeakMemory(device)
    tokens_per_iter = sum(seqs)
    say(f"> variable lengths: p={args.pp}, m={m} micro-batches of {g} sequence(s), lengths "
        f"log-normal(mu {args.length_mu}, sigma {args.length_sigma}) in "
        f"{args.length_min}..{args.length_max}, seed {args.seed}: {seqs}")
    say("> micro-batch tokens as they come: " + str([sum(r) for r in rows_of(came)])
        + "; regrouped: " + str([sum(r) for r in rows_of(regrouped)]))
    if not measure_rounds(schedules, batches, args, forward_step, memory, tokens_per_iter):
        return 2
    diagnostic_runs(schedules, batches, args, forward_step, memory, out)
    if not args.no_timelines:
        record_timelines(schedules, batches, args, forward_step, memory)
    rows = summarize(schedules, tokens_per_iter, args.attention_backend)
    predicted = None
    if not args.no_calibration:
        predicted = _predictions(args, layouts, samples, seqs, came, regrouped, schedules,
                                 forward_step)
        for row in rows:
            row["predicted_s"] = predicted.get(row["key"])
    _ratios(rows)
    meta = {"device": "GPU/NCCL" if device.type == "cuda" else "CPU/gloo", "world_size": world,
            "cpu_count": os.cpu_count(), "threads_per_rank": torch.get_num_threads(),
            "attention_backend": args.attention_backend, "torch": torch.__version__,
            "megatron_core": megatron_core_version(), "command": " ".join(sys.argv),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "sequence_lengths": seqs, "microbatch_tokens": [sum(r) for r in rows_of(came)],
            "regrouped_tokens": [sum(r) for r in rows_of(regrouped)],
            "tokens_per_iteration": tokens_per_iter}
    if rank0():
        result = {"args": vars(args), "meta": meta, "schedules": rows}
        (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
        text = markdown(rows, args, meta)
        (out / "results.md").write_text(text)
        print("\n" + text, flush=True)
        print(f"> wrote {out}/results.json, results.md", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _predictions(args, layouts, samples, seqs, came, regrouped, schedules,
                 forward_step) -> dict[str, float]:
    """Every row's predicted iteration (seconds) from a calibration on one long sequence,
    cut as the executor cuts (:mod:`megatron_seq1f1b.planner.variable`)."""
    from megatron_seq1f1b.bench.calibration import calibrate
    from megatron_seq1f1b.bench.fit import virtual_fits
    from megatron_seq1f1b.bench.lineup import backend_attention
    from megatron_seq1f1b.bench.predict import backend_is_dense
    from megatron_seq1f1b.planner.costs import Calibration, Fit
    from megatron_seq1f1b.planner.fit import (
        fit_costs, fit_p2p, message_bytes_per_token, quadratic_for,
    )
    from megatron_seq1f1b.planner.variable import cut_rows, predict_rows
    from megatron_seq1f1b.runtime.executor_setup import document_cut
    from megatron_seq1f1b.segments.document_runs import document_runs

    layout = layouts["plain"]
    longest = max(range(len(seqs)), key=lambda j: seqs[j])
    sample = {key: value[:, :args.seq_length] for key, value in samples[longest].items()}
    raw = calibrate(args, {"plain": layout}, sample, forward_step)
    mode = "concurrent" if "concurrent" in raw.modes else raw.modes[0]
    quadratic, _ = quadratic_for(raw.raw[mode], backend_is_dense(args))
    fits = fit_costs(raw.raw[mode]["plain"], quadratic)
    calibration = Calibration.from_fits(virtual_fits(fits, args.pp, 1), quadratic)
    if raw.p2p_rows is not None:
        p2p = fit_p2p(raw.p2p_rows)
        per_token = message_bytes_per_token(args.micro_batch_size, layout.config)
        calibration = Calibration(calibration.stages, calibration.quadratic,
                                  message=Fit(p2p["beta"] * per_token, 0.0, p2p["alpha"]))
    cost, multiple = document_cut(layout.model, layout.config, args.vocab_size,
                                  attention=backend_attention(args))
    predicted = {}
    for s in schedules:
        groups = regrouped if s.key == "1f1b-regrouped" else came
        lengths = [[seqs[j] for j in group] for group in groups]
        totals = [sum(r) for r in lengths]
        documents = _documents(lengths)
        if s.megatron:
            cuts = tuple((n,) for n in totals)
        else:
            cuts = cut_rows(totals, s.k, "documents", segment_tokens=s.segment_tokens,
                            cost=cost, multiple_of=multiple, documents=documents,
                            runs_apart=s.backward_by_documents)
            if s.backward_by_documents:  # the runs are the schedule's micro-batches
                runs = document_runs(cuts, documents)
                cuts, documents = runs.rows, runs.documents(documents)
        time, _, _, _ = predict_rows(calibration, cuts, args.pp, documents=documents)
        predicted[s.key] = time
    return predicted


def _ratios(rows: list[dict]) -> None:
    """Each row against Megatron as they come and against Megatron regrouped: measured
    (median of per-round ratios), predicted, and the stage-0 peak ratio."""
    by_key = {r["key"]: r for r in rows}
    for r in rows:
        for base_key in KEYS:
            base = by_key[base_key]
            paired = [b / t for b, t in zip(base["times_s"], r["times_s"])]
            r[f"paired_vs_{base_key}"] = statistics.median(paired)
            if r.get("predicted_s") and base.get("predicted_s"):
                r[f"predicted_vs_{base_key}"] = base["predicted_s"] / r["predicted_s"]
            peaks, base_peaks = r["peak_bytes_per_stage"], base["peak_bytes_per_stage"]
            r[f"stage0_peak_vs_{base_key}"] = (peaks[0] / base_peaks[0] if base_peaks[0]
                                               else None)


def markdown(rows: list[dict], args: argparse.Namespace, meta: dict) -> str:
    """The results table: each ratio against both baselines, with its bubble and busy parts."""
    def fmt(x, spec=".2f", suffix="x"):
        return "-" if x is None else f"{x:{spec}}{suffix}"

    lines = [
        f"# Variable-length micro-batches, {meta['attention_backend']} attention "
        f"({meta['device']}, {meta['world_size']} ranks, {meta['threads_per_rank']} thread(s) "
        f"each on {meta['cpu_count']} cores)", "",
        f"p={args.pp}, m={args.microbatches} micro-batches of {args.sequences_per_microbatch} "
        f"sequence(s); lengths log-normal(mu {args.length_mu}, sigma {args.length_sigma}) "
        f"clipped to {args.length_min}..{args.length_max}, seed {args.seed}; "
        f"{args.num_layers} layers, hidden {args.hidden_size}.", "",
        f"Micro-batch tokens as they come {meta['microbatch_tokens']} "
        f"(spread {max(meta['microbatch_tokens']) / min(meta['microbatch_tokens']):.1f}x); "
        f"regrouped {meta['regrouped_tokens']}.", "",
        f"Command: `{meta['command']}`", "",
        "| row | ms/iter | vs Megatron as they come (bubble x busy) | predicted | "
        "vs Megatron regrouped | predicted | stage-0 peak vs as they come |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        parts = r.get("parts_vs_1f1b")
        split = f" ({parts[0]:.2f} x {parts[1]:.2f})" if parts else ""
        lines.append(
            f"| {r['label']} | {r['median_s'] * 1e3:.0f} | {fmt(r['paired_vs_1f1b'])}{split} | "
            f"{fmt(r.get('predicted_vs_1f1b'))} | {fmt(r['paired_vs_1f1b-regrouped'])} | "
            f"{fmt(r.get('predicted_vs_1f1b-regrouped'))} | "
            f"{fmt(r['stage0_peak_vs_1f1b'])} |")
    lines += ["", "Ratios: medians of per-round time ratios (rounds alternate the rows); the "
              "bubble and busy-time parts come from each row's recorded timeline, a run of its "
              "own timed per action: their product is that run's speed-up, not the median's; "
              "predicted: the simulator on a calibration of this machine, cutting as the "
              "executor cuts; peaks: real allocations."]
    return "\n".join(lines) + "\n"
