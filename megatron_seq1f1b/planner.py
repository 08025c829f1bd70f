"""Automatic plan: the number of segments, the partition and the schedule, from costs.

Which ``k``, partition and schedule is fastest depends on the machine: a fixed
cost per segment (kernel launches, messages) favours few segments, attention
that dominates favours a balanced split, weight gradients that fill bubbles
favour a zero-bubble schedule; more segments also hold fewer activations. So
every combination is simulated with per-segment costs, and the fastest one
that fits the activation-memory budget wins.

Costs come from a :class:`Calibration`: per virtual stage (pipeline order,
``chunk * pp + rank``) and direction a fit ``time = a*len + c*quad(len, end)
+ d``, as :mod:`megatron_seq1f1b.fit` produces; or from the FLOP
:class:`~megatron_seq1f1b.partition.CostModel` when nothing is measured. A
start-up measurement only has to return a :class:`Calibration`
(:meth:`Calibration.from_samples` fits the samples
:mod:`megatron_seq1f1b.bench.calibration` takes).

Time is what the executor would do: the zero-bubble schedules are built and
their receives placed from the plan's per-segment costs
(:attr:`Plan.segment_costs`, as the executor's ``pipeline_steps`` does with
its costs), and every rank's steps are replayed with rendezvous messages
whose sends finish a step later (``send_slack=1``, what the executor's
transports do on gloo and NCCL, see :mod:`megatron_seq1f1b.p2p`; 0 models a
step that waits for all its transfers, as ``SEQ1F1B_P2P=batch`` on NCCL and
Megatron's own schedules do), a step that exchanges tensors paying the
calibration's message time. Plans the executor would refuse (deadlock, link
order) are left out.

Without a calibration the offline command line turns FLOPs into seconds at
:data:`OFFLINE_FLOP_RATE` and charges every unit (one segment through one
stage) :data:`OFFLINE_HOST_SECONDS_PER_LAYER` of host time per layer of the
stage: the fixed cost that makes many short segments slower than few (FLOPs
alone chose k=16 for a 7B model at 32k tokens; see docs/design.md).

Memory is the peak of activations held on a stage, in micro-batches of that
stage (a unit of segment ``j`` on one of ``v`` chunks holds
``len_j / (seq_length * v)``; from its forward until its backward, or until
its ``W`` in zero-bubble schedules), and in bytes with ``bytes_per_token``.
With a :class:`MemoryModel` (the model's shape and how it is trained) every
candidate also gets each stage's total: weights, main gradients, optimizer
states (:mod:`megatron_seq1f1b.footprint`) and its activations replayed unit
by unit with that stage's own bytes per token (:func:`stage_memory`), which
``memory_budget_total_bytes`` (a GPU's memory) can bound.

Calibration file (JSON, :func:`save_calibration` / :func:`load_calibration`)::

    {"format": "megatron_seq1f1b.calibration", "version": 1,
     "unit": "s",                      # of every coefficient's result
     "quadratic": "causal_pairs",      # or "rectangle" (len * end: non-flash attention)
     "weight_fraction": 0.5,           # W's share of B where a stage has no "W" fit
     "source": "free text",
     "bytes_per_token": 65536,         # optional: activation bytes per token of a stage
     "message": {"a": 2e-9, "d": 5e-5},  # optional: one-way message time of a segment
     "stages": [                       # pipeline order; 1 entry = the same on every stage
        {"F": {"a": 1e-6, "c": 2e-11, "d": 3e-4,    # forward of one segment
               "floor": 5e-3},                      # optional: its host dispatch time
         "B": {"a": 2e-6, "c": 4e-11, "d": 5e-4},   # whole backward (input + weight grads)
         "W": {"a": 1e-6, "c": 0.0, "d": 1e-4},     # optional: the weight-gradient part
         "Bi": {"a": 1.1e-6, ...}},                 # optional: B with W deferred (zero bubble)
        ...]}

:func:`load_calibration` also reads a benchmark's ``results.json`` (its
``calibration.fits``).

Command line::

    python -m megatron_seq1f1b.planner --seq-length 32768 --pp 4 --microbatches 8 \\
        (--calibration calib.json | --hidden-size 4096 --num-layers 32 ...) \\
        [--memory-budget 2.0 | --memory-budget-gib 40 --bytes-per-token 65536] \
        [--vocab-size 50257 --bf16 --data-parallel-size 2 --use-distributed-optimizer \
         --gpu-memory-gib 80]     # GB per stage: weights, gradients, optimizer, activations
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

from megatron_seq1f1b.checks import segment_multiple
from megatron_seq1f1b.fit import QUADRATIC, extrapolated_fits, fit_costs, quadratic_for
from megatron_seq1f1b.footprint import (
    ModelShape, Training, activation_bytes_per_token, layers_per_virtual_stage,
    stage_activation_bytes, stage_parameters,
)
from megatron_seq1f1b.partition import METHODS, CostModel, split_sequence
from megatron_seq1f1b.plan import plan_steps
from megatron_seq1f1b.replay import replay
from megatron_seq1f1b.schedule import SCHEDULES, Schedule, ScheduleError, build_schedule
from megatron_seq1f1b.simulate import CostFn
from megatron_seq1f1b.validate import check_link_order
from megatron_seq1f1b.zero_bubble import segment_cost_fn

FORMAT = "megatron_seq1f1b.calibration"
GIB = 2.0 ** 30
#: The replay's ``send_slack`` of the executor's transports (gloo; NCCL's links transport).
RUNTIME_SEND_SLACK = 1
#: Offline plans without a calibration: sustained FLOP/s of a large GPU in bf16 (about 40 %
#: of an H100/H200's dense peak; only ratios between plans matter, not the absolute time).
OFFLINE_FLOP_RATE = 400e12
#: ... and the host time one unit pays per transformer layer of its stage, forward and
#: backward together (half each): Megatron-Core's Python dispatch of the local layer spec, the
#: GPU idle meanwhile, measured on an H200 with torch 2.11 (17-23 ms for a 4-layer chunk
#: whatever the segment length up to ~2k tokens; ../shared/notes/gpu-device.md).
OFFLINE_HOST_SECONDS_PER_LAYER = 4.75e-3

__all__ = [
    "Fit", "StageCosts", "Calibration", "Plan", "PlanChoice", "BudgetError", "choose_plan",
    "format_table", "explain", "MEASURED_TIE_TOLERANCE", "save_calibration",
    "load_calibration", "activation_peak", "action_cost", "placement_costs", "predict", "main",
    "MemoryModel", "stage_memory",
]


# ------------------------------------------------------------------ costs


@dataclass(frozen=True)
class Fit:
    """``max(a*length + c*quad(length, end) + d, floor)``: one direction of a segment on one
    stage.

    ``floor``: the host time the unit's dispatch takes (a GPU runs the kernels
    asynchronously, so a unit lasts at least as long as the host needs to launch
    them, however little work they carry; 0 where host and device are one, CPU).
    """

    a: float
    c: float = 0.0
    d: float = 0.0
    floor: float = 0.0

    def time(self, length: float, end: float, quadratic: str) -> float:
        return max(self.a * length + self.c * QUADRATIC[quadratic](length, end) + self.d,
                   self.floor)


@dataclass(frozen=True)
class StageCosts:
    """A virtual stage's forward and whole backward; optionally its weight-gradient part W
    and the input-gradient part B as a zero-bubble schedule runs it (W deferred costs a
    little more than the whole backward: two passes over the saved tensors)."""

    forward: Fit
    backward: Fit
    weight: Fit | None = None
    input: Fit | None = None


@dataclass(frozen=True)
class Calibration:
    """Per-segment costs of every virtual stage: what the planner simulates with.

    ``stages`` in pipeline order (virtual stage ``chunk * pp + rank``); other
    stage counts are extrapolated like :func:`~megatron_seq1f1b.fit.extrapolated_fits`
    (first and last kept, the rest a middle one); a stage's fit holds for its
    layers, so plan the virtual pipeline size it was measured with.
    Zero-bubble schedules give ``W`` the ``weight`` fit, else
    ``weight_fraction`` of the backward. ``bytes_per_token``: activation bytes
    one token of one sample leaves on the most loaded stage (measured at
    start-up), which turns the plans' memory into bytes. ``message``: one-way
    time of a pipeline message of a segment (``a`` per token, ``d`` fixed);
    each candidate is replayed with its segments' mean as the latency of every
    step that exchanges tensors.
    """

    stages: tuple[StageCosts, ...]
    quadratic: str = "causal_pairs"
    weight_fraction: float = 0.5
    unit: str = "s"
    source: str = ""
    bytes_per_token: float | None = None
    message: Fit | None = None

    def __post_init__(self):
        if not self.stages:
            raise ValueError("a calibration needs at least one stage")
        if self.quadratic not in QUADRATIC:
            raise ValueError(f"unknown quadratic {self.quadratic!r}; choose one of "
                             f"{tuple(QUADRATIC)}")
        if not 0.0 <= self.weight_fraction <= 1.0:
            raise ValueError(f"weight_fraction must be in [0, 1], got {self.weight_fraction}")
        if self.bytes_per_token is not None and not self.bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be > 0, got {self.bytes_per_token}")

    def stage_costs(self, num_stages: int) -> list[StageCosts]:
        """One entry per virtual stage of a pipeline with ``num_stages`` of them."""
        if len(self.stages) == 1:
            return list(self.stages) * num_stages
        return extrapolated_fits(list(self.stages), num_stages)

    def times(self, stage: StageCosts, length: float, end: float) -> tuple[float, float, float]:
        """(forward, whole backward, its weight-gradient part) of a segment on `stage`."""
        forward = stage.forward.time(length, end, self.quadratic)
        backward = stage.backward.time(length, end, self.quadratic)
        weight = (stage.weight.time(length, end, self.quadratic) if stage.weight
                  else self.weight_fraction * backward)
        return forward, backward, min(weight, backward)

    def message_latency(self, lengths: Sequence[int]) -> float:
        """Mean one-way message time of these segments (0 without a ``message`` fit)."""
        if self.message is None:
            return 0.0
        return sum(self.message.a * n + self.message.d for n in lengths) / len(lengths)

    def zero_bubble_times(self, stage: StageCosts, length: float, end: float
                          ) -> tuple[float, float, float]:
        """(F, B, W) of a segment on `stage` in a zero-bubble schedule: B measured with W
        deferred where the calibration has it, else the whole backward less W."""
        forward, backward, weight = self.times(stage, length, end)
        split = stage.input.time(length, end, self.quadratic) if stage.input else None
        return forward, (split if split is not None else backward - weight), weight

    def __call__(self, length: float, end: float) -> float:
        """Forward + backward of a segment summed over the calibrated stages."""
        return sum(sum(self.times(s, length, end)[:2]) for s in self.stages)

    def cost_model(self) -> CostModel:
        """Forward + backward summed over stages as a :class:`CostModel`: what the
        ``"measured"`` partition balances (a per-segment constant moves every
        segment's cost alike, so it does not change the split)."""
        per_token = sum(s.forward.a + s.backward.a for s in self.stages)
        per_pair = sum(s.forward.c + s.backward.c for s in self.stages)
        return CostModel(per_token, per_pair, dense_attention=self.quadratic == "rectangle")

    @classmethod
    def from_cost_model(cls, model: CostModel, num_stages: int = 1, *,
                        flop_rate: float | None = None, host_seconds: float = 0.0
                        ) -> "Calibration":
        """FLOPs when nothing is measured: the model split evenly over ``num_stages``;
        backward = input gradients + weight gradients (:meth:`CostModel.backward_parts`).

        With ``flop_rate`` (FLOP/s) the costs are seconds, and every unit pays
        ``host_seconds`` of fixed time on top (forward and backward half each): the
        host's dispatch, which FLOPs do not see, as a floor (:class:`Fit`): a unit whose
        kernels take less than that waits for the host.
        """
        n = float(num_stages)
        a, c = model.per_token / n, model.per_pair / n
        quadratic = "rectangle" if model.dense_attention else "causal_pairs"
        if flop_rate is None:
            stage = StageCosts(Fit(a, c), Fit(2 * a, 2 * c), Fit(a, 0.0))
            return cls((stage,) * num_stages, quadratic, unit="FLOP", source="FLOP cost model")
        a, c, host = a / flop_rate, c / flop_rate, host_seconds / 2
        stage = StageCosts(Fit(a, c, floor=host), Fit(2 * a, 2 * c, floor=host), Fit(a, 0.0))
        return cls((stage,) * num_stages, quadratic, unit="s",
                   source=f"FLOP cost model at {flop_rate / 1e12:g} TFLOP/s, "
                          f"{host_seconds * 1e3:.3g} ms host time per unit")

    @classmethod
    def from_fits(cls, ordered_fits: Sequence[dict], quadratic: str, source: str = "fits",
                  weight_fraction: float = 0.5, unit: str = "s",
                  bytes_per_token: float | None = None) -> "Calibration":
        """From :mod:`~megatron_seq1f1b.fit` entries in pipeline order: ``{"F": {a, c, d}, "B": ...}``."""
        def fit(entry):
            return Fit(float(entry["a"]), float(entry.get("c", 0.0)), float(entry.get("d", 0.0)),
                       float(entry.get("floor", 0.0)))

        stages = tuple(StageCosts(fit(e["F"]), fit(e["B"]), fit(e["W"]) if e.get("W") else None,
                                  fit(e["Bi"]) if e.get("Bi") else None)
                       for e in ordered_fits)
        return cls(stages, quadratic, weight_fraction, unit, source, bytes_per_token)

    @classmethod
    def from_samples(cls, samples: dict, quadratic: str | None = None,
                     source: str = "measured", bytes_per_token: float | None = None,
                     dense_attention: bool = False, floors: dict | None = None
                     ) -> "Calibration":
        """Fit timed segments ``{(stage, chunk): [[length, end, forward_s, backward_s(,
        weight_s)], ...]}`` (:mod:`megatron_seq1f1b.measure`'s format); unless given, the
        quadratic of :func:`~megatron_seq1f1b.fit.quadratic_for` (``dense_attention``:
        the model runs Megatron's local attention, which computes the score rectangle).
        ``floors``: per ``(stage, chunk)`` the (forward, backward) host dispatch seconds,
        the fits' :attr:`Fit.floor` (a GPU's host; none on a CPU)."""
        if quadratic is None:
            quadratic, _ = quadratic_for({"samples": samples}, dense_attention)
        fits = fit_costs(samples, quadratic)
        for key, (forward, backward) in (floors or {}).items():
            if key in fits:
                fits[key] = dict(fits[key], F=dict(fits[key]["F"], floor=forward),
                                 B=dict(fits[key]["B"], floor=backward))
                if fits[key].get("Bi"):  # a zero-bubble B dispatches about as much
                    fits[key]["Bi"] = dict(fits[key]["Bi"], floor=backward)
        order = sorted(fits, key=lambda key: (key[1], key[0]))  # chunk-major: pipeline order
        return cls.from_fits([fits[key] for key in order], quadratic, source,
                             bytes_per_token=bytes_per_token)

    def to_dict(self) -> dict:
        def fit(f: Fit) -> dict:
            return {"a": f.a, "c": f.c, "d": f.d} | ({"floor": f.floor} if f.floor else {})

        stages = []
        for s in self.stages:
            entry = {"F": fit(s.forward), "B": fit(s.backward)}
            if s.weight is not None:
                entry["W"] = fit(s.weight)
            if s.input is not None:
                entry["Bi"] = fit(s.input)
            stages.append(entry)
        return {"format": FORMAT, "version": 1, "unit": self.unit, "quadratic": self.quadratic,
                "weight_fraction": self.weight_fraction, "source": self.source,
                "bytes_per_token": self.bytes_per_token,
                "message": fit(self.message) if self.message else None, "stages": stages}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        if data.get("format") != FORMAT or data.get("version") != 1:
            raise ValueError(f"not a calibration (format {FORMAT!r}, version 1): "
                             f"format={data.get('format')!r}, version={data.get('version')!r}")
        calibration = cls.from_fits(
            data["stages"], data.get("quadratic", "causal_pairs"), data.get("source", ""),
            float(data.get("weight_fraction", 0.5)), data.get("unit", "s"),
            data.get("bytes_per_token"))
        message = data.get("message")
        return replace(calibration, message=Fit(float(message["a"]), 0.0, float(message["d"]))
                       ) if message else calibration


def save_calibration(calibration: Calibration, path: str | Path) -> None:
    """Write the calibration file (format in the module docstring)."""
    Path(path).write_text(json.dumps(calibration.to_dict(), indent=1) + "\n")


def load_calibration(path: str | Path, layout: str = "plain") -> Calibration:
    """Read a calibration file, or a benchmark's results.json (its ``layout`` fits)."""
    data = json.loads(Path(path).read_text())
    if "calibration" in data and isinstance(data["calibration"], dict):
        bench = data["calibration"]
        fits = bench["fits"][layout]  # {"stage.chunk": {"F": ..., "B": ...}}
        order = sorted(fits, key=lambda key: tuple(reversed([int(x) for x in key.split(".")])))
        return Calibration.from_fits([fits[key] for key in order], bench["quadratic"],
                                     f"{path} ({layout} fits)")
    return Calibration.from_dict(data)


def action_cost(calibration: Calibration, lengths: Sequence[int], num_stages: int,
                num_model_chunks: int = 1, split_backward: bool = False) -> CostFn:
    """cost(action, rank) for :func:`predict`: B is the whole backward unless W is split off."""
    stages = calibration.stage_costs(num_stages * num_model_chunks)
    ends = list(itertools.accumulate(lengths))
    table = {}
    for vs, stage in enumerate(stages):
        for j, (length, end) in enumerate(zip(lengths, ends)):
            if split_backward:
                forward, backward, weight = calibration.zero_bubble_times(stage, length, end)
                table[vs, j] = {"F": forward, "B": backward, "W": weight}
            else:
                forward, backward, _ = calibration.times(stage, length, end)
                table[vs, j] = {"F": forward, "B": backward, "W": 0.0}
    return lambda action, rank: table[action.chunk * num_stages + rank, action.segment][action.kind]


def placement_costs(calibration: Calibration, lengths: Sequence[int], num_stages: int
                    ) -> tuple[tuple[float, float, float], ...]:
    """Per segment (F, B, W) averaged over stages, mean F = 1, rounded like the executor's
    ``zero_bubble_costs``: where a zero-bubble schedule puts W and places its receives
    (the same on every rank, so part of the ranks' agreement)."""
    per = calibration.stage_costs(num_stages)
    rows = []
    for length, end in zip(lengths, itertools.accumulate(lengths)):
        times = [calibration.zero_bubble_times(s, length, end) for s in per]
        rows.append(tuple(sum(t[i] for t in times) / len(times) for i in range(3)))
    mean = sum(r[0] for r in rows) / len(rows)
    return tuple(tuple(round(x / mean, 4) for x in r) for r in rows)


def predict(schedule: Schedule, num_model_chunks: int, cost: CostFn,
            costs: Sequence[tuple[float, float, float]] | None = None,
            send_slack: int = 0, comm_latency: float = 0.0) -> tuple[float, float]:
    """(makespan, bubble) of the executor's steps: receives placed with ``costs`` (zero
    bubble) or unit costs, replayed with ``cost`` and ``comm_latency`` per exchanging
    step; ScheduleError where it would refuse."""
    steps = plan_steps(schedule, num_model_chunks,
                       cost=segment_cost_fn(costs) if costs is not None else None)
    if costs is not None:
        check_link_order(steps)
    timeline = replay(steps, cost, comm_latency=comm_latency, send_slack=send_slack)
    busy = sum(iv.end - iv.start for rank in timeline.compute for iv in rank)
    total = timeline.makespan * len(schedule)
    return timeline.makespan, (1.0 - busy / total if total else 0.0)


def activation_peak(schedule: Schedule, lengths: Sequence[int], num_model_chunks: int = 1
                    ) -> float:
    """Most activations any rank holds, in micro-batches of a stage.

    A unit holds ``len / (seq_length * v)`` from its forward until its
    backward, or until its W where W is split off (as
    :func:`simulate.peak_inflight` counts units).
    """
    total = float(sum(lengths)) * num_model_chunks
    peak = 0.0
    for actions in schedule:
        release = "W" if any(a.is_weight for a in actions) else "B"
        live = 0.0
        for action in actions:
            if action.is_forward:
                live += lengths[action.segment] / total
                peak = max(peak, live)
            elif action.kind == release:
                live -= lengths[action.segment] / total
    return peak


@dataclass(frozen=True)
class MemoryModel:
    """What the planner needs to predict a stage's total memory: the model's shape, how it
    is trained (:class:`~megatron_seq1f1b.footprint.Training`) and its attention kernel.

    Activation bytes per token come from
    :func:`~megatron_seq1f1b.footprint.activation_bytes_per_token` for every chunk; with
    ``bytes_per_token`` (measured: what one token of one sample leaves on the most loaded
    stage, all its chunks) every chunk's estimate is scaled so that stage matches it.
    """

    shape: ModelShape
    training: Training = Training()
    flash: bool = True
    bytes_per_token: float | None = None
    activation_scale: float = 1.0  # e.g. measured / estimated activations of a rehearsal

    def chunk_bytes_per_token(self, num_stages: int, num_model_chunks: int = 1,
                              whole_qkv: bool = False) -> list[list[tuple[float, float]]]:
        """[rank][chunk] -> (bytes per token, of which keys and values); ``whole_qkv`` for
        unsegmented micro-batches (see :func:`activation_bytes_per_token`)."""
        p, v = num_stages, num_model_chunks
        layers = layers_per_virtual_stage(self.shape.num_layers, p * v)

        def estimate(whole: bool) -> list[list[tuple[float, float]]]:
            return [[activation_bytes_per_token(
                self.shape, layers, first=c * p + r == 0, last=c * p + r == p * v - 1,
                dtype=self.training.dtype, flash=self.flash, whole_qkv=whole)
                for c in range(v)] for r in range(p)]

        table = estimate(whole_qkv)
        scale = self.activation_scale
        if self.bytes_per_token:  # measured on a whole micro-batch (the calibration's k=1)
            measured_kind = table if whole_qkv else estimate(True)
            scale = self.bytes_per_token / max(sum(b for b, _ in rank) for rank in measured_kind)
        if scale != 1.0:
            table = [[(b * scale, kv * scale) for b, kv in rank] for rank in table]
        return table

    def static_bytes(self, num_stages: int, num_model_chunks: int = 1) -> list[dict]:
        """Per rank: weights, main gradients and optimizer states, in bytes."""
        return [self.training.state_bytes(n)
                for n in stage_parameters(self.shape, num_stages, num_model_chunks)]

    def stage_bytes(self, schedule: Schedule, lengths: Sequence[int], num_model_chunks: int = 1,
                    micro_batch_size: int = 1) -> list[dict]:
        """Per rank: ``weights``, ``gradients``, ``optimizer``, ``activations`` and ``total``
        bytes, activations replayed over the rank's actions."""
        p = len(schedule)
        activations = stage_activation_bytes(
            schedule, lengths, self.chunk_bytes_per_token(p, num_model_chunks, len(lengths) == 1),
            micro_batch_size)
        stages = []
        for static, act in zip(self.static_bytes(p, num_model_chunks), activations):
            entry = dict(static, activations=act)
            entry["total"] = sum(entry.values())
            stages.append(entry)
        return stages


def stage_memory(shape: ModelShape, training: Training, num_stages: int,
                 num_microbatches: int, lengths: Sequence[int], *, num_model_chunks: int = 1,
                 schedule: str | Schedule = "1f1b", micro_batch_size: int = 1,
                 flash: bool = True, bytes_per_token: float | None = None,
                 costs: Sequence[tuple[float, float, float]] | None = None) -> list[dict]:
    """Each pipeline rank's predicted bytes (weights, gradients, optimizer, activations,
    total) for one plan: ``schedule`` a name (built here; zero bubble placed with
    ``costs``, else unit costs) or every rank's action lists."""
    if isinstance(schedule, str):
        schedule = build_schedule(num_stages, num_microbatches, len(lengths), num_model_chunks,
                                  schedule=schedule, costs=costs)
    model = MemoryModel(shape, training, flash, bytes_per_token)
    return model.stage_bytes(schedule, lengths, num_model_chunks, micro_batch_size)


# ------------------------------------------------------------------ plans


@dataclass(frozen=True)
class Plan:
    """One candidate: how to cut and schedule, and what the simulation predicts."""

    num_splits: int
    partition: str
    lengths: tuple[int, ...]
    schedule: str
    time: float  # predicted iteration (calibration unit)
    bubble: float  # idle share of all ranks' time
    memory: float  # peak activations of a stage, in micro-batches of that stage
    memory_bytes: float | None = None  # with bytes_per_token
    within_budget: bool | None = None  # None: no budget given
    unit: str = "s"
    segment_costs: tuple[tuple[float, float, float], ...] | None = None  # zero bubble: (F, B, W)
    # with a MemoryModel: bytes per rank (stage_memory); derived, so not part of equality
    stages: tuple[dict, ...] | None = field(default=None, compare=False)

    @property
    def peak_stage_bytes(self) -> float | None:
        """The busiest stage's predicted total bytes (with a memory model)."""
        return max(s["total"] for s in self.stages) if self.stages else None

    def stages_text(self) -> str:
        """One line per stage: its predicted GB and what they are."""
        if not self.stages:
            return ""
        parts = ["predicted memory per stage (weights + gradients + optimizer + activations "
                 "= total):"]
        for rank, s in enumerate(self.stages):
            parts.append(f"  stage {rank}: {s['weights'] / GIB:.2f} + {s['gradients'] / GIB:.2f}"
                         f" + {s['optimizer'] / GIB:.2f} + {s['activations'] / GIB:.2f} = "
                         f"{s['total'] / GIB:.2f} GiB ({s['total'] / 1e9:.2f} GB)")
        return "\n".join(parts)

    def describe(self) -> str:
        part = f" {self.partition}" if self.num_splits > 1 else ""
        return f"k={self.num_splits}{part} {self.schedule}"

    def memory_text(self) -> str:
        text = f"{self.memory:.2f} mb"
        return text + (f" ({bytes_text(self.memory_bytes)})" if self.memory_bytes else "")


@dataclass(frozen=True)
class PlanChoice:
    """The winner, every candidate (ranked: fastest first) and why the winner won."""

    plan: Plan
    candidates: tuple[Plan, ...]
    reason: str
    source: str = ""  # where the costs came from (the calibration's source)

    def table(self) -> str:
        text = format_table(self.candidates, self.plan, self.reason)
        return text + ("\n" + self.plan.stages_text() if self.plan.stages else "")


class BudgetError(ValueError):
    """No candidate plan fits the activation-memory budget."""

    def __init__(self, message: str, smallest: Plan):
        super().__init__(message)
        self.smallest = smallest


def bytes_text(count: float) -> str:
    """GiB, or MiB below a tenth of one (small models, tests)."""
    return f"{count / GIB:.2f} GiB" if count >= 0.1 * GIB else f"{count / 2**20:.2f} MiB"


def _q(x: float) -> float:
    """Ten significant digits: equal predictions tie whatever the summation order."""
    return float(f"{x:.10g}")


def _rank_key(plan: Plan) -> tuple:
    """Fastest; then less memory, fewer splits, partition order, schedule order."""
    return (_q(plan.time), _q(plan.memory), plan.num_splits, METHODS.index(plan.partition),
            SCHEDULES.index(plan.schedule))


def _memory_key(plan: Plan) -> tuple:
    return (_q(plan.memory),) + _rank_key(plan)


# Within the tie tolerance, the plan that leans least on the cost model: the 1F1B schedule
# (zero bubble's win rests on the B/W split and W placement), then the FLOP-balanced
# partition (machine-independent), then the fitted one; then the fewest segments (fewer
# steps, messages and small kernels: what per-segment fits capture worst).
PREFERRED_PARTITIONS = ("balanced", "measured", "uniform")
MEASURED_TIE_TOLERANCE = 0.02  # measured costs: predictions this close are a tie


def _robust_key(plan: Plan) -> tuple:
    return (SCHEDULES.index(plan.schedule), PREFERRED_PARTITIONS.index(plan.partition)
            if plan.num_splits > 1 else 0, plan.num_splits) + _rank_key(plan)


def _pick(feasible: Sequence[Plan], tie_tolerance: float) -> Plan:
    """The fastest plan, or with a tolerance, the most robust one predicted that close to it."""
    limit = feasible[0].time * (1 + tie_tolerance)
    return min((c for c in feasible if _q(c.time) <= _q(limit)), key=_robust_key)


MAX_SPLITS = 16  # the most segments a plan tries (and the start-up measurement times)


def split_counts(seq_length: int, multiple_of: int, min_segment_length: int,
                 max_splits: int = MAX_SPLITS) -> list[int]:
    """The k a plan may use: 1 up to the most whose segments keep min_segment_length."""
    limit = min(max_splits, seq_length // max(min_segment_length, 1), seq_length // multiple_of)
    return list(range(1, max(limit, 1) + 1))


def choose_plan(
    seq_length: int,
    num_stages: int,
    num_microbatches: int,
    *,
    num_model_chunks: int = 1,
    micro_batch_size: int = 1,
    calibration: Calibration | None = None,
    config=None,
    vocab_size: int | None = None,
    dense_attention: bool = False,
    cost_model: CostModel | None = None,
    memory_budget: float | None = None,
    memory_budget_bytes: float | None = None,
    bytes_per_token: float | None = None,
    min_segment_length: int = 128,
    max_splits: int = MAX_SPLITS,
    multiple_of: int | None = None,
    splits: Sequence[int] | None = None,
    partitions: Sequence[str] | None = None,
    schedules: Sequence[str] | None = None,
    send_slack: int = RUNTIME_SEND_SLACK,
    tie_tolerance: float = 0.0,
    memory_model: MemoryModel | None = None,
    memory_budget_total_bytes: float | None = None,
) -> PlanChoice:
    """The fastest (k, partition, schedule) within the memory budget, and all candidates.

    Costs from ``calibration``, else the FLOP model (``cost_model``, or from
    ``config`` + ``vocab_size``), which the ``"balanced"`` partition needs
    too. ``memory_budget``: peak activations per stage in micro-batches of a
    stage; ``memory_budget_bytes`` needs ``bytes_per_token`` (activation bytes
    one token of one sample leaves on a stage; default: the calibration's). ``k`` runs from 1 to the
    largest with segments of at least ``min_segment_length`` tokens (at most
    ``max_splits``), or over ``splits``. ``send_slack``: 1, the executor's
    transports (0: steps that wait for their sends; see the module docstring). Deterministic: ties go to less
    memory, fewer splits, then METHODS and SCHEDULES order. ``tie_tolerance``
    (relative; :data:`MEASURED_TIE_TOLERANCE` for measured costs): plans
    predicted within it of the fastest count as equally fast, and the one
    that leans least on the cost model wins (1F1B over zero bubble, then the
    balanced, measured, uniform partition, then the fewest splits). Raises
    :class:`BudgetError` if nothing fits. ``memory_model``: every candidate also gets
    each stage's total bytes (:attr:`Plan.stages`); ``memory_budget_total_bytes`` (needs
    it) bounds the busiest stage's total.
    """
    if memory_budget_total_bytes is not None and memory_model is None:
        raise ValueError("memory_budget_total_bytes needs memory_model (weights, gradients, "
                         "optimizer states and activations per stage)")
    if not 0 <= tie_tolerance < 1:
        raise ValueError(f"tie_tolerance must be in [0, 1), got {tie_tolerance}")
    p, m, v = num_stages, num_microbatches, num_model_chunks
    if bytes_per_token is None and calibration is not None:
        bytes_per_token = calibration.bytes_per_token
    if v > 1 and p < 2:
        raise ValueError("interleaving (several model chunks) needs num_stages >= 2")
    if memory_budget_bytes is not None and not bytes_per_token:
        raise ValueError("memory_budget_bytes needs bytes_per_token (activation bytes of one "
                         "token of one sample on a stage)")
    flops = cost_model or (CostModel.from_config(config, vocab_size, dense_attention)
                           if config is not None else None)
    if calibration is None:
        if flops is None:
            raise ValueError("choose_plan needs costs: calibration=..., or config=... / "
                             "cost_model=... for FLOPs")
        calibration = Calibration.from_cost_model(flops, p * v)
    partitions, schedules = _options(partitions, schedules, flops is not None, v)
    multiple = multiple_of or (segment_multiple(config) if config is not None else 1)
    ks = sorted(set(splits)) if splits else split_counts(seq_length, multiple,
                                                         min_segment_length, max_splits)
    costs_of = {"balanced": flops, "measured": calibration}
    budgeted = (memory_budget is not None or memory_budget_bytes is not None
                or memory_budget_total_bytes is not None)

    candidates: list[Plan] = []
    for k in ks:
        seen: set[tuple[int, ...]] = set()
        for partition in partitions:
            try:
                lengths = tuple(split_sequence(seq_length, k, partition, multiple_of=multiple,
                                               cost=costs_of.get(partition)))
            except ValueError:  # e.g. a calibration whose cost does not grow with length
                continue
            if lengths in seen or (k > 1 and min(lengths) < min_segment_length):
                continue  # the same split under an earlier name, or segments too short
            seen.add(lengths)
            for name in schedules:
                plan = _evaluate(calibration, p, m, v, partition, lengths, name, send_slack,
                                 memory_model, micro_batch_size)
                if plan is None:
                    continue
                memory_bytes = (plan.memory * seq_length * micro_batch_size * bytes_per_token
                                if bytes_per_token else None)
                fits = ((memory_budget is None or plan.memory <= memory_budget + 1e-9)
                        and (memory_budget_bytes is None or memory_bytes <= memory_budget_bytes)
                        and (memory_budget_total_bytes is None
                             or plan.peak_stage_bytes <= memory_budget_total_bytes)
                        ) if budgeted else None
                candidates.append(replace(plan, memory_bytes=memory_bytes, within_budget=fits))
    if not candidates:
        raise ValueError(f"no candidate plan: no split of {seq_length} tokens into segments of "
                         f"at least {min_segment_length} tokens (multiple of {multiple})")
    ranked = tuple(sorted(candidates, key=_rank_key))
    feasible = [c for c in ranked if c.within_budget is not False]
    if not feasible:
        smallest = min(ranked, key=_memory_key)
        budget = " and ".join(
            ([f"{memory_budget:.2f} micro-batches"] if memory_budget is not None else [])
            + ([bytes_text(memory_budget_bytes)] if memory_budget_bytes is not None else [])
            + ([f"{bytes_text(memory_budget_total_bytes)} in all"]
               if memory_budget_total_bytes is not None else []))
        raise BudgetError(
            f"no plan fits the activation-memory budget of {budget} per stage: the smallest "
            f"reachable is {smallest.memory_text()}, by {smallest.describe()} (lengths "
            f"{list(smallest.lengths)}); raise the budget, or allow more splits "
            f"(max_splits={max_splits}, min_segment_length={min_segment_length})", smallest)
    chosen = _pick(feasible, tie_tolerance)
    return PlanChoice(chosen, ranked, explain(ranked, chosen, tie_tolerance), calibration.source)


def _options(partitions, schedules, have_flops: bool, chunks: int) -> tuple[list, list]:
    """The partitions and schedules to try, in METHODS / SCHEDULES order; asking for one
    that cannot be built is an error (leaving it out silently would hide it)."""
    available = [x for x in METHODS if x != "balanced" or have_flops]
    allowed = [s for s in SCHEDULES if not (s == "zb-h2" and chunks > 1)]  # ZB_H2_PROBLEM
    for name in partitions or ():
        if name not in available:
            raise ValueError(f"partition {name!r} is not available here; choose from {available}"
                             " ('balanced' needs config= or cost_model=)")
    for name in schedules or ():
        if name not in allowed:
            raise ValueError(f"schedule {name!r} is not available with {chunks} model chunk(s); "
                             f"choose from {allowed}")
    return ([x for x in METHODS if x in (partitions or available)],
            [s for s in SCHEDULES if s in (schedules or allowed)])


def _evaluate(calibration: Calibration, p: int, m: int, v: int, partition: str,
              lengths: tuple[int, ...], name: str, send_slack: int,
              memory_model: MemoryModel | None = None, micro_batch_size: int = 1
              ) -> Plan | None:
    """One candidate's predicted time, bubble and memory; None if the executor would
    refuse its steps (deadlock, link order)."""
    zero_bubble = name != "1f1b"
    costs = placement_costs(calibration, lengths, p * v) if zero_bubble else None
    schedule = build_schedule(p, m, len(lengths), v, schedule=name, costs=costs)
    try:
        time, bubble = predict(schedule, v, action_cost(calibration, lengths, p, v, zero_bubble),
                               costs, send_slack, calibration.message_latency(lengths))
    except ScheduleError:
        return None
    stages = (tuple(memory_model.stage_bytes(schedule, lengths, v, micro_batch_size))
              if memory_model is not None else None)
    return Plan(len(lengths), partition, lengths, name, time, bubble,
                activation_peak(schedule, lengths, v), unit=calibration.unit,
                segment_costs=costs, stages=stages)


def _tie_reason(chosen: Plan, other: Plan) -> str:
    if _q(chosen.memory) != _q(other.memory):
        return "less memory"
    if chosen.num_splits != other.num_splits:
        return "fewer splits"
    if chosen.partition != other.partition:
        return f"partition order {METHODS}"
    return f"schedule order {SCHEDULES}"


def explain(candidates: Sequence[Plan], chosen: Plan, tie_tolerance: float = 0.0) -> str:
    """One line: why `chosen` won over the others."""
    ranked = sorted(candidates, key=_rank_key)
    faster = [c for c in ranked if _rank_key(c) < _rank_key(chosen)]
    over = [c for c in faster if c.within_budget is False]
    budget = (f"; {len(over)} faster plan(s) exceed the memory budget, e.g. "
              f"{over[0].describe()} (needs {over[0].memory_text()})" if over else "")
    fastest = next(c for c in ranked if c.within_budget is not False)
    if fastest != chosen:
        return (f"{chosen.describe()} wins: predicted {chosen.time / fastest.time - 1:.1%} "
                f"slower than the fastest{' within the budget' if over else ''}, "
                f"{fastest.describe()}, which is within the tie tolerance of "
                f"{tie_tolerance:.0%}, and it leans less on the cost model "
                f"({_robust_reason(chosen, fastest)}){budget}")
    rest = [c for c in ranked if _rank_key(c) > _rank_key(chosen)
            and c.within_budget is not False]
    if rest:
        nxt = rest[0]
        if _q(nxt.time) == _q(chosen.time):
            versus = f"as fast as {nxt.describe()}, and wins the tie on {_tie_reason(chosen, nxt)}"
        else:
            versus = (f"{nxt.time / chosen.time - 1:.1%} faster than the next"
                      f"{' within the budget' if faster else ''}, {nxt.describe()}")
    else:
        versus = "the only candidate" + (" within the budget" if faster else "")
    if not faster:
        return f"{chosen.describe()} wins: fastest; {versus}"
    best = faster[0]
    return (f"{chosen.describe()} wins: fastest within the memory budget "
            f"({chosen.memory_text()}); {len(faster)} faster plan(s) exceed it, e.g. "
            f"{best.describe()} ({chosen.time / best.time - 1:.1%} faster, needs "
            f"{best.memory_text()}); {versus}")


def _robust_reason(chosen: Plan, fastest: Plan) -> str:
    if chosen.schedule != fastest.schedule:
        return f"{chosen.schedule} rather than {fastest.schedule}"
    if chosen.partition != fastest.partition and chosen.num_splits > 1:
        return f"the {chosen.partition} partition rather than the {fastest.partition} one"
    return f"{chosen.num_splits} segments rather than {fastest.num_splits}"


def _time_text(value: float, unit: str) -> str:
    return f"{value * 1e3:.2f} ms" if unit == "s" else f"{value:.4g} {unit}"


def _lengths_text(lengths: Sequence[int]) -> str:
    if len(lengths) <= 4:
        return ",".join(map(str, lengths))
    return f"{lengths[0]},{lengths[1]},..,{lengths[-1]}"


def format_table(candidates: Sequence[Plan], chosen: Plan, reason: str | None = None) -> str:
    """All candidates, fastest first (``*`` = chosen), then why the winner won."""
    ranked = sorted(candidates, key=_rank_key)
    best = ranked[0].time
    with_bytes = any(c.memory_bytes for c in ranked)
    with_stages = any(c.stages for c in ranked)
    header = (f"  {'k':>3} {'partition':<9} {'schedule':<8} {'time':>14} {'vs best':>8} "
              f"{'bubble':>7} {'memory (mb)':>12}" + (f" {'bytes':>10}" if with_bytes else "")
              + (f" {'max stage':>10}" if with_stages else "") + f" {'budget':>6}  lengths")
    lines = [header, "-" * len(header)]
    for c in ranked:
        budget = {None: "-", True: "ok", False: "over"}[c.within_budget]
        gib = f" {bytes_text(c.memory_bytes):>10}" if with_bytes and c.memory_bytes else ""
        if with_stages:
            gib += f" {c.peak_stage_bytes / GIB:>6.2f} GiB" if c.stages else f" {'-':>10}"
        lines.append(
            f"{'*' if c == chosen else ' '} {c.num_splits:>3} {c.partition:<9} {c.schedule:<8} "
            f"{_time_text(c.time, c.unit):>14} {c.time / best - 1:>+8.1%} {c.bubble:>7.1%} "
            f"{c.memory:>12.2f}{gib} {budget:>6}  {_lengths_text(c.lengths)}")
    lines.append(reason or explain(ranked, chosen))
    return "\n".join(lines)


# ------------------------------------------------------------------ command line


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_seq1f1b.planner",
        description="Pick segments per micro-batch, partition and schedule from per-segment "
                    "costs (a calibration file, or FLOPs of the model) and a memory budget.")
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--calibration", help="calibration JSON, or a benchmark's results.json")
    parser.add_argument("--layout", default="plain",
                        help="which fits of a results.json (plain or interleaved)")
    model = parser.add_argument_group("model (FLOP costs; the balanced partition)")
    model.add_argument("--hidden-size", type=int)
    model.add_argument("--num-layers", type=int)
    model.add_argument("--num-attention-heads", type=int)
    model.add_argument("--num-query-groups", type=int)
    model.add_argument("--ffn-hidden-size", type=int)
    model.add_argument("--swiglu", action="store_true", help="gated linear unit")
    model.add_argument("--vocab-size", type=int)
    model.add_argument("--dense-attention", action="store_true",
                       help="attention computes the masked scores too (non-flash kernels)")
    parser.add_argument("--memory-budget", type=float,
                        help="peak activations per stage, in micro-batches of a stage")
    parser.add_argument("--memory-budget-gib", type=float, help="needs --bytes-per-token")
    parser.add_argument("--bytes-per-token", type=float,
                        help="activation bytes one token of one sample leaves on a stage")
    parser.add_argument("--min-segment-length", type=int, default=128)
    parser.add_argument("--max-splits", type=int, default=16)
    parser.add_argument("--multiple-of", type=int, default=1,
                        help="every segment length's divisor (tp with sequence parallelism, "
                             "x8 with FP8)")
    parser.add_argument("--splits", type=int, nargs="+", help="only these k")
    parser.add_argument("--partitions", nargs="+", choices=METHODS)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES)
    parser.add_argument("--message-latency", type=float, default=None, metavar="SECONDS",
                        help="one-way time of a pipeline message (default: the calibration's "
                             "message fit, else 0)")
    parser.add_argument("--send-slack", type=int, choices=(0, 1), default=RUNTIME_SEND_SLACK,
                        help="1 (default): sends finish a step later, as the executor runs on "
                             "gloo and NCCL; 0: a step waits for all its transfers "
                             "(SEQ1F1B_P2P=batch on NCCL, Megatron's own schedules)")
    parser.add_argument("--flop-rate", type=float, default=OFFLINE_FLOP_RATE / 1e12,
                        metavar="TFLOPS",
                        help="without --calibration: sustained TFLOP/s that turn FLOPs into "
                             f"seconds (default {OFFLINE_FLOP_RATE / 1e12:g})")
    parser.add_argument("--host-ms-per-layer", type=float,
                        default=OFFLINE_HOST_SECONDS_PER_LAYER * 1e3,
                        help="without --calibration: host time a unit pays per layer of its "
                             "stage, forward + backward (default "
                             f"{OFFLINE_HOST_SECONDS_PER_LAYER * 1e3:g}, measured on an H200; 0: "
                             "FLOPs alone)")
    parser.add_argument("--tie-tolerance", type=float, default=None, metavar="FRACTION",
                        help="plans predicted this close to the fastest count as a tie, won by "
                             "1F1B over zero bubble, then balanced/measured/uniform (default: "
                             f"{MEASURED_TIE_TOLERANCE} with --calibration, measured costs; 0 "
                             "with FLOP costs)")
    memory = parser.add_argument_group(
        "memory per stage (with the model: weights, main gradients, Adam states, activations)")
    memory.add_argument("--bf16", action="store_true", help="bf16 weights (default fp32)")
    memory.add_argument("--fp16", action="store_true", help="fp16 weights")
    memory.add_argument("--no-grad-reduce-in-fp32", action="store_true",
                        help="half-precision main gradients (default: fp32 with bf16/fp16)")
    memory.add_argument("--optimizer", choices=["adam", "none"], default="adam")
    memory.add_argument("--use-distributed-optimizer", action="store_true",
                        help="shard master weights and Adam moments over data-parallel ranks")
    memory.add_argument("--data-parallel-size", type=int, default=1)
    memory.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                        help="(default: tied, as Megatron-LM)")
    memory.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"],
                        default="rope")
    memory.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    memory.add_argument("--disable-bias-linear", action="store_true")
    memory.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="budget for the busiest stage's total (weights, gradients, "
                             "optimizer, activations)")
    parser.add_argument("--json", help="write the choice and all candidates here")
    parser.add_argument("--save-calibration", help="write the costs used as a calibration file")
    return parser.parse_args(argv)


