"""The planner's stage-0 activation memory for a benchmark row, to set beside the measured peak.

The benchmark measures each run's peak above the memory resident at its start (weights
and gradient buffers already allocated), that is the activations a stage holds at its
busiest; the planner predicts the same quantity per rank with
:func:`megatron_seq1f1b.planner.stage_memory` (its ``activations`` entry), from the model's
shape, the schedule's action lists, the segment lengths, the attention kernel and the
context-parallel size, as :func:`megatron_seq1f1b.planner.rehearse.predicted` asks it for a
rehearsed stage. Rows whose action lists the planner does not build the same way
(Megatron's interleaved schedule, full recompute, zero bubble placed by the executor's FLOP
model) and layouts it does not model (tensor parallelism, experts) get no prediction.
"""

from __future__ import annotations

import argparse

import torch

from megatron_seq1f1b.bench.lineup import BenchSchedule


def predictable(sched: BenchSchedule, args: argparse.Namespace) -> bool:
    """Whether the planner builds this row's action lists and models its layout."""
    if args.tp > 1 or args.num_experts or sched.recompute:
        return False
    if sched.megatron:
        return sched.layout.chunks == 1  # Megatron's 1F1B is Seq1F1B's with one segment
    return sched.schedule == "1f1b" or sched.segment_costs is not None


def predicted_stage0_bytes(sched: BenchSchedule, args: argparse.Namespace, config,
                           documents: list | None = None) -> float | None:
    """Predicted peak activation bytes of one stage-0 rank for this row (None: not modelled).

    ``documents``: each packed micro-batch's documents; the planner then counts what each
    segment keeps for them (the documents row with its own cuts per micro-batch). Megatron's
    schedules on local attention keep a dense ``[s, s]`` mask and scores instead: not modelled.
    """
    from megatron_seq1f1b.planner import stage_memory
    from megatron_seq1f1b.planner.footprint import ModelShape, Training

    flash = getattr(args, "attention_backend", "local") == "flash"
    if not predictable(sched, args) or (documents is not None and sched.megatron and not flash):
        return None
    per_microbatch = None
    if documents is not None and sched.partition == "documents" and sched.document_stats:
        per_microbatch = sched.document_stats["segments_per_microbatch"]
    shape = ModelShape.from_config(
        config, args.vocab_size, tied_embeddings=True,  # the trainer's default
        position_embedding_type=args.position_embedding_type,
        max_sequence_length=args.seq_length,
        pattern=getattr(args, "hybrid_layer_pattern", None))
    training = Training(dtype="bf16" if args.bf16 else "fp32", optimizer=None)
    memory = stage_memory(
        shape, training, args.pp, args.microbatches, sched.lengths,
        num_model_chunks=sched.layout.chunks, schedule=sched.schedule,
        micro_batch_size=args.micro_batch_size,
        flash=flash, costs=sched.segment_costs, context_parallel_size=args.context_parallel_size,
        documents=documents, microbatch_lengths=per_microbatch,
        # Mamba-2 / gated delta net layers: what their kernels keep (the references on CPU)
        recurrent_kernels="cuda" if torch.cuda.is_available() else "reference")
    return float(memory[0]["activations"])
