"""Simulate a schedule: makespan, bubble, peak in-flight activations, timeline.

Costs are per action. The default (forward 1, backward 2 per unit) makes the
textbook formulas exact: bubble ``(p-1)/(k*m+p-1)`` and a rank-0 peak of
``min(p+k-1, m*k)`` in-flight segments for non-interleaved Seq1F1B. An
attention-aware cost (:func:`segment_cost`) shows why the balanced partition
matters for long sequences.

Command line::

    python -m megatron_seq1f1b.simulate --pp 4 --microbatches 4 --splits 1 4 \
        --png docs/schedule.png --trace schedule.json

``--lengths`` simulates micro-batches of different lengths (Megatron's 1F1B on them, Seq1F1B
with ``--splits`` and ``--segment-tokens``), with FLOP costs::

    python -m megatron_seq1f1b.simulate --pp 2 --cost attention --lengths 512 4096 256 1024 \
        --splits 1 4 --segment-tokens 1024

``--seq-length``, ``--partition`` and the model's sizes are read with ``--cost attention``
only (refused with uniform costs). With ``--chunks`` > 1 any number of micro-batches is
simulated, as Seq1F1B's interleaved schedule runs them; where Megatron-Core's own
interleaved schedule would refuse it (fewer micro-batches than stages, or not a multiple
of them) the output says so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from megatron_seq1f1b.base.flags import ArgumentParser, output_file, positive_int
from megatron_seq1f1b.schedules.interleaved import ZB_H2_PROBLEM
from megatron_seq1f1b.schedules.partition import CostModel, split_sequence
from megatron_seq1f1b.schedules.plan import plan_steps
from megatron_seq1f1b.schedules.replay import TIMINGS, Timeline, replay
from megatron_seq1f1b.schedules.schedule import (
    SCHEDULES,
    Action,
    build_schedule,
    schedule_shape,
    splits_backward,
)
from megatron_seq1f1b.schedules.validate import check_link_order
from megatron_seq1f1b.schedules.zero_bubble import segment_cost_fn

CostFn = Callable[[Action, int], float]


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # compute time per rank
    bubble_fraction: float  # idle share of all ranks' time
    peak_inflight: list[int]  # per rank: max units forwarded and not yet (weight-)backwarded
    timeline: Timeline

    def summary(self) -> str:
        return (
            f"makespan {self.makespan:.2f}  bubble {self.bubble_fraction:.1%}  "
            f"peak in-flight units per rank {self.peak_inflight}"
        )


def uniform_cost(forward: float = 1.0, backward: float = 2.0, weight: float = 1.0) -> CostFn:
    """Every unit costs the same: F `forward`, B `backward`, W `weight`.

    ``backward`` is the whole backward in schedules without W; for zero-bubble
    schedules :func:`simulate` defaults to ``uniform_cost(1, 1, 1)``.
    """
    costs = {"F": forward, "B": backward, "W": weight}
    return lambda action, rank: costs[action.kind]


def segment_cost(
    lengths: Sequence[int] | Sequence[Sequence[int]],
    model: CostModel,
    backward_ratio: float = 2.0,
    num_model_chunks: int = 1,
    split_backward: bool = False,
) -> CostFn:
    """Cost proportional to a segment's FLOPs (linear part + causal attention).

    ``lengths``: the segments of every micro-batch, or one row per micro-batch where
    they differ (variable-length micro-batches, documents). Normalized so that the
    mean forward of a segment costs 1. With ``split_backward`` (zero-bubble schedules)
    B and W get the input- and weight-gradient FLOPs (:meth:`CostModel.backward_parts`),
    scaled so that B + W = ``backward_ratio`` x forward.
    """
    rows = [list(row) for row in lengths] if lengths and not isinstance(lengths[0], int) \
        else [list(lengths)]
    flops = [model.split_costs(row) for row in rows]
    units = [f for row in flops for f in row]
    mean = sum(units) / len(units) * num_model_chunks
    tables = []
    for row, row_flops in zip(rows, flops):
        table, end = [], 0
        for length, forward in zip(row, row_flops):
            end += length
            input_grads, weight_grads = model.backward_parts(length, end)
            scale = backward_ratio * forward / (input_grads + weight_grads)
            backward = (input_grads * scale, weight_grads * scale) if split_backward \
                else (backward_ratio * forward, 0.0)
            table.append({"F": forward / mean, "B": backward[0] / mean, "W": backward[1] / mean})
        tables.append(table)
    if len(tables) == 1:
        (table,) = tables
        return lambda a, rank: table[a.segment][a.kind]
    return lambda a, rank: tables[a.microbatch][a.segment][a.kind]


def unit_costs(cost: CostFn, num_splits: int) -> tuple[tuple[float, float, float], ...]:
    """Per-segment (F, B, W) of a cost that is the same for every micro-batch, chunk and rank
    (:func:`segment_cost` of one row): what a zero-bubble schedule is built and placed with."""
    return tuple(tuple(cost(Action(kind, 0, segment, 0), 0) for kind in ("F", "B", "W"))
                 for segment in range(num_splits))


def peak_inflight(actions: Sequence[Action]) -> int:
    """Most units alive at once: from F until B, or until W where W is split off.

    A pending W keeps the inputs and output gradients of its layers, so a
    zero-bubble unit counts as in flight until its W.
    """
    release = "W" if any(a.is_weight for a in actions) else "B"
    live = peak = 0
    for action in actions:
        live += action.is_forward - (action.kind == release)
        peak = max(peak, live)
    return peak


def peak_tokens(schedule: Schedule, rows: Sequence[Sequence[int]], v: int = 1
                ) -> tuple[float, ...]:
    """Per rank, most tokens of activations held (a unit from its forward to its backward,
    or to its W where W is split off), in one chunk's worth (divided by ``v``)."""
    out = []
    for actions in schedule:
        release = "W" if any(a.is_weight for a in actions) else "B"
        live = peak = 0.0
        for action in actions:
            if action.is_forward:
                live += rows[action.microbatch][action.segment] / v
                peak = max(peak, live)
            elif action.kind == release:
                live -= rows[action.microbatch][action.segment] / v
        out.append(peak)
    return tuple(out)