def _model_config(args: argparse.Namespace):
    if args.hidden_size is None:
        return None
    missing = [f"--{n.replace('_', '-')}" for n in ("num_layers", "num_attention_heads")
               if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"--hidden-size needs {' and '.join(missing)} too")
    return SimpleNamespace(
        hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads, kv_channels=None,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        gated_linear_unit=args.swiglu)


def _memory_model(args: argparse.Namespace, config) -> MemoryModel | None:
    """With the model's sizes and vocabulary: weights, gradients, optimizer and activations
    per stage; the activations' bytes per token scaled to --bytes-per-token if given."""
    if config is None or not args.vocab_size:
        if args.gpu_memory_gib is not None:
            raise SystemExit("--gpu-memory-gib needs the model (--hidden-size ...) and "
                             "--vocab-size")
        return None
    shape = ModelShape(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, vocab_size=args.vocab_size,
        ffn_hidden_size=config.ffn_hidden_size, num_query_groups=config.num_query_groups,
        gated_linear_unit=config.gated_linear_unit, normalization=args.normalization,
        add_bias_linear=not args.disable_bias_linear,
        tied_embeddings=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        max_sequence_length=args.seq_length)
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    training = Training(dtype=dtype, grad_reduce_in_fp32=False if args.no_grad_reduce_in_fp32
                        else None, optimizer=None if args.optimizer == "none" else "adam",
                        distributed_optimizer=args.use_distributed_optimizer,
                        data_parallel_size=args.data_parallel_size)
    return MemoryModel(shape, training, flash=not args.dense_attention,
                       bytes_per_token=args.bytes_per_token)


