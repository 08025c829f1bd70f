"""What packed documents predict for each row: segment cost spread and attention work skipped.

The documents partition exists to even out segment costs when documents, not the
sequence's causal triangle, decide what attention computes; ``balanced`` assumes the
triangle. Both are judged here by the cost model the partition itself cuts with
(:func:`megatron_seq1f1b.schedules.partition.document_segment_cost`), evaluated on the same
micro-batches' documents: for fixed-length rows their lengths, for the documents row
the cuts :func:`~megatron_seq1f1b.schedules.partition.split_documents` makes per micro-batch
(exactly what the executor runs). Pure host arithmetic: no torch, no Megatron.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from megatron_seq1f1b.schedules.partition import (
    CostModel, cut_spread, document_segment_cost, split_documents,
)
from megatron_seq1f1b.segments.documents import Documents


def _bounds(lengths: Sequence[int]) -> list[int]:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds


def cost_spread(lengths: Sequence[int], documents: Documents, cost: CostModel) -> float:
    """max / min predicted cost of the segments ``lengths`` on this micro-batch's documents."""
    return cut_spread(_bounds(lengths)[1:-1], document_segment_cost(documents, cost),
                      documents.seq_length)


def attention_pairs(lengths: Sequence[int], documents: Documents,
                    dense: bool) -> tuple[float, float]:
    """(pairs computed with documents, pairs of the same segments on one causal document per
    sample), per sample. ``dense``: the backend computes every score of a segment's keys
    (Megatron's local attention), so only keys before a document crossing in are skipped."""
    whole = Documents.whole(documents.seq_length, documents.micro_batch_size)
    bounds = _bounds(lengths)
    pieces = list(zip(bounds, bounds[1:]))
    return (sum(documents.pairs(a, b, dense) for a, b in pieces),
            sum(whole.pairs(a, b, dense) for a, b in pieces))


def segments_of(lengths: Sequence[int] | None, documents: Documents, num_splits: int,
                cost: CostModel, multiple_of: int) -> list[int]:
    """A row's segments on one micro-batch: its fixed ``lengths``, or (None) the documents
    partition's cut, as the executor makes it."""
    if lengths is not None:
        return list(lengths)
    return split_documents(documents, num_splits, cost, multiple_of=multiple_of)


def row_stats(lengths: Sequence[int] | None, found: Sequence[Documents], num_splits: int,
              cost: CostModel, multiple_of: int) -> dict:
    """results.json's ``documents`` entry of one row, over the micro-batches ``found``.

    ``cost_spread``: the worst micro-batch's max / min segment cost (1.0 with one segment);
    ``attention_pairs_skipped``: the share of a dense causal run's attention pairs that
    documents let this row skip.
    """
    segments = [segments_of(lengths, docs, num_splits, cost, multiple_of) for docs in found]
    spreads = [cost_spread(seg, docs, cost) for seg, docs in zip(segments, found)]
    pairs = [attention_pairs(seg, docs, cost.dense_attention)
             for seg, docs in zip(segments, found)]
    computed = statistics.fmean(p[0] for p in pairs)
    causal = statistics.fmean(p[1] for p in pairs)
    return {
        "cost_spread": max(spreads), "cost_spread_mean": statistics.fmean(spreads),
        "cost_spread_per_microbatch": spreads,
        "attention_pairs": computed, "attention_pairs_dense_causal": causal,
        "attention_pairs_skipped": 1.0 - computed / causal if causal else 0.0,
        "segments_per_microbatch": segments,
        "documents_per_microbatch": [sum(len(s) for s in docs.starts) / docs.micro_batch_size
                                     for docs in found],
        "dense_attention": cost.dense_attention,
    }
