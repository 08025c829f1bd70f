"""Predictions of published pipeline configurations from one-GPU calibrations.

Two configurations of the Seq1F1B paper's kind, on 80 GB GPUs (issue 27):

* ``1.3b-pp4``: GPT 1.3B (24 layers, hidden 2048, 16 heads, ffn 8192, vocabulary 50257,
  RoPE, untied embeddings), 32768 tokens, PP=4, TP=1, DP=2, micro-batch 1, 4
  micro-batches per pipeline, bf16, flash attention, distributed optimizer; Seq1F1B
  k = 1, 2, 4, 8 balanced.
* ``2.7b-pp8``: GPT 2.7B (32 layers, hidden 2560, 32 heads, ffn 10240, vocabulary 50257;
  embeddings tied, Megatron-LM's default), PP=8, TP=1, DP=1, micro-batch 1, 16
  micro-batches, 16384 / 24576 / 32768 tokens, bf16, flash: Megatron's 1F1B, interleaved
  1F1B (2 chunks per rank), Seq1F1B k=4 and interleaved Seq1F1B k=4.

Time per iteration is the planner's replay of every rank's steps with a
calibration's per-segment costs (:func:`megatron_seq1f1b.planner.choose_plan` with one
candidate); memory per stage its :class:`~megatron_seq1f1b.planner.MemoryModel`
(weights, main gradients, Adam states, activations). A calibration per model shape,
in the planner's JSON format: one file (one stage: the same costs on every stage;
several: pipeline order, extrapolated), or three files ``first,middle,last`` of stages
rehearsed alone (``python -m megatron_seq1f1b.rehearse --save-calibration``), combined
here. Interleaved rows need virtual stages of fewer layers than the calibrated ones:
the middle stage's costs scale with the layers, the first and last keep their
difference to it (embedding; output layer and loss).

``tokens_per_s_vs_k1`` is relative to the same configuration and length run with
Megatron's 1F1B (Seq1F1B k=1, one chunk per rank). Writes ``{"rows": [...]}`` and a
markdown table with the assumptions and the command::

    python -m megatron_seq1f1b.bench.predictions \\
        --calibration 1.3b-pp4=first.json,middle.json,last.json \\
        --calibration 2.7b-pp8=first.json,middle.json,last.json \\
        --out docs/benchmarks/predictions.json --markdown docs/benchmarks/predictions.md
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

from megatron_seq1f1b.base.flags import ArgumentParser, non_negative_float, positive_float
from megatron_seq1f1b.planner import (
    GIB, Calibration, Fit, MemoryModel, StageCosts, choose_plan, load_calibration,
)
from megatron_seq1f1b.planner.footprint import ModelShape, Training

SCHEDULES = ("1f1b", "1f1b-interleaved", "seq1f1b", "seq1f1b-interleaved")
DEFAULT_LINK_GB_PER_S = 100.0  # one-way pipeline messages between neighbouring GPUs
DEFAULT_LINK_LATENCY_US = 30.0


@dataclass(frozen=True)
class Published:
    """One published configuration: the model, its layout and what to predict."""

    name: str
    shape: ModelShape
    num_stages: int
    data_parallel_size: int
    num_microbatches: int
    seq_lengths: tuple[int, ...]
    rows: tuple[tuple[str, int], ...]  # (schedule, k)
    distributed_optimizer: bool
    chunks: int = 2  # model chunks per rank of the interleaved rows
    micro_batch_size: int = 1
    notes: tuple[str, ...] = field(default_factory=tuple)


CONFIGS = {
    "1.3b-pp4": Published(
        "1.3b-pp4",
        ModelShape(num_layers=24, hidden_size=2048, num_attention_heads=16,
                   ffn_hidden_size=8192, vocab_size=50257, tied_embeddings=False),
        num_stages=4, data_parallel_size=2, num_microbatches=4, seq_lengths=(32768,),
        rows=tuple(("seq1f1b", k) for k in (1, 2, 4, 8)), distributed_optimizer=True,
        notes=("untied embeddings, distributed optimizer over DP=2",)),
    "2.7b-pp8": Published(
        "2.7b-pp8",
        ModelShape(num_layers=32, hidden_size=2560, num_attention_heads=32,
                   ffn_hidden_size=10240, vocab_size=50257, tied_embeddings=True),
        num_stages=8, data_parallel_size=1, num_microbatches=16,
        seq_lengths=(16384, 24576, 32768),
        rows=(("1f1b", 1), ("1f1b-interleaved", 1), ("seq1f1b", 4), ("seq1f1b-interleaved", 4)),
        distributed_optimizer=False,
        notes=("tied embeddings (Megatron-LM's default; the last stage keeps its own copy)",)),
}


def _combine_fits(a: Fit, b: Fit, c: Fit, scale: float) -> Fit:
    """``scale * b + (a - b)``, component by component, never below zero: ``b`` a middle
    stage's fit, ``a`` the one whose difference to it is kept."""
    def part(x: float, y: float) -> float:
        return max(scale * y + (x - y), 0.0)

    return Fit(part(a.a, b.a), part(a.c, b.c), part(a.d, b.d), part(a.floor, b.floor))