def main(argv=None) -> int:
    args = _parse_args(argv)
    config = _model_config(args)
    memory_model = _memory_model(args, config)
    calibration = load_calibration(args.calibration, args.layout) if args.calibration else None
    if calibration is None and config is None:
        raise SystemExit("give --calibration FILE, or the model (--hidden-size, --num-layers, "
                         "--num-attention-heads, ...) for FLOP costs")
    if calibration is None:
        stages = args.pp * args.vpp
        calibration = Calibration.from_cost_model(
            CostModel.from_config(config, args.vocab_size, args.dense_attention), stages,
            flop_rate=args.flop_rate * 1e12,
            host_seconds=args.host_ms_per_layer * 1e-3 * args.num_layers / stages)
    if args.message_latency is not None:
        calibration = replace(calibration, message=Fit(0.0, 0.0, args.message_latency))
    try:
        choice = choose_plan(
            args.seq_length, args.pp, args.microbatches, num_model_chunks=args.vpp,
            micro_batch_size=args.micro_batch_size, calibration=calibration, config=config,
            vocab_size=args.vocab_size, dense_attention=args.dense_attention,
            memory_budget=args.memory_budget,
            memory_budget_bytes=args.memory_budget_gib * GIB if args.memory_budget_gib else None,
            bytes_per_token=args.bytes_per_token, min_segment_length=args.min_segment_length,
            max_splits=args.max_splits, multiple_of=args.multiple_of, splits=args.splits,
            partitions=args.partitions, schedules=args.schedules, send_slack=args.send_slack,
            tie_tolerance=(args.tie_tolerance if args.tie_tolerance is not None else
                           MEASURED_TIE_TOLERANCE if args.calibration else 0.0),
            memory_model=memory_model,
            memory_budget_total_bytes=args.gpu_memory_gib * GIB if args.gpu_memory_gib else None)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"seq_length {args.seq_length}, p={args.pp}, v={args.vpp}, m={args.microbatches}, "
          f"micro-batch size {args.micro_batch_size}; costs: {calibration.source or 'calibration'}"
          f" ({calibration.unit})")
    print(choice.table())
    plan = choice.plan
    print(f"chosen: --seq1f1b-splits {plan.num_splits} --seq1f1b-partition {plan.partition} "
          f"--seq1f1b-schedule {plan.schedule}  (split_lengths {list(plan.lengths)})")
    if args.save_calibration:
        save_calibration(calibration, args.save_calibration)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "plan": _plan_dict(plan), "reason": choice.reason,
            "candidates": [_plan_dict(c) for c in choice.candidates]}, indent=1) + "\n")
    return 0


def _plan_dict(plan: Plan) -> dict:
    return {"num_splits": plan.num_splits, "partition": plan.partition,
            "lengths": list(plan.lengths), "schedule": plan.schedule, "time": plan.time,
            "unit": plan.unit, "bubble": plan.bubble, "memory_microbatches": plan.memory,
            "memory_bytes": plan.memory_bytes, "within_budget": plan.within_budget,
            "segment_costs": plan.segment_costs,
            "stages": [dict(s) for s in plan.stages] if plan.stages else None}


if __name__ == "__main__":
    raise SystemExit(main())
