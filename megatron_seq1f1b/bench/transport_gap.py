"""How far a plan's time under each transport lies above the bounds the planner can compute.

Why: the planner times a candidate only where its bound says it might win
(:mod:`megatron_seq1f1b.planner.order_bound`), so a bound that stays a few percent under a
schedule's time makes the search time every such candidate. This separates what the bound
misses into the ``W`` placement (the placed plan's pure dataflow) and the transport (the
executor's steps replayed under each of :data:`~megatron_seq1f1b.schedules.replay.TIMINGS`),
on the planner's own candidates (the FLOP costs of a Llama-3-8B-like model at 32k tokens, cut
as the search cuts)::

    python -m megatron_seq1f1b.bench.transport_gap --pp 16 --microbatches 32 --vpp 1 \\
        --splits 14 25 --schedules zb-h2 zb-h1 1f1b

Prints a markdown table, one row per (k, schedule): seconds of the cost model.
"""

from __future__ import annotations

import argparse

from megatron_seq1f1b.base.flags import positive_int

#: The columns after the plan's name, in order.
COLUMNS = ("orders' bound", "dataflow, W placed", "gloo", "slack", "nccl", "rendezvous")


def gap_row(pp: int, microbatches: int, vpp: int, splits: int, schedule: str) -> dict:
    """The bounds and every transport's time of one balanced candidate (module doc)."""
    from megatron_seq1f1b.bench.plan_cost import llama_costs
    from megatron_seq1f1b.base.checks import segment_multiple
    from megatron_seq1f1b.planner.candidates import full_steps, order_graph, table_cost
    from megatron_seq1f1b.planner.costs import action_cost_table, placement_costs
    from megatron_seq1f1b.schedules.partition import CostModel, split_sequence
    from megatron_seq1f1b.schedules.plan import Topology, dataflow_timing
    from megatron_seq1f1b.schedules.replay import TIMINGS, replay_times

    args, config, calibration = llama_costs(
        ["--pp", str(pp), "--microbatches", str(microbatches), "--vpp", str(vpp)], pp * vpp)
    flops = CostModel.from_config(config, args.vocab_size, False)
    lengths = tuple(split_sequence(args.seq_length, splits, "balanced",
                                   multiple_of=segment_multiple(config), cost=flops))
    zero_bubble = schedule != "1f1b"
    table = action_cost_table(calibration, lengths, pp, vpp, zero_bubble)
    costs = placement_costs(calibration, lengths, pp * vpp) if zero_bubble else None
    cost = table_cost(table, pp)
    steps, partners = full_steps(pp, microbatches, splits, vpp, schedule, costs)
    slots = [[step.actions for step in rank if step.actions] for rank in steps]
    starts, _ = dataflow_timing(slots, Topology(pp, vpp), lambda a: cost(a, 0))
    dataflow = max(rank_starts[-1] + sum(cost(a, r) for a in slots[r][-1])
                   for r, rank_starts in enumerate(starts))
    times = {timing: max(replay_times(steps, cost, timing=timing, partners=partners).end)
             for timing in TIMINGS}
    return {"pp": pp, "microbatches": microbatches, "vpp": vpp, "splits": splits,
            "schedule": schedule,
            "values": (order_graph(pp, microbatches, splits, vpp, schedule).bound(table),
                       dataflow, times["gloo"], times["slack"], times["nccl"],
                       times["rendezvous"])}


def row(result: dict) -> str:
    name = (f"{result['schedule']}, k {result['splits']} balanced"
            + (f", vpp {result['vpp']}" if result["vpp"] > 1 else ""))
    return f"| {name} | " + " | ".join(f"{x:.2f}" for x in result["values"]) + " |"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=positive_int, default=16, help="pipeline size (16)")
    parser.add_argument("--microbatches", type=positive_int, default=32,
                        help="micro-batches (32)")
    parser.add_argument("--vpp", type=positive_int, default=1, help="model chunks per rank (1)")
    parser.add_argument("--splits", type=positive_int, nargs="+", default=[14, 25],
                        help="segments per micro-batch (14 25)")
    parser.add_argument("--schedules", nargs="+", default=["zb-h2", "zb-h1", "1f1b"],
                        choices=["1f1b", "zb-h1", "zb-h2"], help="schedules (all three)")
    args = parser.parse_args(argv)
    print(f"pp {args.pp}, m {args.microbatches}, seconds of the FLOP model")
    print("| plan | " + " | ".join(COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS))
    results = []
    for schedule in args.schedules:
        if schedule == "zb-h2" and args.vpp > 1:
            continue  # not built interleaved (docs/design.md)
        for k in args.splits:
            result = gap_row(args.pp, args.microbatches, args.vpp, k, schedule)
            print(row(result), flush=True)
            results.append(result)
    return results


if __name__ == "__main__":
    main()