def placed_steps(schedule: Sequence[Sequence[Action]], num_model_chunks: int,
                 costs: Sequence | None = None) -> list:
    """The executor's steps of ``schedule``: receives placed with zero bubble's per-segment
    (or per micro-batch and segment) (F, B, W) ``costs`` and the link order checked, as the
    executor places and checks them; without ``costs``, placed for unit costs. ScheduleError
    where the executor would refuse them."""
    steps = plan_steps(schedule, num_model_chunks,
                       cost=segment_cost_fn(costs) if costs is not None else None)
    if costs is not None:
        check_link_order(steps)
    return steps


def simulate(schedule: Sequence[Sequence[Action]], cost: CostFn | None = None, *,
             costs: Sequence[tuple[float, float, float]] | None = None,
             timing: str | None = None) -> SimResult:
    """Replay the schedule with `cost(action, rank)` per action.

    Default: F=1, B=2; with W split off (zero bubble) F=B=W=1. ``costs``: a zero-bubble
    schedule's per-segment (F, B, W) estimates, the ones it was built with
    (``build_schedule(..., costs=costs)``): its receives are placed with them, as the
    executor places them (default: unit costs). ``timing``: when a step posts its transfers
    and what its compute waits for (:data:`~megatron_seq1f1b.schedules.replay.TIMINGS`;
    default ``"rendezvous"``, Megatron's batched p2p; Seq1F1B's executor on NCCL is
    ``"nccl"``, on gloo ``"gloo"``). With unit costs every timing gives the same timeline;
    with uneven ones zero bubble's differ (docs/design.md).
    """
    _, _, _, chunks = schedule_shape(schedule)
    if cost is None:
        cost = uniform_cost(1.0, 1.0, 1.0) if splits_backward(schedule) else uniform_cost()
    timeline = replay(placed_steps(schedule, chunks, costs), cost, timing=timing)
    makespan = timeline.makespan
    busy = [sum(iv.end - iv.start for iv in rank) for rank in timeline.compute]
    total = makespan * len(schedule)
    bubble = 1.0 - sum(busy) / total if total else 0.0
    return SimResult(makespan, busy, bubble, [peak_inflight(a) for a in schedule], timeline)


