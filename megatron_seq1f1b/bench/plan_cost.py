"""What planning and start-up cost: the planner and the executor's steps, per configuration.

Why: ``--seq1f1b-splits auto`` plans on every rank at start-up and the offline planner
answers before a big run, so neither may grow with the run (issue #55). Per pipeline size,
micro-batches, most segments, interleaving and zero bubble this times, in this process
(imports done, caches emptied before each configuration):

* ``choose_plan`` as the command line and ``auto`` call it (tie tolerance 2 %), on the FLOP
  costs of a Llama-3-8B-like model at 32k tokens (the planner's offline defaults);
* the command line itself (``python -m megatron_seq1f1b.planner ... --top 1``: parsing,
  the plan, Megatron-Core's schedules beside it, the report), its output discarded;
* the executor's steps of the chosen plan on one rank
  (``runtime.executor_setup.rank_steps``: what a rank builds at start-up).

Each configuration runs in a process of its own, as the command line and ``auto`` do (in
one process a row after a heavy one paid for the heap that one left: 0.3 s became 0.5 s).
Seconds are CPU seconds of that process (``time.process_time``: other load on the
machine does not count) and wall seconds::

    python -m megatron_seq1f1b.bench.plan_cost                 # the grid of docs/benchmarks.md
    python -m megatron_seq1f1b.bench.plan_cost --pp 16 --microbatches 512 --vpp 1 --zero-bubble on
    python -m megatron_seq1f1b.bench.plan_cost --pp 16 --microbatches 32 --timing gloo

``--timing`` plans for another transport's timing (the command line's flag; default NCCL's
links, as the planner's): ``gloo`` is also the model of an NCCL transport that would post
receives a step ahead.

Prints a markdown table, one row per configuration.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import multiprocessing
import time

from megatron_seq1f1b.base.flags import positive_int
from megatron_seq1f1b.schedules.replay import TIMINGS

#: A Llama-3-8B-like model at 32k tokens: the planner flags of issue #55's table.
LLAMA_8B = ("--seq-length 32768 --hidden-size 4096 --num-layers 32 --num-attention-heads 32 "
            "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --vocab-size 128256 --bf16 "
            "--normalization RMSNorm --disable-bias-linear "
            "--untie-embeddings-and-output-weights").split()


def _clear() -> None:
    """Forget every cached schedule, plan and step: each configuration pays in full."""
    from megatron_seq1f1b.planner.candidates import clear_caches
    from megatron_seq1f1b.runtime import executor_setup

    clear_caches()
    executor_setup.pipeline_steps.cache_clear()
    executor_setup.rank_steps.cache_clear()


def _timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    value = fn()
    return value, time.process_time() - cpu, time.perf_counter() - wall


def llama_costs(argv: list[str], stages: int):
    """(planner arguments, model config, FLOP calibration) of :data:`LLAMA_8B` with ``argv``
    added, for ``stages`` virtual stages: what the command line plans with."""
    from megatron_seq1f1b.planner import cli

    args = cli.build_parser().parse_args(LLAMA_8B + argv)
    config = cli._model_config(args)
    return args, config, cli._flop_calibration(args, config, stages)


def measure(pp: int, microbatches: int, max_splits: int, vpp: int, zero_bubble: bool,
            timing: str | None = None) -> dict:
    """One configuration: the seconds of choose_plan, the command line and rank_steps
    (``timing``: the replay timing planned for; None, the planner's default)."""
    from megatron_seq1f1b.planner import cli
    from megatron_seq1f1b.planner.choice import TIE_TOLERANCE
    from megatron_seq1f1b.planner.search import choose_plan
    from megatron_seq1f1b.runtime.executor_setup import rank_steps

    argv = ["--pp", str(pp), "--microbatches", str(microbatches), "--max-splits",
            str(max_splits), "--vpp", str(vpp), "--top", "1"]
    if not zero_bubble:
        argv += ["--schedules", "1f1b"]
    if timing is not None:
        argv += ["--timing", timing]
    args, config, calibration = llama_costs(argv, pp * vpp)
    timing = cli._timing(args)  # the command line's reading of its flags
    _clear()
    choice, cpu, wall = _timed(lambda: choose_plan(
        args.seq_length, pp, microbatches, num_model_chunks=vpp, calibration=calibration,
        config=config, vocab_size=args.vocab_size, max_splits=max_splits,
        schedules=args.schedules, tie_tolerance=TIE_TOLERANCE, timing=timing,
        memory_model=cli._memory_model(args, config)))
    _clear()
    with contextlib.redirect_stdout(io.StringIO()):
        _, cli_cpu, cli_wall = _timed(lambda: cli.main(LLAMA_8B + argv))
    _clear()
    plan = choice.plan
    steps, steps_cpu, steps_wall = _timed(lambda: rank_steps(
        pp, microbatches, plan.num_splits, vpp, False, 0, plan.schedule, plan.segment_costs))
    _clear()
    return {"pp": pp, "microbatches": microbatches, "max_splits": max_splits, "vpp": vpp,
            "zero_bubble": zero_bubble, "timing": timing,
            "candidates": len(choice.candidates) + choice.untimed,
            "timed": len(choice.candidates), "choose_plan": (cpu, wall),
            "command_line": (cli_cpu, cli_wall), "rank_steps": (steps_cpu, steps_wall),
            "steps": len(steps), "chosen": plan.describe(), "time": plan.time}


def row(result: dict) -> str:
    def seconds(pair):
        return f"{pair[0]:.2f} ({pair[1]:.2f})"
    return (f"| {result['pp']} | {result['microbatches']} | {result['max_splits']} | "
            f"{result['vpp']} | {'yes' if result['zero_bubble'] else 'no'} | "
            f"{result['timed']} of {result['candidates']} | {seconds(result['choose_plan'])} | "
            f"{seconds(result['command_line'])} | {seconds(result['rank_steps'])} | "
            f"{result['chosen']} |")


HEADER = ("| pp | m | max k | vpp | zero bubble | candidates timed | choose_plan s | "
          "command line s | rank_steps s | chosen |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=positive_int, nargs="+", default=[4, 8, 16, 32],
                        help="pipeline sizes (default 4 8 16 32)")
    parser.add_argument("--microbatches", type=positive_int, nargs="+",
                        default=[32, 256, 1024], help="micro-batches (default 32 256 1024)")
    parser.add_argument("--max-splits", type=positive_int, default=32,
                        help="most segments a plan tries (default 32)")
    parser.add_argument("--vpp", type=positive_int, nargs="+", default=[1, 2],
                        help="model chunks per rank (default 1 2; skipped where the 32 layers "
                             "do not divide by pp x vpp)")
    parser.add_argument("--zero-bubble", choices=["on", "off", "both"], default="both",
                        help="candidates with zero-bubble schedules too (on), 1F1B only (off) "
                             "or both rows (default)")
    parser.add_argument("--timing", choices=TIMINGS, default=None,
                        help="the transport timing planned for (default: the planner's, "
                             "NCCL's links); gloo also models NCCL receives posted ahead")
    args = parser.parse_args(argv)
    zero_bubble = {"on": [True], "off": [False], "both": [False, True]}[args.zero_bubble]
    print("CPU seconds (wall seconds in brackets), each configuration from empty caches; "
          f"timing: {args.timing or 'the planner default (nccl)'}")
    print(HEADER)
    results = []
    for pp in args.pp:
        for vpp in args.vpp:
            if 32 % (pp * vpp):
                continue
            for m in args.microbatches:
                for zb in zero_bubble:
                    result = measure_apart(pp, m, args.max_splits, vpp, zb, args.timing)
                    print(row(result), flush=True)
                    results.append(result)
    return results


def measure_apart(pp: int, microbatches: int, max_splits: int, vpp: int,
                  zero_bubble: bool, timing: str | None = None) -> dict:
    """:func:`measure` in a fresh process (spawned: nothing of this one's heap)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(measure, pp, microbatches, max_splits, vpp, zero_bubble,
                           timing).result()


if __name__ == "__main__":
    main()