def _scaled(stage: StageCosts, middle: StageCosts, scale: float) -> StageCosts:
    def one(mine: Fit | None, mid: Fit | None) -> Fit | None:
        if mine is None or mid is None:
            return None
        return _combine_fits(mine, mid, mid, scale)

    return StageCosts(one(stage.forward, middle.forward), one(stage.backward, middle.backward),
                      one(stage.weight, middle.weight), one(stage.input, middle.input))


def virtual_stage_costs(calibration: Calibration, num_virtual: int, scale: float = 1.0
                        ) -> list[StageCosts]:
    """``num_virtual`` stages in pipeline order from a calibration's first, middle and last
    stage, each with ``scale`` times the calibrated stage's layers (interleaving: 1/v)."""
    stages = list(calibration.stages)
    first, last = stages[0], stages[-1]
    middle = stages[1] if len(stages) > 2 else stages[0]
    if scale == 1.0 and len(stages) == num_virtual:
        return stages
    mid = _scaled(middle, middle, scale)
    if num_virtual == 1:
        return [_scaled(first, middle, scale)]
    return ([_scaled(first, middle, scale)] + [mid] * (num_virtual - 2)
            + [_scaled(last, middle, scale)])


def load_shape_calibration(spec: str) -> Calibration:
    """One calibration file, or ``first,middle,last`` one-stage files combined."""
    paths = [p for p in spec.split(",") if p]
    calibrations = [load_calibration(p) for p in paths]
    if len(calibrations) == 1:
        return calibrations[0]
    if len(calibrations) != 3 or any(len(c.stages) != 1 for c in calibrations):
        raise ValueError(f"{spec}: give one calibration file, or three one-stage files "
                         "first,middle,last")
    quadratics = {c.quadratic for c in calibrations}
    if len(quadratics) > 1:
        raise ValueError(f"{spec}: the stage calibrations use different quadratic terms "
                         f"{sorted(quadratics)}; calibrate them with the same attention")
    first = calibrations[0]
    return replace(first, stages=tuple(c.stages[0] for c in calibrations),
                   source=" | ".join(c.source for c in calibrations))


def _config(shape: ModelShape) -> SimpleNamespace:
    """What the FLOP model (the balanced partition) reads."""
    return SimpleNamespace(
        hidden_size=shape.hidden_size, num_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads, kv_channels=shape.kv_channels,
        num_query_groups=shape.num_query_groups, ffn_hidden_size=shape.ffn,
        gated_linear_unit=shape.gated_linear_unit)


def predict_config(published: Published, calibration: Calibration, *,
                   link_gb_per_s: float = DEFAULT_LINK_GB_PER_S,
                   link_latency_us: float = DEFAULT_LINK_LATENCY_US,
                   activation_scale: float = 1.0, multiple_of: int = 64) -> list[dict]:
    """Every row of one configuration: the issue's fields, plus ``_``-prefixed details."""
    shape, p = published.shape, published.num_stages
    per_token = published.micro_batch_size * shape.hidden_size * 2  # bf16 message bytes
    message = Fit(per_token / (link_gb_per_s * 1e9), 0.0, link_latency_us * 1e-6)
    memory = MemoryModel(shape, Training("bf16", optimizer="adam",
                                         distributed_optimizer=published.distributed_optimizer,
                                         data_parallel_size=published.data_parallel_size),
                         flash=True, activation_scale=activation_scale)
    def plan_of(seq: int, k: int, v: int):
        stages = virtual_stage_costs(calibration, p * v, 1.0 / v)
        costs = replace(calibration, stages=tuple(stages), message=message)
        return choose_plan(seq, p, published.num_microbatches, num_model_chunks=v,
                           micro_batch_size=published.micro_batch_size, calibration=costs,
                           config=_config(shape), vocab_size=shape.vocab_size, splits=[k],
                           partitions=["balanced"], schedules=["1f1b"],
                           multiple_of=multiple_of, min_segment_length=1,
                           memory_model=memory).plan

    rows = []
    for seq in published.seq_lengths:
        baseline = plan_of(seq, 1, 1)  # Megatron's 1F1B: Seq1F1B k=1, one chunk per rank
        tokens = (published.num_microbatches * published.micro_batch_size * seq
                  * published.data_parallel_size)
        for schedule, k in published.rows:
            v = published.chunks if schedule.endswith("interleaved") else 1
            plan = baseline if (k, v) == (1, 1) else plan_of(seq, k, v)
            busiest = max(range(p), key=lambda r: plan.stages[r]["total"])
            rows.append({
                "config": published.name, "seq_length": seq, "schedule": schedule, "k": k,
                "partition": "balanced",
                "tokens_per_s_vs_k1": round(baseline.time / plan.time, 4),
                "peak_gib": round(plan.stages[busiest]["total"] / GIB, 2),
                "_time_s": plan.time, "_tokens_per_s": tokens / plan.time,
                "_bubble": plan.bubble, "_lengths": list(plan.lengths), "_chunks": v,
                "_busiest_stage": busiest,
                "_stages_gib": [round(st["total"] / GIB, 2) for st in plan.stages]})
    return rows


