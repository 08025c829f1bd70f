"""What a segment is, and what carries over from one segment of a micro-batch to the next.

* :mod:`~megatron_seq1f1b.segments.run`: :class:`SegmentInfo`, the iteration's
  :class:`SegmentRun` and the active segment (:func:`current_segment`), batch slicing
  (:func:`slice_batch`);
* :mod:`~.documents` and :mod:`~.document_plan`: packed documents, what each segment may
  see of them, and every micro-batch's documents as plan data known on every rank;
  :mod:`~.packed`: a segment's document pieces as one THD batch;
* :mod:`~.kv_cache`: the carry-over store (earlier segments' keys and values, and the
  gradients later segments return to them);
* :mod:`~.state_carry`: a recurrent layer's state handed to the next segment (and its
  gradient back); :mod:`~.active`: which unit is running;
* :mod:`~.length_plan`: every micro-batch's length, agreed before an iteration
  (variable lengths); :mod:`~.document_runs`: a micro-batch's runs of documents scheduled
  apart (``backward_by_documents``);
* :mod:`~.loss` (a micro-batch's loss normalized over its segments), :mod:`~.reports` (one
  report per micro-batch, as Megatron returns them), :mod:`~.moe` (router losses per
  segment), :mod:`~.mtp` (multi-token prediction reading later segments' tokens),
  :mod:`~.cp_group` (a segment's context-parallel collectives).

May import: :mod:`megatron_seq1f1b.base`, :mod:`megatron_seq1f1b.schedules`, torch.
The names of :mod:`~.run` that the public API lists are importable from here too.
"""

from __future__ import annotations

_PUBLIC = ("SegmentInfo", "current_segment", "slice_batch")


def __getattr__(name: str):
    if name in _PUBLIC:
        from megatron_seq1f1b.segments import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
