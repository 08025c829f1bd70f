"""Stage rehearsal: one stage of a P-stage pipeline, run alone on one device.

One GPU cannot run a multi-stage pipeline (NCCL refuses two ranks on one
device), yet whether a configuration fits and how long each stage computes is
decided stage by stage. A schedule is data, so one stage can be run by
itself: :func:`rehearse_stage` runs exactly that stage's steps of the
``num_stages`` pipeline (the executor's ``rehearse=(num_stages, stage)``):
every receive is a made-up tensor of the message's shape and dtype, every send
is dropped, there is no stage agreement. With that stage's own model chunks
(:func:`build_stage_chunks`: the first stage has the embedding, the last the
output layer, the loss and the multi-token-prediction block, interleaved ranks
their virtual stages; a GPTModel's even share of the layers or a HybridModel's
``|`` part of its pattern) the stage's real peak memory and its compute time
without waits are measured for a pipeline that does not fit the machine. What a
stage never sees alone: the time it would wait for its neighbours (the
planner's replay adds it).

One job per module, all names importable from here:

- :mod:`~megatron_seq1f1b.planner.stage_build`: the stage's chunks
  (:func:`build_stage_chunks`, :func:`stage_layer_problems`, :func:`hybrid_stage_patterns`);
- :mod:`~megatron_seq1f1b.planner.stage_run`: running it (:func:`rehearse_stage`,
  :class:`Rehearsal`);
- :mod:`~megatron_seq1f1b.planner.rehearse_cli`: the command line (:func:`main`), which
  also prints the planner's prediction for the stage (:func:`predicted`).

Command line (world size 1; gloo on CPU, NCCL on a GPU)::

    python -m megatron_seq1f1b.rehearse --num-layers 24 --hidden-size 2048 \\
        --num-attention-heads 16 --ffn-hidden-size 8192 --vocab-size 50257 \\
        --seq-length 32768 --bf16 --attention-backend flash \\
        --pipeline-model-parallel-size 4 --rehearse-stage 0 --num-microbatches 4 \\
        --seq1f1b-splits 4 --seq1f1b-partition balanced --json stage0.json

    python -m megatron_seq1f1b.rehearse --hybrid-layer-pattern "*-*E|*-*-/*-" \\
        --num-experts 4 --hidden-size 256 --num-attention-heads 4 --vocab-size 1024 \\
        --seq-length 512 --pipeline-model-parallel-size 2 --rehearse-stage 1 \\
        --num-microbatches 4 --seq1f1b-splits 4 --disable-bias-linear
"""

from __future__ import annotations

from megatron_seq1f1b.planner.rehearse_cli import (
    build_parser, calibrate_stage, check_args, main, predicted, prepare,
)
from megatron_seq1f1b.planner.stage_build import (
    build_stage_chunks, hybrid_stage_patterns, stage_layer_problems,
)
from megatron_seq1f1b.planner.stage_run import Rehearsal, rehearse_stage

__all__ = ["Rehearsal", "build_stage_chunks", "rehearse_stage", "stage_layer_problems", "main",
           "build_parser", "check_args", "prepare", "predicted", "calibrate_stage",
           "hybrid_stage_patterns"]


if __name__ == "__main__":
    raise SystemExit(main())
