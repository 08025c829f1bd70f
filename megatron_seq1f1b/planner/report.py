"""What the planner's command line says beside its choice: the flags that run it, whether the
segment cap may have stopped it, Megatron-Core's own schedules on the same costs (speed and
memory ratios), and whether memory was checked against the GPU.

A plan is only worth its flags next to what it replaces: Megatron-Core 1F1B (``k = 1``
without interleaving) and, where interleaving is planned, its interleaved 1F1B (``k = 1``
over the chunks), predicted by the same replay, costs and memory model
(``planner/cli.py`` plans them). Without ``--gpu-memory-gib`` nothing was checked against
a GPU's memory: the report says so and sets the chosen plan's busiest stage against common
sizes.
"""

from __future__ import annotations

from megatron_seq1f1b.planner.choice import Plan, _q
from megatron_seq1f1b.planner.costs import Calibration
from megatron_seq1f1b.planner.memory_model import GIB, bytes_text
from megatron_seq1f1b.planner.search import choose_plan
from megatron_seq1f1b.schedules.partition import NAMED_PARTITIONS
from megatron_seq1f1b.schedules.simulate import megatron_interleaving_problem

__all__ = ["GPU_SIZES_GIB", "MEGATRON_1F1B", "MEGATRON_INTERLEAVED", "megatron_baselines",
           "baseline_lines", "memory_lines", "chosen_flags", "cap_note"]

#: GPU memory sizes (GiB) the chosen plan's busiest stage is set against when no
#: --gpu-memory-gib is given: A100 40 GB, A100/H100 80 GB, H200 141 GB.
GPU_SIZES_GIB = (40, 80, 141)
MEGATRON_1F1B = "Megatron-Core 1F1B"
MEGATRON_INTERLEAVED = "Megatron-Core interleaved 1F1B"


def megatron_baselines(seq_length: int, num_stages: int, num_microbatches: int,
                       num_model_chunks: int, calibration: Calibration,
                       plain: Calibration | None, **common) -> dict[str, Plan | str]:
    """Megatron-Core's own schedules on the same costs, as plans: 1F1B (``k = 1`` without
    interleaving; with ``num_model_chunks > 1`` from ``plain``, the costs of that layout's
    stages) and, with chunks, its interleaved 1F1B (``k = 1`` over them); where there is no
    plan, why (a calibration measured on the interleaved layout's virtual stages has no costs
    of the plain layout; Megatron-Core refuses interleaving for this many micro-batches).
    ``common``: :func:`~megatron_seq1f1b.planner.search.choose_plan`'s other arguments."""
    layouts = [(MEGATRON_1F1B, 1, calibration if num_model_chunks == 1 else plain)]
    if num_model_chunks > 1:
        layouts.append((MEGATRON_INTERLEAVED, num_model_chunks, calibration))
    found: dict[str, Plan | str] = {}
    for name, chunks, costs in layouts:
        if costs is None:
            found[name] = ("not predicted (the calibration's costs are those of the "
                           "interleaved layout's virtual stages)")
            continue
        refused = megatron_interleaving_problem(num_stages, num_microbatches) \
            if chunks > 1 else ""
        if refused:
            found[name] = (f"not predicted: Megatron-Core refuses interleaving with "
                           f"{num_microbatches} micro-batches on {num_stages} stages ({refused})")
            continue
        try:
            found[name] = choose_plan(
                seq_length, num_stages, num_microbatches, num_model_chunks=chunks,
                calibration=costs, splits=[1], schedules=["1f1b"], partitions=["uniform"],
                **common).plan
        except ValueError as exc:
            found[name] = f"not predicted ({exc})"
    return found