def bubble_formula(num_stages: int, num_microbatches: int, num_splits: int,
                   num_model_chunks: int = 1) -> float:
    """Idle share with equal unit costs: ``(p-1) / (v*k*m + p-1)``.

    Exact for non-interleaved Seq1F1B; for the interleaved variant it is what
    the simulator observes when the micro-batch groups are full (e.g. m a
    multiple of p for k=1, Megatron's interleaved 1F1B).
    """
    units = num_model_chunks * num_splits * num_microbatches
    return (num_stages - 1) / (units + num_stages - 1)


def zero_bubble_formula(num_stages: int, num_microbatches: int, num_splits: int,
                        num_model_chunks: int = 1) -> float:
    """Idle share of zb-h1 with F = B = W: ``(p-1) / (3*v*k*m + p-1)``.

    The least any schedule can have: the last stage starts ``p-1`` units late
    and has ``3*v*k*m`` units of work. zb-h1 reaches it once the first stage
    has a steady state (``k*m >= p + k - 1``).
    """
    units = 3 * num_model_chunks * num_splits * num_microbatches
    return (num_stages - 1) / (units + num_stages - 1)


# ------------------------------------------------------------------ command line


#: The flags only ``--cost attention`` reads (the segments' tokens and the model's FLOPs),
#: with their defaults; with uniform costs, giving one is refused rather than ignored.
ATTENTION_DEFAULTS = {"partition": "balanced", "seq_length": 32768, "hidden_size": 4096,
                      "num_layers": 32, "num_attention_heads": 32, "vocab_size": 50257}


def build_parser() -> ArgumentParser:
    """The simulator's flags; every number is checked as it is read."""
    parser = ArgumentParser(
        prog="python -m megatron_seq1f1b.simulate",
        description="Compare 1F1B and Seq1F1B schedules: bubble and peak activations.",
    )
    parser.add_argument("--pp", type=positive_int, default=4,
                        help="pipeline stages (default 4)")
    parser.add_argument("--microbatches", type=positive_int, default=4,
                        help="micro-batches per iteration (default 4)")
    parser.add_argument("--splits", type=positive_int, nargs="+", default=[1, 4],
                        help="segments per micro-batch; 1 is Megatron's 1F1B (default 1 4)")
    parser.add_argument("--chunks", type=positive_int, default=1,
                        help="model chunks per rank (vpp; default 1)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=["1f1b"],
                        help="1f1b (Seq1F1B) and/or the zero-bubble variants zb-h1, zb-h2 "
                             "(weight gradients W split off: F = B = W = 1; default 1f1b)")
    parser.add_argument("--timing", choices=TIMINGS, default="nccl",
                        help="when a step posts its transfers and what its compute waits for: "
                             "Seq1F1B's executor on NCCL (nccl, default, as the planner) or "
                             "gloo, or Megatron's batched p2p (rendezvous); unit costs time "
                             "alike under all of them")
    parser.add_argument("--cost", choices=["uniform", "attention"], default="uniform",
                        help="uniform unit costs (default), or FLOPs of causal segments; "
                             "--partition, --seq-length and the model's sizes are read only "
                             "with attention, and refused with uniform costs")
    d = ATTENTION_DEFAULTS
    parser.add_argument("--partition", choices=["uniform", "balanced"],
                        help=f"how segments are cut (--cost attention; default {d['partition']})")
    parser.add_argument("--seq-length", type=positive_int, metavar="TOKENS",
                        help=f"tokens per sample (--cost attention; default {d['seq_length']})")
    parser.add_argument("--hidden-size", type=positive_int, metavar="H",
                        help=f"hidden size (--cost attention; default {d['hidden_size']})")
    parser.add_argument("--num-layers", type=positive_int, metavar="LAYERS",
                        help=f"transformer layers (--cost attention; default {d['num_layers']})")
    parser.add_argument("--num-attention-heads", type=positive_int, metavar="HEADS",
                        help=f"attention heads (--cost attention; default {d['num_attention_heads']})")
    parser.add_argument("--vocab-size", type=positive_int, metavar="V",
                        help=f"vocabulary size (--cost attention; default {d['vocab_size']})")
    parser.add_argument("--lengths", type=positive_int, nargs="+", metavar="TOKENS",
                        help="micro-batches of these lengths, one each (variable-length "
                             "micro-batches; sets --microbatches; needs --cost attention): "
                             "--splits k cuts each into k segments (1: Megatron's 1F1B on them), "
                             "--segment-tokens T into ceil(length / T)")
    parser.add_argument("--segment-tokens", type=positive_int, nargs="+", metavar="T",
                        help="with --lengths: Seq1F1B rows with these token budgets per segment")
    parser.add_argument("--png", type=output_file(make_folders=True), metavar="FILE",
                        help="draw the timeline(s) here, all on one time axis: with several, "
                             "one picture each (suffix _k<splits> with several --splits, "
                             "_<schedule> with several --schedules) and all of them "
                             "stacked in this file ('.png' added where FILE has no suffix; "
                             "default: none)")
    parser.add_argument("--trace", type=output_file(make_folders=True), metavar="FILE",
                        help="write a Chrome trace (Perfetto) here; with several timelines "
                             "one trace each, with --png's suffixes, and no combined one "
                             "(default: none)")
    return parser