def public_rows(rows: Sequence[dict]) -> list[dict]:
    """The issue's format: the fields without a leading underscore."""
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def markdown(rows: Sequence[dict], sources: dict[str, str], assumptions: Sequence[str],
             command: str, gpu_gib: float = 80.0) -> str:
    """The table for docs/benchmarks.md, with what it assumes and how it was made."""
    lines = [
        "| config | tokens | schedule | k | chunks | lengths | iteration (s) | tokens/s vs k=1 "
        f"| busiest stage (GiB) | fits {gpu_gib:g} GiB |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lengths = r["_lengths"]
        text = ",".join(map(str, lengths)) if len(lengths) <= 4 else \
            f"{lengths[0]},{lengths[1]},..,{lengths[-1]}"
        lines.append(
            f"| {r['config']} | {r['seq_length']} | {r['schedule']} | {r['k']} | {r['_chunks']}"
            f" | {text} | {r['_time_s']:.3f} | {r['tokens_per_s_vs_k1']:.3f} | "
            f"{r['peak_gib']:.1f} (stage {r['_busiest_stage']}) | "
            f"{'yes' if r['peak_gib'] <= gpu_gib else 'no'} |")
    lines += ["", "Calibrations:"] + [f"- `{name}`: {text}" for name, text in sources.items()]
    lines += ["", "Assumed:"] + [f"- {a}" for a in assumptions]
    lines += ["", "Made with:", "", "```", command, "```"]
    return "\n".join(lines) + "\n"


def assumptions(link_gb_per_s: float, link_latency_us: float, activation_scale: float
                ) -> list[str]:
    return [
        "unit times are the calibrating GPU's (H200); on another GPU the absolute times "
        "scale, and the ratios between schedules carry as long as its compute, host "
        "dispatch and links scale alike (the host dispatch floors are the H200 host's)",
        f"pipeline messages {link_gb_per_s:g} GB/s one way plus {link_latency_us:g} us, sends "
        "finishing a step later (the executor's transports)",
        "iteration = the pipeline's forward-backward; the data-parallel gradient reduction "
        "and the optimizer step are left out (the same for every k of a configuration)",
        "memory per stage = bf16 weights + fp32 main gradients + Adam (fp32 master weights "
        "and two moments, sharded over DP with the distributed optimizer) + activations "
        "replayed unit by unit with footprint.activation_bytes_per_token"
        + (f" x {activation_scale:g} (measured / estimated)" if activation_scale != 1.0
           else " (not scaled by a measurement)"),
        "segment lengths multiples of 64 (the executor's default on CUDA), balanced by FLOPs",
        "vocabulary 50257 as given (Megatron-LM would pad it to 50304: +0.1 M parameters)",
    ]


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m megatron_seq1f1b.bench.predictions",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", action="append", default=[], metavar="CONFIG=FILE[,..]",
                   help=f"per configuration ({', '.join(CONFIGS)}): a calibration file, or "
                        "first,middle,last one-stage files")
    p.add_argument("--link-gb-per-s", type=positive_float, default=DEFAULT_LINK_GB_PER_S)
    p.add_argument("--link-latency-us", type=non_negative_float, default=DEFAULT_LINK_LATENCY_US)
    p.add_argument("--activation-scale", type=positive_float, default=1.0,
                   help="multiply the estimated activations (e.g. a rehearsal's measured / "
                        "predicted)")
    p.add_argument("--gpu-gib", type=positive_float, default=80.0)
    p.add_argument("--out", required=True, help="predictions.json")
    p.add_argument("--markdown", help="also write the table here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {}
    for item in args.calibration:
        name, _, spec = item.partition("=")
        if name not in CONFIGS or not spec:
            parser.error(f"--calibration {item!r}: use CONFIG=FILE with CONFIG one of "
                         f"{', '.join(CONFIGS)}")
        given[name] = spec
    if not given:
        parser.error("give at least one --calibration CONFIG=FILE")
    rows, sources = [], {}
    for name, spec in given.items():
        calibration = load_shape_calibration(spec)
        sources[name] = f"{spec} ({calibration.source})"
        rows += predict_config(CONFIGS[name], calibration, link_gb_per_s=args.link_gb_per_s,
                               link_latency_us=args.link_latency_us,
                               activation_scale=args.activation_scale)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": public_rows(rows)}, indent=1) + "\n")
    command = "python -m megatron_seq1f1b.bench.predictions " + shlex.join(argv)
    table = markdown(rows, sources, assumptions(args.link_gb_per_s, args.link_latency_us,
                                                args.activation_scale), command, args.gpu_gib)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