def baseline_lines(plan: Plan, baselines: dict, gpu_memory_gib: float | None = None
                   ) -> list[str]:
    """The chosen plan against Megatron-Core's own schedules: speed and memory ratios (and,
    with ``gpu_memory_gib``, whether the baseline's busiest stage fits the GPU)."""
    lines = ["against Megatron-Core's own schedules (same costs and model, predicted):"]
    for name, base in baselines.items():
        if isinstance(base, str):
            lines.append(f"  {name}: {base}")
            continue
        memory = f"activations {plan.memory / base.memory:.2f}x ({plan.memory:.2f} vs " \
                 f"{base.memory:.2f} micro-batches of a stage)"
        if plan.peak_stage_bytes and base.peak_stage_bytes:
            memory += (f", busiest stage {plan.peak_stage_bytes / base.peak_stage_bytes:.2f}x "
                       f"({bytes_text(plan.peak_stage_bytes)} vs "
                       f"{bytes_text(base.peak_stage_bytes)})")
            if gpu_memory_gib is not None and base.peak_stage_bytes > gpu_memory_gib * GIB:
                memory += (f"; it would not fit the {gpu_memory_gib:g} GiB per GPU "
                           "(--gpu-memory-gib)")
        same = (plan.num_splits, plan.schedule, plan.lengths) == \
            (base.num_splits, base.schedule, base.lengths) and _q(plan.time) == _q(base.time)
        lines.append(f"  vs {name}: {base.time / plan.time:.2f}x its speed "
                     f"({_seconds(plan)} vs {_seconds(base)} per iteration), {memory}"
                     + ("; the chosen plan is this schedule" if same else ""))
    return lines


def _seconds(plan: Plan) -> str:
    return f"{plan.time:.4g} s" if plan.unit == "s" else f"{plan.time:.4g} {plan.unit}"


def memory_lines(plan: Plan, gpu_memory_gib: float | None) -> list[str]:
    """Whether memory was checked; without --gpu-memory-gib, the chosen plan's busiest stage
    against common GPU sizes (or what the check needs)."""
    if gpu_memory_gib is not None:
        return [f"memory checked: the busiest stage needs {bytes_text(plan.peak_stage_bytes)} "
                f"of the {gpu_memory_gib:g} GiB per GPU (--gpu-memory-gib)"]
    if not plan.stages:
        return ["memory not checked (no --gpu-memory-gib): give the model's sizes with "
                "--vocab-size, and --gpu-memory-gib, to check the busiest stage's weights, "
                "gradients, optimizer states and activations against the GPU"]
    need = plan.peak_stage_bytes / GIB
    fits = [f"{size} GiB {'fits' if need <= size else 'too small'}" for size in GPU_SIZES_GIB]
    return [f"memory not checked (no --gpu-memory-gib): the chosen plan's busiest stage needs "
            f"{bytes_text(plan.peak_stage_bytes)} (predicted); against common GPUs: "
            f"{', '.join(fits)}"]


def chosen_flags(plan: Plan) -> str:
    """The plan as the ``--seq1f1b-*`` flags run it: a partition that only a calibration
    computes (``measured``) goes as its lengths; one segment needs no partition."""
    if plan.num_splits == 1:
        cut = ""
    elif plan.partition in NAMED_PARTITIONS:
        cut = f" --seq1f1b-partition {plan.partition}"
    else:
        cut = " --seq1f1b-split-lengths " + ",".join(map(str, plan.lengths))
    return f"--seq1f1b-splits {plan.num_splits}{cut} --seq1f1b-schedule {plan.schedule}"


def cap_note(timed: list[Plan], max_splits: int, splits, seq_length: int,
             min_segment_length: int, multiple: int) -> str:
    """Where the fastest plan timed within the budget has the most segments ``max_splits``
    allows and the shortest segment (``min_segment_length``, the layout's ``multiple``) would
    allow more, the cap may be what stopped it ("" otherwise, or where ``splits`` were
    given)."""
    allowed = [plan for plan in timed if plan.within_budget is not False]
    if splits or not allowed:
        return ""
    fastest = min(allowed, key=lambda plan: plan.time)
    room = min(seq_length // max(min_segment_length, 1), seq_length // multiple)
    if fastest.num_splits < max_splits or room <= max_splits:
        return ""
    return (f"the fastest plan timed, {fastest.describe()}, has the most segments --max-splits "
            f"{max_splits} allows, and --min-segment-length {min_segment_length} would allow "
            f"{room}: more may be faster; raise --max-splits to try them")