def megatron_interleaving_problem(num_stages: int, num_microbatches: int) -> str:
    """Why Megatron-Core's own interleaved schedule would refuse ``num_microbatches`` on
    ``num_stages`` ("" where it runs them): its check in
    ``forward_backward_pipelining_with_interleaving`` with its default group size
    (``microbatch_group_size_per_vp_stage`` = the pipeline size)."""
    p, m = num_stages, num_microbatches
    if p > m:
        return (f"its groups of PP={p} contiguous micro-batches per virtual stage must range "
                f"in [PP={p}, M={m}]")
    if m % p:  # its "0 < M % N < PP" with N = PP
        return (f"the remainder of M={m} divided by its group size {p} is {m % p}, neither 0 "
                f"nor >= PP={p}")
    return ""


def _parse_args(argv=None):
    """Parsed and checked flags: a problem is one line on stderr and exit status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.chunks > 1 and args.pp < 2:
        parser.error(f"--chunks {args.chunks} needs --pp >= 2 (interleaving spreads model "
                     "chunks over pipeline stages), got --pp 1")
    if args.chunks > 1 and "zb-h2" in args.schedules:
        parser.error(f"--schedules zb-h2 with --chunks {args.chunks}: {ZB_H2_PROBLEM}")
    given = [f"--{name.replace('_', '-')}" for name in ATTENTION_DEFAULTS
             if getattr(args, name) is not None]
    if args.cost == "uniform" and given:
        parser.error(f"{', '.join(given)}: read only with --cost attention (uniform costs "
                     "have no tokens or model); add --cost attention or drop them")
    if args.segment_tokens and not args.lengths:
        parser.error("--segment-tokens cuts micro-batches of --lengths: give them")
    if args.lengths:
        if args.cost != "attention":
            parser.error("--lengths: micro-batches of different lengths cost by their tokens "
                         "and attention; add --cost attention (and the model's sizes)")
        if "--microbatches" in (argv if argv is not None else sys.argv):
            parser.error("--lengths gives one micro-batch per length: drop --microbatches")
        if args.seq_length is not None:
            parser.error("--lengths gives each micro-batch's tokens: drop --seq-length")
        if args.chunks > 1 or args.schedules != ["1f1b"]:
            parser.error("--lengths simulates Megatron's 1F1B and Seq1F1B without --chunks "
                         "and --schedules")
        if args.png or args.trace:
            parser.error("--lengths prints a table and draws no timeline: drop --png / --trace "
                         "(they draw micro-batches of one length)")
        args.microbatches = len(args.lengths)
    for name, value in ATTENTION_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.cost == "attention" and not args.lengths:
        for k in args.splits:
            if k > args.seq_length:
                parser.error(f"--splits {k}: {args.seq_length} tokens (--seq-length) make at "
                             f"most {args.seq_length} segments")
    return args


def _config_from_args(args):
    """A stand-in for TransformerConfig with the fields the cost model reads."""
    from types import SimpleNamespace

    return SimpleNamespace(
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        kv_channels=None, num_query_groups=None, ffn_hidden_size=4 * args.hidden_size,
        gated_linear_unit=False, num_layers=args.num_layers,
    )


def _output_path(path: str, splits: int, schedule: str, many_splits: bool,
                 many_schedules: bool) -> Path:
    out = Path(path)
    suffix = (f"_k{splits}" if many_splits else "") + (f"_{schedule}" if many_schedules else "")
    return out.with_name(f"{out.stem}{suffix}{out.suffix}")


def schedule_name(splits: int, schedule: str, chunks: int = 1) -> str:
    """'1F1B', 'Seq1F1B k=4', 'ZB-H1', 'Seq1F1B ZB-H1 k=4' (+ ' (v=2)')."""
    zero_bubble = schedule.upper() if schedule != "1f1b" else ""
    if splits == 1:
        name = zero_bubble or "1F1B"
    else:
        name = f"Seq1F1B {zero_bubble} k={splits}" if zero_bubble else f"Seq1F1B k={splits}"
    return name + (f" (v={chunks})" if chunks > 1 else "")


def lengths_table(args) -> str:
    """``--lengths``: Megatron's 1F1B and Seq1F1B on micro-batches of these lengths, each
    cut as the executor cuts them (:mod:`megatron_seq1f1b.schedules.variable`)."""
    from megatron_seq1f1b.schedules.variable import cut_microbatches

    config = _config_from_args(args)
    model = CostModel.from_config(config, args.vocab_size)
    rows = [(schedule_name(k, "1f1b"), k, None) for k in args.splits]
    rows += [(f"Seq1F1B {t} tokens/segment", 64, t) for t in args.segment_tokens or ()]
    if 1 not in args.splits:
        rows.insert(0, ("1F1B", 1, None))
    results = []
    for name, k, tokens in rows:
        cuts = cut_microbatches(args.lengths, k, args.partition, segment_tokens=tokens,
                                cost=model)
        schedule = build_schedule(args.pp, len(cuts), [len(c) for c in cuts])
        result = simulate(schedule, segment_cost(cuts, model), timing=args.timing)
        # segment_cost normalizes to the mean unit: back to one scale (FLOPs)
        units = [f for c in cuts for f in model.split_costs(list(c))]
        scale = sum(units) / len(units)
        results.append((name, result.makespan * scale, result.bubble_fraction,
                        peak_tokens(schedule, cuts)[0], sum(len(c) for c in cuts)))
    base = results[0]
    header = (f"{'schedule':<32}{'speed vs 1F1B':>14}{'bubble':>8}{'units':>7}"
              f"{'stage-0 peak tokens':>21}{'vs 1F1B':>9}")
    lines = [f"micro-batch lengths {args.lengths} (partition {args.partition}, FLOP costs of "
             f"{args.num_layers} layers, hidden {args.hidden_size}, no host time per unit; "
             "predictions)", header, "-" * len(header)]
    for name, time, bubble, peak, units in results:
        lines.append(f"{name:<32}{base[1] / time:>13.2f}x{bubble:>8.1%}{units:>7}{peak:>21.0f}"
                     f"{peak / base[3]:>8.2f}x")
    short = sorted({n for n in args.lengths for k in args.splits if n < k})
    if short:  # a segment has at least one token
        lines.append(f"note: micro-batches of {', '.join(map(str, short))} tokens get fewer "
                     "segments than k (a segment has at least one token)")
    lines.append("note: FLOPs only; on a GPU each unit also costs its host dispatch, which "
                 "makes many short segments slower than shown (the planner and "
                 "--seq1f1b-splits auto count it)")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron_seq1f1b.schedules import draw

    args = _parse_args(argv)
    if args.lengths:
        print(f"pipeline stages p={args.pp}, micro-batches m={args.microbatches}")
        print(lengths_table(args))
        return 0
    p, m, v = args.pp, args.microbatches, args.chunks
    many_splits, many_schedules = len(args.splits) > 1, len(args.schedules) > 1
    print(f"pipeline stages p={p}, micro-batches m={m}, model chunks v={v}, cost={args.cost}, "
          f"timing={args.timing}")
    problem = megatron_interleaving_problem(p, m) if v > 1 else ""
    if problem:
        print(f"note: Megatron-Core's own interleaved schedule refuses m={m} on p={p} "
              f"({problem}); Seq1F1B's interleaved schedule runs it, as simulated here")
    header = (f"{'schedule':<26}{'bubble':>8}{'formula':>9}{'peak units':>12}"
              f"{'peak (micro-batches)':>21}")
    print(header)
    print("-" * len(header))
    drawn = []  # (k, schedule, title, timeline in micro-batch forwards)
    for k in args.splits:
        for kind in args.schedules:
            split = kind != "1f1b"
            cost, costs, lengths = None, None, None
            if args.cost == "attention":
                config = _config_from_args(args)
                lengths = split_sequence(
                    args.seq_length, k, args.partition, config=config, vocab_size=args.vocab_size
                )
                model = CostModel.from_config(config, args.vocab_size)
                cost = segment_cost(lengths, model, num_model_chunks=v, split_backward=split)
                if split:  # W and the receives placed for these costs, as the executor does
                    costs = unit_costs(cost, k)
            schedule = build_schedule(p, m, k, v, schedule=kind, costs=costs)
            result = simulate(schedule, cost, costs=costs, timing=args.timing)
            name = schedule_name(k, kind, v)
            # a stage's micro-batch is seq_length tokens of every chunk; uneven segments
            # (balanced) weigh by their tokens
            peak_mb = (result.peak_inflight[0] / (k * v) if lengths is None else
                       peak_tokens(schedule, [lengths] * m, v)[0] / args.seq_length)
            formula = "-"
            if args.cost == "uniform":
                formula = f"{(zero_bubble_formula if split else bubble_formula)(p, m, k, v):.1%}"
            print(f"{name:<26}{result.bubble_fraction:>8.1%}{formula:>9}"
                  f"{result.peak_inflight[0]:>12}{peak_mb:>21.2f}")
            # Costs are per unit (a segment of a chunk); in one micro-batch's forward on one
            # stage they compare across k: uniform units are 1/(k*v) of it, segment_cost's
            # (mean forward of a segment over v chunks) 1/k.
            per_forward = k * v if args.cost == "uniform" else k
            drawn.append((k, kind, f"{name}: p={p}, m={m}, bubble {result.bubble_fraction:.1%}",
                          result.timeline.scaled(1.0 / per_forward)))
    time_label = "time (1 = one micro-batch's forward on one stage)"
    x_max = draw.shared_time_axis([timeline for *_, timeline in drawn])
    for k, kind, title, timeline in drawn:
        if args.png:
            out = _output_path(args.png, k, kind, many_splits, many_schedules)
            out = draw.draw_png(timeline, out, title=title, time_label=time_label, x_max=x_max)
            print(f"  timeline picture: {out}")
        if args.trace:
            out = _output_path(args.trace, k, kind, many_splits, many_schedules)
            out = draw.write_chrome_trace(timeline, out, time_unit_us=1000.0)
            print(f"  Chrome trace: {out}")
    if args.png and len(drawn) > 1:
        out = draw.draw_timelines([t for *_, t in drawn], args.png, [t for *_, t, _ in drawn],
                                  time_label=time_label, x_max=x_max)
        print(f"  all timelines on one time axis: {out}")
    print("peak (micro-batches): rank-0 in-flight activations in micro-batches of a stage "
          + ("(tokens held / sequence length, per chunk)" if args.cost == "attention"
             else "(units / (splits * chunks))"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
