"""The planner's memory model: activations held per stage, and each stage's total bytes.

Memory is the peak of activations held on a stage, in micro-batches of that
stage (a unit of segment ``j`` on one of ``v`` chunks holds
``len_j / (seq_length * v)``; from its forward until its backward, or until
its ``W`` in zero-bubble schedules; :func:`activation_peak`). With a
:class:`MemoryModel` (the model's shape and how it is trained) every
candidate also gets each stage's total: weights, main gradients, optimizer
states (:mod:`megatron_seq1f1b.planner.footprint`) and its activations replayed unit
by unit with that stage's own bytes per token (:func:`stage_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_seq1f1b.planner.footprint import (
    ModelShape, Training, attention_pair_bytes, chunk_activation_bytes, stage_activation_bytes,
    stage_attention_layers, stage_parameters, unit_bytes,
)
from megatron_seq1f1b.planner.recurrent import RecurrentUnits, chunk_recurrent_units
from megatron_seq1f1b.schedules.schedule import Schedule, build_schedule

GIB = 2.0 ** 30

__all__ = ["GIB", "bytes_text", "activation_peak", "MemoryModel", "stage_memory"]


def bytes_text(count: float) -> str:
    """GiB, or MiB below a tenth of one (small models, tests)."""
    return f"{count / GIB:.2f} GiB" if count >= 0.1 * GIB else f"{count / 2**20:.2f} MiB"


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
    is trained (:class:`~megatron_seq1f1b.planner.footprint.Training`) and its attention kernel.

    Activation bytes per token come from
    :func:`~megatron_seq1f1b.planner.footprint.chunk_activation_bytes` for every chunk (its
    layers by kind: :meth:`~megatron_seq1f1b.planner.footprint.ModelShape.stage_layers`), and
    with Megatron's unfused attention (``flash=False``) the probabilities it keeps per
    query-key pair (:func:`~megatron_seq1f1b.planner.footprint.attention_pair_bytes`); with
    ``bytes_per_token`` (measured on a whole micro-batch: what one token of one sample
    leaves on the most loaded stage, all its chunks) every chunk's per-token estimate is
    scaled so that stage matches it (the unfused attention's ``s x s`` pairs taken out of
    the measurement first: they are counted per pair). With ``tensor_parallel_size`` every
    byte is one TP rank's (a measured ``bytes_per_token`` too: measure on a TP rank).
    Mamba-2 and gated-delta-net layers (pattern ``M``, ``G``) also hold, per unit, what
    their scans keep per chunk and the state a later segment starts from
    (:meth:`chunk_recurrent_units`); ``recurrent_kernels`` says which kernels run them
    (``"cuda"``: mamba_ssm, causal-conv1d and fla; ``"reference"``: the package's torch
    references on CPU; :mod:`~megatron_seq1f1b.planner.recurrent`).
    """

    shape: ModelShape
    training: Training = Training()
    flash: bool = True
    bytes_per_token: float | None = None
    activation_scale: float = 1.0  # e.g. measured / estimated activations of a rehearsal
    context_parallel_size: int = 1  # each rank holds 1/cp of the tokens, all of the K/V
    tensor_parallel_size: int = 1  # per TP rank: split layers and their activations
    sequence_parallel: bool = False  # with TP: the [s, b, h] activations split too
    recurrent_kernels: str = "cuda"  # or "reference" (CPU): what M and G layers save

    def chunk_pair_bytes(self, num_stages: int, num_model_chunks: int = 1
                         ) -> list[list[float]]:
        """[rank][chunk] -> bytes per query-key pair its attention keeps (0 for flash)."""
        p, v = num_stages, num_model_chunks
        attention = stage_attention_layers(self.shape, p * v)
        return [[attention_pair_bytes(self.shape, attention[c * p + r],
                                      dtype=self.training.dtype, flash=self.flash,
                                      tensor_parallel_size=self.tensor_parallel_size)
                 for c in range(v)] for r in range(p)]

    def chunk_bytes_per_token(self, num_stages: int, num_model_chunks: int = 1,
                              whole_qkv: bool = False, seq_length: int | None = None
                              ) -> list[list[tuple[float, float]]]:
        """[rank][chunk] -> (bytes per token, of which keys and values); ``whole_qkv`` for
        unsegmented micro-batches (see :func:`~.footprint.activation_bytes_per_token`); ``seq_length``:
        what a measured ``bytes_per_token`` was measured on (per token a rank holds: with
        context parallelism ``seq_length / cp`` of them, and the whole sequence's K/V; the
        unfused attention's pairs are taken out)."""
        p, v = num_stages, num_model_chunks
        table = self._estimate(p, v, whole_qkv)
        scale = self.activation_scale
        if self.bytes_per_token:
            scale = self._measured_scale(p, v, seq_length)
        if scale != 1.0:
            table = [[(b * scale, kv * scale) for b, kv in rank] for rank in table]
        return table

    def _estimate(self, p: int, v: int, whole: bool) -> list[list[tuple[float, float]]]:
        layers = self.shape.stage_layers(p * v)
        return [[chunk_activation_bytes(
            self.shape, layers[c * p + r], first=c * p + r == 0, last=c * p + r == p * v - 1,
            dtype=self.training.dtype, flash=self.flash, whole_qkv=whole,
            tensor_parallel_size=self.tensor_parallel_size,
            sequence_parallel=self.sequence_parallel, recurrent_kernels=self.recurrent_kernels)
            for c in range(v)] for r in range(p)]

    def _measured_scale(self, p: int, v: int, seq_length: int | None) -> float:
        """Measured ``bytes_per_token`` (on a whole micro-batch: the calibration's k=1) over
        this model's estimate of the busiest stage, per token it holds (the recurrent layers'
        per-chunk bytes of a whole sequence included)."""
        cp = self.context_parallel_size
        table = self._estimate(p, v, cp == 1)
        pairs = [sum(rank) for rank in self.chunk_pair_bytes(p, v)]
        extras = [0.0] * p
        if seq_length:
            extras = [sum(u.bytes(seq_length // cp, False) for u in rank) / seq_length
                      for rank in self._recurrent_units(p, v, True)]
        busiest = max(range(p), key=lambda r: sum(b for b, _ in table[r]) + extras[r])
        all_bytes = sum(b for b, _ in table[busiest]) + extras[busiest]
        kv_bytes = sum(kv for _, kv in table[busiest])
        measured = self.bytes_per_token - (seq_length or 0) * pairs[busiest]
        estimated = all_bytes + (cp - 1) * kv_bytes  # per token held: K/V of cp tokens
        return max(measured, 0.0) / estimated

    def _recurrent_units(self, p: int, v: int, whole: bool) -> list[list[RecurrentUnits]]:
        layers = self.shape.stage_layers(p * v)
        return [[chunk_recurrent_units(
            self.shape, layers[c * p + r], mtp=c * p + r == p * v - 1,
            dtype=self.training.dtype, kernels=self.recurrent_kernels, whole=whole,
            tensor_parallel_size=self.tensor_parallel_size) for c in range(v)] for r in range(p)]

    def chunk_recurrent_units(self, num_stages: int, num_model_chunks: int = 1,
                              whole: bool = False, seq_length: int | None = None
                              ) -> list[list[RecurrentUnits]]:
        """[rank][chunk] -> what its Mamba-2 and gated-delta-net layers hold per unit beyond
        their bytes per token (:class:`~megatron_seq1f1b.planner.recurrent.RecurrentUnits`;
        ``whole``: a whole micro-batch), scaled as :meth:`chunk_bytes_per_token` scales."""
        p, v = num_stages, num_model_chunks
        scale = self.activation_scale
        if self.bytes_per_token:
            scale = self._measured_scale(p, v, seq_length)
        units = self._recurrent_units(p, v, whole)
        return [[u.scaled(scale) if scale != 1.0 else u for u in rank] for rank in units]

    def static_bytes(self, num_stages: int, num_model_chunks: int = 1) -> list[dict]:
        """Per rank: weights, main gradients and optimizer states, in bytes."""
        return [self.training.state_bytes(n) for n in stage_parameters(
            self.shape, num_stages, num_model_chunks, self.tensor_parallel_size)]

    def stage_bytes(self, schedule: Schedule, lengths: Sequence[int], num_model_chunks: int = 1,
                    micro_batch_size: int = 1, documents=None,
                    microbatch_lengths: Sequence[Sequence[int]] | None = None) -> list[dict]:
        """Per rank: ``weights``, ``gradients``, ``optimizer``, ``activations`` and ``total``
        bytes, activations replayed over the rank's actions. ``documents``: each
        micro-batch's packed documents (cycled), with ``microbatch_lengths`` where its
        segments differ (the documents partition): what each unit and K/V buffer then
        holds follows the documents (:func:`~megatron_seq1f1b.planner.footprint.unit_bytes`)."""
        p = len(schedule)
        microbatches = None
        if documents is not None:
            rows = microbatch_lengths or [lengths] * len(documents)
            microbatches = [unit_bytes(list(row), docs, dense=not self.flash,
                                       context_parallel_size=self.context_parallel_size)
                            for row, docs in zip(rows, documents)]
        cp = self.context_parallel_size
        whole = len(lengths) == 1 and cp == 1
        activations = stage_activation_bytes(
            schedule, lengths,
            self.chunk_bytes_per_token(p, num_model_chunks, whole, sum(lengths)),
            micro_batch_size, pair_bytes=self.chunk_pair_bytes(p, num_model_chunks),
            microbatches=microbatches, dense=not self.flash, context_parallel_size=cp,
            recurrent=self.chunk_recurrent_units(p, num_model_chunks, len(lengths) == 1,
                                                 sum(lengths)))
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
                 costs: Sequence[tuple[float, float, float]] | None = None,
                 documents=None,
                 microbatch_lengths: Sequence[Sequence[int]] | None = None,
                 context_parallel_size: int = 1, tensor_parallel_size: int = 1,
                 sequence_parallel: bool = False, recurrent_kernels: str = "cuda") -> list[dict]:
    """Each pipeline rank's predicted bytes (weights, gradients, optimizer, activations,
    total) for one plan: ``schedule`` a name (built here; zero bubble placed with
    ``costs``, else unit costs) or every rank's action lists; ``documents`` and
    ``microbatch_lengths`` as :meth:`MemoryModel.stage_bytes` takes them; with
    ``context_parallel_size`` and ``tensor_parallel_size`` per rank of the CP and TP groups;
    ``recurrent_kernels`` as :class:`MemoryModel` takes it."""
    if isinstance(schedule, str):
        schedule = build_schedule(num_stages, num_microbatches, len(lengths), num_model_chunks,
                                  schedule=schedule, costs=costs)
    model = MemoryModel(shape, training, flash, bytes_per_token,
                        context_parallel_size=context_parallel_size,
                        tensor_parallel_size=tensor_parallel_size,
                        sequence_parallel=sequence_parallel,
                        recurrent_kernels=recurrent_kernels)
    return model.stage_bytes(schedule, lengths, num_model_chunks, micro_batch_size,
                             documents=documents, microbatch_lengths=microbatch_lengths)

