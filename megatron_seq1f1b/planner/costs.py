"""The planner's per-segment costs: a :class:`Calibration`, read and written as JSON.

Costs come from a :class:`Calibration`: per virtual stage (pipeline order,
``chunk * pp + rank``) and direction a fit ``time = a*len + c*quad(len, end)
+ d``, as :mod:`megatron_seq1f1b.planner.fit` produces; or from the FLOP
:class:`~megatron_seq1f1b.schedules.partition.CostModel` when nothing is measured. A
start-up measurement only has to return a :class:`Calibration`
(:meth:`Calibration.from_samples` fits the samples
:mod:`megatron_seq1f1b.bench.calibration` takes). :func:`action_cost` and
:func:`placement_costs` turn one into what a replay and a zero-bubble placement read.

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
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from megatron_seq1f1b.planner.fit import QUADRATIC, extrapolated_fits, fit_costs, quadratic_for
from megatron_seq1f1b.schedules.partition import CostModel
from megatron_seq1f1b.schedules.simulate import CostFn

FORMAT = "megatron_seq1f1b.calibration"

__all__ = ["FORMAT", "Fit", "StageCosts", "Calibration", "save_calibration", "load_calibration",
           "action_cost", "action_cost_table", "placement_costs"]


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
        return self.at(length, QUADRATIC[quadratic](length, end))

    def at(self, length: float, pairs: float) -> float:
        """The time of ``length`` tokens whose attention computes ``pairs`` pairs."""
        return max(self.a * length + self.c * pairs + self.d, self.floor)


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
    stage counts are extrapolated like :func:`~megatron_seq1f1b.planner.fit.extrapolated_fits`
    (first and last kept, the rest a middle one); a stage's fit holds for its
    layers, so plan the virtual pipeline size it was measured with.
    Zero-bubble schedules give ``W`` the ``weight`` fit, else
    ``weight_fraction`` of the backward. ``bytes_per_token``: activation bytes
    one token of one sample leaves on the most loaded stage (measured at
    start-up), which turns the plans' memory into bytes. ``message``: one-way
    time of a pipeline message of a segment (``a`` per token, ``d`` fixed);
    each candidate is replayed with its segments' mean as the latency of every
    step that exchanges tensors. ``pairs``: the quadratic term for packed documents
    (:meth:`with_documents`; not saved with the calibration).
    """

    stages: tuple[StageCosts, ...]
    quadratic: str = "causal_pairs"
    weight_fraction: float = 0.5
    unit: str = "s"
    source: str = ""
    bytes_per_token: float | None = None
    message: Fit | None = None
    pairs: Callable[[float, float], float] | None = field(default=None, compare=False,
                                                           repr=False)

    def with_documents(self, documents) -> "Calibration":
        """These costs on a packed micro-batch: attention pairs within its documents
        (:meth:`~megatron_seq1f1b.segments.documents.Documents.pairs`; every score of the rectangle
        from the crossing document's start for the local kernel)."""
        return replace(self, pairs=documents.pair_function(dense=self.quadratic == "rectangle"))

    def quad(self, length: float, end: float) -> float:
        """The quadratic (attention) term of a segment of ``length`` tokens ending at ``end``."""
        if self.pairs is not None:
            return self.pairs(length, end)
        return QUADRATIC[self.quadratic](length, end)

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
        pairs = self.quad(length, end)
        forward = stage.forward.at(length, pairs)
        backward = stage.backward.at(length, pairs)
        weight = (stage.weight.at(length, pairs) if stage.weight
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
        split = stage.input.at(length, self.quad(length, end)) if stage.input else None
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
                        flop_rate: float | None = None, host_seconds: float = 0.0,
                        context_parallel_size: int = 1,
                        exchange_seconds_per_token: float = 0.0,
                        tensor_parallel_size: int = 1) -> "Calibration":
        """FLOPs when nothing is measured: the model split evenly over ``num_stages``;
        backward = input gradients + weight gradients (:meth:`CostModel.backward_parts`).

        With ``flop_rate`` (FLOP/s) the costs are seconds, and every unit pays
        ``host_seconds`` of fixed time on top (forward and backward half each): the
        host's dispatch, which FLOPs do not see, as a floor (:class:`Fit`): a unit whose
        kernels take less than that waits for the host. With ``context_parallel_size``
        and ``tensor_parallel_size`` each rank computes ``1 / (cp * tp)`` of the work (TP
        splits every layer's heads and MLP columns and the vocabulary), and per token of
        a segment a stage spends ``exchange_seconds_per_token`` communicating inside its
        stage (the CP group's exchange of keys and values, the TP group's all-reduces) in
        its forward, and as much in its backward (seconds only).
        """
        cp, tp = context_parallel_size, tensor_parallel_size
        n = float(num_stages) * cp * tp
        a, c = model.per_token / n, model.per_pair / n
        quadratic = "rectangle" if model.dense_attention else "causal_pairs"
        if flop_rate is None:
            stage = StageCosts(Fit(a, c), Fit(2 * a, 2 * c), Fit(a, 0.0))
            return cls((stage,) * num_stages, quadratic, unit="FLOP", source="FLOP cost model")
        a, c, host = a / flop_rate, c / flop_rate, host_seconds / 2
        x = exchange_seconds_per_token
        stage = StageCosts(Fit(a + x, c, floor=host), Fit(2 * a + x, 2 * c, floor=host),
                           Fit(a, 0.0))
        groups = ", ".join(([f"tensor parallelism {tp}"] if tp > 1 else [])
                           + ([f"context parallelism {cp}"] if cp > 1 else []))
        exchange = f", {groups} ({x * 1e9:.3g} ns exchange per token)" if groups else ""
        return cls((stage,) * num_stages, quadratic, unit="s",
                   source=f"FLOP cost model at {flop_rate / 1e12:g} TFLOP/s, "
                          f"{host_seconds * 1e3:.3g} ms host time per unit{exchange}")

    @classmethod
    def from_fits(cls, ordered_fits: Sequence[dict], quadratic: str, source: str = "fits",
                  weight_fraction: float = 0.5, unit: str = "s",
                  bytes_per_token: float | None = None) -> "Calibration":
        """From :mod:`~megatron_seq1f1b.planner.fit` entries in pipeline order: ``{"F": {a, c, d}, "B": ...}``."""
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
                     dense_attention: bool = False, floors: dict | None = None,
                     documents=None) -> "Calibration":
        """Fit timed segments ``{(stage, chunk): [[length, end, forward_s, backward_s(,
        weight_s)], ...]}`` (:mod:`megatron_seq1f1b.planner.measure`'s format); unless given, the
        quadratic of :func:`~megatron_seq1f1b.planner.fit.quadratic_for` (``dense_attention``:
        the model runs Megatron's local attention, which computes the score rectangle).
        ``floors``: per ``(stage, chunk)`` the (forward, backward) host dispatch seconds,
        the fits' :attr:`Fit.floor` (a GPU's host; none on a CPU). ``documents``: the
        segments were timed on that packed micro-batch: the quadratic term is its pairs
        (the fits' ``c`` stays a cost per pair)."""
        if quadratic is None:
            quadratic = "rectangle" if dense_attention else (
                "causal_pairs" if documents is not None
                else quadratic_for({"samples": samples}, dense_attention)[0])
        pairs = (documents.pair_function(dense=quadratic == "rectangle")
                 if documents is not None else None)
        fits = fit_costs(samples, quadratic, pairs)
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
    """Read a calibration file, or a benchmark's results.json (its ``layout`` fits: "plain" or
    "interleaved"; a calibration file has no layouts, only "plain")."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"not a calibration: the file holds a JSON {type(data).__name__}, not "
                         "an object (format in megatron_seq1f1b.planner.costs)")
    if "calibration" in data and isinstance(data["calibration"], dict):
        bench = data["calibration"]
        fits = bench["fits"][layout]  # {"stage.chunk": {"F": ..., "B": ...}}
        order = sorted(fits, key=lambda key: tuple(reversed([int(x) for x in key.split(".")])))
        return Calibration.from_fits([fits[key] for key in order], bench["quadratic"],
                                     f"{path} ({layout} fits)")
    if layout != "plain":
        raise ValueError(f"layout {layout!r} picks the fits of a benchmark's results.json; this "
                         "is a calibration file (its stages as saved)")
    return Calibration.from_dict(data)


def action_cost_table(calibration: Calibration, lengths: Sequence[int], num_stages: int,
                      num_model_chunks: int = 1, split_backward: bool = False
                      ) -> dict[tuple[int, int], dict[str, float]]:
    """``{(virtual stage, segment): {"F": .., "B": .., "W": ..}}``: what :func:`action_cost`
    reads (B is the whole backward and W 0 unless W is split off)."""
    stages = calibration.stage_costs(num_stages * num_model_chunks)
    ends = list(itertools.accumulate(lengths))
    rows: dict[StageCosts, list[tuple[float, float, float]]] = {}  # stages alike: one row
    table = {}
    for vs, stage in enumerate(stages):
        row = rows.get(stage)
        if row is None:
            if split_backward:
                row = [calibration.zero_bubble_times(stage, length, end)
                       for length, end in zip(lengths, ends)]
            else:
                row = [calibration.times(stage, length, end)[:2] + (0.0,)
                       for length, end in zip(lengths, ends)]
            rows[stage] = row
        for j, (forward, backward, weight) in enumerate(row):
            table[vs, j] = {"F": forward, "B": backward, "W": weight}
    return table


def action_cost(calibration: Calibration, lengths: Sequence[int], num_stages: int,
                num_model_chunks: int = 1, split_backward: bool = False) -> CostFn:
    """cost(action, rank) for :func:`predict`: B is the whole backward unless W is split off."""
    table = action_cost_table(calibration, lengths, num_stages, num_model_chunks,
                              split_backward)
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

