"""Every micro-batch's documents, known on every rank before an iteration runs.

Documents decide what each segment attends to and, with the ``documents``
partition, how long each segment is, so every pipeline stage needs them for
every micro-batch before its first message: a stage that learnt a segment's
length from its neighbour would need a shape handshake (Megatron's own
``variable_seq_lengths`` exchange is known to hang at pipeline size >= 4).
Instead they are plan data, sent once per iteration, before any segment:

1. The first pipeline stage's tensor-parallel rank 0, which reads the data
   anyway, takes the iteration's ``m`` micro-batches from its iterator at
   once (the schedule hands them to ``forward_step_func`` later as usual) and
   finds their documents with a :data:`DocumentSource`.
2. It broadcasts them (a list of document starts, a few integers per
   document) to its tensor-parallel group, and every first-stage rank to its
   pipeline group: two small broadcasts per iteration (each of Python objects, a size
   and a payload), whatever ``m`` and ``k``.

Nothing else is exchanged: segment lengths follow from the documents by a
deterministic function (:func:`megatron_seq1f1b.schedules.partition.split_documents`)
on every rank. A failure to read them on the first stage travels in the same
broadcasts, so every rank raises it instead of waiting.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

from megatron_seq1f1b.base.checks import ConfigError
from megatron_seq1f1b.segments.documents import Documents

#: Where a micro-batch's documents are: ``"cu_seqlens"`` (a packed batch's ``cu_seqlens``, or
#: ``cu_seqlens_padded`` when present, Megatron-LM's ``--dataloader-inter-document-masking`` and
#: ``--sft`` batches), an ``int`` (the end-of-document token id in ``tokens``, as
#: ``--reset-attention-mask``), or a callable ``(micro_batch, seq_length) -> Documents``.
DocumentSource = Union[str, int, Callable[[Any, int], Documents]]


def source_problems(source) -> list[str]:
    if source is None or source == "cu_seqlens" or callable(source):
        return []
    if isinstance(source, int) and not isinstance(source, bool) and source >= 0:
        return []
    return [f"documents={source!r}: use 'cu_seqlens', an end-of-document token id (int), or a "
            "callable (micro_batch, seq_length) -> megatron_seq1f1b.segments.documents.Documents"]


def read_documents(source: DocumentSource, batch, seq_length: int) -> Documents:
    """One micro-batch's documents, as ``source`` says where they are."""
    if callable(source):
        found = source(batch, seq_length)
        if not isinstance(found, Documents):
            raise TypeError(f"documents source returned {type(found).__name__}, not Documents")
        return found
    if not isinstance(batch, dict):
        raise TypeError(f"documents={source!r} reads a dict micro-batch, got "
                        f"{type(batch).__name__}")
    if source == "cu_seqlens":
        value = batch.get("cu_seqlens_padded")
        if value is None:
            value = batch.get("cu_seqlens")
        if value is None:
            raise KeyError("documents='cu_seqlens': the micro-batch has no 'cu_seqlens'")
        return Documents.from_cu_seqlens(value, seq_length)
    tokens = batch.get("tokens")
    if tokens is None:
        raise KeyError(f"documents={source}: the micro-batch has no 'tokens'")
    return Documents.from_eod(tokens, source)


def gather_documents(source: DocumentSource, data, num_microbatches: int,
                     seq_length: int | Sequence[int], micro_batch_size: int, pg_collection,
                     pp_rank: int, rehearsal: bool = False) -> list[Documents]:
    """The documents of this iteration's micro-batches on every rank (module docstring).

    ``data``: this rank's :class:`~megatron_seq1f1b.segments.run.SegmentData` of its
    first model chunk (or None). ``seq_length``: every micro-batch's, or one per
    micro-batch (variable lengths, agreed before). In a rehearsal (one stage alone) the
    rank reads its own data.
    """
    import torch.distributed as dist

    lengths = (tuple(seq_length) if not isinstance(seq_length, int)
               else (seq_length,) * num_microbatches)
    tp = pg_collection.tp
    tp_rank = tp.rank() if tp is not None and not rehearsal else 0
    reader = rehearsal or (pp_rank == 0 and tp_rank == 0)
    payload: list = [None]
    if reader:
        payload[0] = _read(source, data, num_microbatches, lengths, micro_batch_size)
    if not rehearsal:
        if pp_rank == 0 and tp is not None and tp.size() > 1:
            dist.broadcast_object_list(payload, src=dist.get_global_rank(tp, 0), group=tp)
        pp = pg_collection.pp
        if pp is not None and pp.size() > 1:
            dist.broadcast_object_list(payload, src=dist.get_global_rank(pp, 0), group=pp)
    kind, value = payload[0]
    if kind == "error":
        raise ConfigError([f"the documents of this iteration's micro-batches (read on the first "
                           f"pipeline stage): {value}"])
    return [Documents(starts, n) for starts, n in zip(value, lengths)]


def _read(source, data, num_microbatches, lengths, micro_batch_size) -> tuple[str, Any]:
    """("documents", per micro-batch starts) or ("error", message): what the reader sends."""
    if data is None:
        return ("error", "the first stage's rank has no data iterator to read them from")
    try:
        batches = data.prefetch(num_microbatches)
        found = [read_documents(source, batch, n) for batch, n in zip(batches, lengths)]
    except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
        return ("error", f"{type(exc).__name__}: {exc}")
    for index, (documents, n) in enumerate(zip(found, lengths)):
        if documents.seq_length != n or documents.micro_batch_size != micro_batch_size:
            return ("error", f"micro-batch {index} has documents of {documents.micro_batch_size} "
                    f"sample(s) x {documents.seq_length} tokens; the schedule runs "
                    f"{micro_batch_size} x {n}")
    return ("documents", [documents.starts for documents in found])
