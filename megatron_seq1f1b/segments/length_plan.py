"""Every micro-batch's length, known and agreed on every rank before an iteration runs.

With ``variable_seq_lengths=True`` (Megatron's contract for micro-batches of different
lengths) each micro-batch has its own length, and with it its own segment lengths, hence
the shapes of every message and, with a token budget per segment, the number of units
and so the schedule itself. Megatron's own schedules exchange a shape before every
message. Here the lengths are plan data instead, agreed once per iteration:

1. Every rank that has a data iterator reads this iteration's ``m`` micro-batches ahead
   (the segments get them later as usual; ranks without data read nothing) and notes each
   one's length: ``tokens`` ``[b, s]`` (or ``input_ids``), the packed ``[1, t]`` form
   included.
2. One all-gather over the tensor- and pipeline-parallel ranks of this model replica
   (``m + 5`` integers each) gives every rank every reader's lengths.
3. The first pipeline stage's lengths are the iteration's. A reader whose iterator
   ended early, whose model chunks' iterators disagree, or whose lengths differ from the
   first stage's makes every rank raise the same one line, naming the stage and the
   micro-batch, before any message is sent: no rank is left waiting on a transfer of
   the wrong shape.

One collective per iteration whatever ``m`` and ``k``; it also serves a fixed segment
count, where the schedule does not depend on the lengths but every buffer's shape does:
a header with each micro-batch's first message could not stop a stage whose data
disagrees before its neighbours block on it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_seq1f1b.base.checks import ConfigError

_OK, _SHORT, _CHUNKS_DIFFER, _UNREADABLE = 0, 1, 2, 3
_HEADER = 5  # pipeline stage, has data, status, micro-batch in question, value


def length_of(batch: Any) -> int:
    """A micro-batch's sequence length: the last dimension of its ``tokens`` (or
    ``input_ids``), ``[b, s]`` or packed ``[1, t]``."""
    if isinstance(batch, dict):
        for key in ("tokens", "input_ids"):
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                return int(value.shape[-1])
    raise ValueError(f"cannot read the length of a {type(batch).__name__} micro-batch: "
                     "variable_seq_lengths needs a dict with 'tokens' (or 'input_ids') [b, s]")


def read_lengths(data: Sequence, num_microbatches: int) -> list[int]:
    """Row of this rank: ``[stage, has data, status, micro-batch, value, lengths...]`` (the
    stage is filled in by the caller). ``data``: this rank's SegmentData per model chunk."""
    readers = [d for d in data if d is not None]
    row = [0, int(bool(readers)), _OK, -1, 0] + [0] * num_microbatches
    if not readers:
        return row
    from megatron_seq1f1b.segments.run import ShortIterator

    seen: list[int] | None = None
    for reader in readers:
        try:
            batches = reader.prefetch(num_microbatches)
        except ShortIterator as short:
            row[2:5] = [_SHORT, short.given, 0]
            return row
        lengths = []
        for index, batch in enumerate(batches):
            try:
                lengths.append(length_of(batch))
            except ValueError:
                row[2:5] = [_UNREADABLE, index, 0]
                return row
        if seen is not None and lengths != seen:
            index = next(i for i, (a, b) in enumerate(zip(lengths, seen)) if a != b)
            row[2:5] = [_CHUNKS_DIFFER, index, lengths[index]]
            return row
        seen = lengths
    row[5:] = seen
    return row


def agree_on_lengths(rows: Sequence[Sequence[int]], num_microbatches: int) -> tuple[int, ...]:
    """The iteration's lengths from every reader's row, or the one line every rank raises."""
    for row in rows:
        stage, _, status, index, value = row[:_HEADER]
        where = f"pipeline stage {stage}"
        if status == _SHORT:
            _fail(f"{where}'s data iterator ended after {index} micro-batch(es); the iteration "
                  f"has {num_microbatches} (micro-batch {index} is missing there)")
        if status == _UNREADABLE:
            _fail(f"micro-batch {index} on {where}: its length cannot be read (variable_seq_"
                  "lengths needs a dict micro-batch with 'tokens' or 'input_ids' [b, s])")
        if status == _CHUNKS_DIFFER:
            _fail(f"micro-batch {index} on {where}: its model chunks' data iterators give "
                  f"different lengths ({value} tokens on one)")
    first = [row for row in rows if row[0] == 0 and row[1]]
    if not first:
        _fail("no rank of the first pipeline stage has a data iterator: variable_seq_lengths "
              "reads every micro-batch's length there")
    lengths = tuple(first[0][_HEADER:])
    for row in rows:
        if row[1] and tuple(row[_HEADER:]) != lengths:
            index = next(i for i, (a, b) in enumerate(zip(row[_HEADER:], lengths)) if a != b)
            _fail(f"micro-batch {index} has {row[_HEADER + index]} tokens on pipeline stage "
                  f"{row[0]} but {lengths[index]} on stage 0: every stage's data iterator must "
                  "give the same micro-batches")
    return lengths


def gather_lengths(data: Sequence, num_microbatches: int, group, pp_rank: int,
                   device: torch.device) -> tuple[int, ...]:
    """This iteration's micro-batch lengths on every rank of ``group`` (module docstring);
    ``group`` None: this rank alone (pipeline size 1, or a stage rehearsed alone)."""
    mine = read_lengths(data, num_microbatches)
    alone = group is None or group.size() == 1
    mine[0] = 0 if alone else pp_rank  # alone, this rank stands for the first stage
    if alone:
        rows = [mine]
    else:
        import torch.distributed as dist

        local = torch.tensor(mine, dtype=torch.int64, device=device)
        gathered = torch.empty(group.size() * len(mine), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(gathered, local, group=group)
        rows = gathered.view(group.size(), len(mine)).tolist()
    return agree_on_lengths(rows, num_microbatches)


def _fail(message: str) -> None:
    raise ConfigError([f"variable-length micro-batches: {message}"])
