"""Interleaved Seq1F1B (model chunks / virtual pipeline stages)."""

from __future__ import annotations


def interleaved_problems(num_stages: int, num_microbatches: int, num_splits: int,
                         num_model_chunks: int) -> list[str]:
    return ["interleaved Seq1F1B (several model chunks) is not implemented yet"]


def build_interleaved_schedule(num_stages, num_microbatches, num_splits, num_model_chunks, *,
                               forward_only=False):
    raise NotImplementedError("interleaved Seq1F1B is not implemented yet")
