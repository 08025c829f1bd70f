"""Which segment is running: SegmentInfo, the active-segment context, batch slicing.

The schedule (or a test driving segments by hand) opens a :class:`SegmentRun`
per iteration and runs every forward and backward of a unit inside
``run.forward(mb, seg)`` / ``run.backward(mb, seg)``. Inside, model hooks and
the user's ``forward_step_func`` see :func:`current_segment`. The active
context exists only inside those ``with`` blocks; the run (and its key/value
caches) dies with the iteration.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from megatron_seq1f1b.base.checks import raise_if, segment_length_problems
from megatron_seq1f1b.segments.documents import (
    Chain, Documents, SegmentView, chains, rank_ranges, roles, views_of,
)
from megatron_seq1f1b.segments.kv_cache import KVStore
from megatron_seq1f1b.segments.packed import Packed, on_device
from megatron_seq1f1b.segments.active import (  # noqa: F401 - the running unit, named here too
    BACKWARD, FORWARD, Active as _Active, active, current_segment, entered,
)
from megatron_seq1f1b.segments.state_carry import StateCarry


@dataclass(frozen=True)
class SegmentInfo:
    """Segment `index` of micro-batch `microbatch`: tokens ``[start, end)``."""

    microbatch: int
    index: int
    num_splits: int
    start: int
    end: int
    lengths: tuple[int, ...]
    chunk: int = 0

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def is_last(self) -> bool:
        return self.index == self.num_splits - 1


@dataclass(frozen=True)
class Geometry:
    """One micro-batch's segments for layers of one window: what each sees, and the chains.

    ``views`` are whole segments (their keys, the chains); ``queries`` what this rank's
    queries of each see (a context-parallel rank's chunks; the views without CP).
    """

    views: tuple[SegmentView, ...]
    chains: tuple[Chain, ...]
    roles: tuple[tuple[str, int], ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    queries: tuple[SegmentView, ...] = ()


def _starts(lengths: Sequence[int]) -> tuple[int, ...]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return tuple(out)


class SegmentRun:
    """One iteration's segmented computation: segment geometry and K/V caches.

    ``forward(mb, seg)`` and ``backward(mb, seg)`` are context managers in which
    one unit runs. Recomputation (activation checkpointing) re-runs forwards
    inside ``backward``; the model hooks see phase ``"backward"`` and neither
    write caches again nor count a second forward.
    """

    def __init__(self, lengths: Sequence[int] | None, *, forward_only: bool = False, config=None,
                 documents: Sequence[Documents | None] | None = None,
                 microbatch_lengths: Sequence[Sequence[int]] | None = None,
                 cp_group=None, cp_meter=None):
        # Per micro-batch (plan data, the same on every rank): its documents, and its own
        # segment lengths where they differ between micro-batches (``documents`` partition,
        # variable-length micro-batches: then ``lengths`` may be None).
        self.documents = tuple(documents) if documents is not None else None
        self.microbatch_lengths = (tuple(tuple(int(n) for n in row) for row in microbatch_lengths)
                                   if microbatch_lengths is not None else None)
        if lengths is None:
            if not self.microbatch_lengths:
                raise_if(["SegmentRun needs segment lengths, or one row per micro-batch"])
            lengths = self.microbatch_lengths[0]
        raise_if(segment_length_problems(lengths, config=config))
        self.lengths = tuple(int(n) for n in lengths)
        self.starts = _starts(self.lengths)
        self.forward_only = forward_only
        self.kv = KVStore()
        self.states = StateCarry()  # recurrent layers' states across cuts
        # Per micro-batch, the segment whose backward is its last (None: segment 0); set where a
        # micro-batch's runs of documents go backward apart (segments/document_runs.py).
        self.last_backward: Sequence[int] | None = None
        if self.microbatch_lengths is not None:
            for index, row in enumerate(self.microbatch_lengths):
                known = self.documents_of(index) if self.documents is not None else None
                raise_if(segment_length_problems(
                    row, known.seq_length if known is not None else None, config))
        self._many = self.microbatch_lengths is not None and any(
            len(row) > 1 for row in self.microbatch_lengths)
        self._masks: dict = {}
        self._views: dict = {}
        self._packed: dict = {}
        # multi-token prediction's rolled columns, (micro-batch, chunk, name) -> rolls: kept
        # from a micro-batch's first forward to its last backward (a recompute rolls again)
        self.mtp_rolls: dict = {}
        # Context parallelism: this rank holds two chunks of every segment
        # (:mod:`megatron_seq1f1b.attention.context_parallel`); ``cp_meter`` counts the bytes exchanged.
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        self.cp_rank = self.cp_group.rank() if self.cp_group is not None else 0
        self.cp_meter = cp_meter

    @property
    def segmented(self) -> bool:
        """Whether attention must treat even one segment as such (documents, or CP)."""
        return (self.num_splits > 1 or self._many or self.documents is not None
                or self.cp_size > 1)

    def rank_ranges(self, info: SegmentInfo) -> tuple[tuple[int, int], ...]:
        """The positions of the segment this rank holds (all of it without CP)."""
        return rank_ranges(info.start, info.end, self.cp_size, self.cp_rank)

    @property
    def num_splits(self) -> int:
        return len(self.lengths)

    def lengths_of(self, microbatch: int) -> tuple[int, ...]:
        """The segment lengths of one micro-batch."""
        if self.microbatch_lengths is None:
            return self.lengths
        return self.microbatch_lengths[microbatch]

    def documents_of(self, microbatch: int) -> Documents | None:
        if self.documents is None:
            return None
        return self.documents[microbatch]

    def info(self, microbatch: int, segment: int, chunk: int = 0) -> SegmentInfo:
        if self.microbatch_lengths is None:
            lengths = self.lengths
            if not 0 <= segment < len(lengths):
                raise IndexError(f"segment {segment} outside 0..{len(lengths) - 1}")
            start = self.starts[segment]
        else:
            lengths = self.microbatch_lengths[microbatch]
            if not 0 <= segment < len(lengths):
                raise IndexError(f"segment {segment} outside 0..{len(lengths) - 1} of "
                                 f"micro-batch {microbatch}")
            start = sum(lengths[:segment])
        return SegmentInfo(microbatch, segment, len(lengths), start, start + lengths[segment],
                           lengths, chunk)

    def geometry(self, microbatch: int, window: int | None) -> Geometry:
        """Views, chains and roles of one micro-batch's segments for layers with ``window``."""
        key = (microbatch, window)
        found = self._views.get(key)
        if found is None:
            lengths = self.lengths_of(microbatch)
            documents, starts = self.documents_of(microbatch), _starts(lengths)
            views = views_of(starts, lengths, documents, window)
            mine = views if self.cp_size == 1 else views_of(
                starts, lengths, documents, window,
                lambda start, end: rank_ranges(start, end, self.cp_size, self.cp_rank))
            linked = chains(views)
            found = Geometry(views, linked, roles(views, linked), starts, lengths, mine)
            self._views[key] = found
        return found

    def _enter(self, info: SegmentInfo, phase: str):
        return entered(info, phase, self)

    @contextlib.contextmanager
    def forward(self, microbatch: int, segment: int, chunk: int = 0) -> Iterator[SegmentInfo]:
        info = self.info(microbatch, segment, chunk)
        with self._enter(info, FORWARD):
            yield info
        if self.forward_only and info.is_last:
            self.kv.release(microbatch, chunk)
            self.states.release(microbatch, chunk)
            self.forget(microbatch)

    @contextlib.contextmanager
    def backward(self, microbatch: int, segment: int, chunk: int = 0) -> Iterator[SegmentInfo]:
        info = self.info(microbatch, segment, chunk)
        with self._enter(info, BACKWARD):
            yield info
        self.states.release(microbatch, chunk, consumer=segment)
        if segment == (0 if self.last_backward is None else self.last_backward[microbatch]):
            # Normally already released layer by layer inside the backward pass.
            self.kv.release(microbatch, chunk)
            self.states.release(microbatch, chunk)
            if chunk == 0:  # a micro-batch's chunks share its masks; chunk 0 goes back last
                self.forget(microbatch)

    def local_mask(self, info: SegmentInfo, view: SegmentView, device,
                   key_start: int | None = None) -> torch.Tensor:
        """Boolean mask of queries x keys ``[key_start, end)``, True = masked (local attention).

        Without documents ``[1, 1, L, keys]``: query i sees keys ``<= start + i``
        (and, with a window of w keys, ``>= start + i - w``). With documents
        ``[b, 1, L, keys]``: the keys of its own document only. The queries are
        ``view``'s (a context-parallel rank's chunks), the keys from ``key_start``
        (default the view's).
        """
        key_start = view.key_start if key_start is None else key_start
        key = (self._owner(info), info.start, info.end, key_start, view.window, device,
               view.num_queries)
        mask = self._masks.get(key)
        if mask is None:
            keys = torch.arange(key_start, info.end, device=device)
            if view.pieces is None:
                queries = torch.arange(info.start, info.end, device=device).unsqueeze(1)
                mask = keys > queries
                if view.window is not None:
                    mask |= keys < queries - view.window
                mask = mask.view(1, 1, info.length, len(keys))
            else:
                rows = []
                for sample in view.pieces:  # made on the device: no copy from the host
                    queries = torch.cat([torch.arange(piece.q0, piece.q1, device=device)
                                         for piece in sample]).unsqueeze(1)
                    lowest = torch.cat([torch.full((piece.queries,), piece.doc, device=device)
                                        for piece in sample]).unsqueeze(1)
                    if view.window is not None:
                        lowest = torch.maximum(lowest, queries - view.window)
                    rows.append((keys > queries) | (keys < lowest))
                mask = torch.stack(rows).unsqueeze(1)
            self._masks[key] = mask
        return mask

    def _owner(self, info: SegmentInfo) -> int | None:
        """Whose a segment's masks are: its micro-batch's where they differ between
        micro-batches (documents; lengths of their own, whose shapes rarely repeat), dropped
        with it (:meth:`forget`); else None, shared by all of them until :meth:`close`."""
        own = (self.microbatch_lengths is not None
               or self.documents_of(info.microbatch) is not None)
        return info.microbatch if own else None

    def shared_mask(self, info: SegmentInfo, key: tuple,
                    make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A mask that depends on ``key`` alone (a segment's shape, a window), made once and
        shared by the layers (autograd keeps one, not one per layer) and, where segments
        repeat their shapes, by the micro-batches (:meth:`_owner`)."""
        full = (self._owner(info), "shared") + key
        mask = self._masks.get(full)
        if mask is None:
            mask = self._masks[full] = make()
        return mask

    def packed(self, info: SegmentInfo, view: SegmentView, device,
               key_start: int | None = None) -> Packed:
        """The segment as variable-length (THD) attention sees it, its index tensors on
        ``device`` (made once per segment and window, shared by its layers)."""
        key = (info.microbatch, info.index, view.window, device)
        found = self._packed.get(key)
        if found is None:
            samples = len(view.pieces) if view.pieces is not None else 1
            documents = self.documents_of(info.microbatch)
            if documents is not None:
                samples = documents.micro_batch_size
            found = Packed.of(view, samples, device, key_start)
            self._packed[key] = found
        return found

    def document_rows(self, info: SegmentInfo) -> tuple[list[int], int]:
        """Each token's position within its document (one sample), and one more than the
        largest: the rows of a packed segment's rotary table (cached per segment)."""
        key = (info.microbatch, "positions", info.index)
        found = self._packed.get(key)
        if found is None:
            positions = self.documents_of(info.microbatch).positions(0, info.start, info.end)
            found = self._packed[key] = (positions, max(positions) + 1)
        return found

    def document_positions(self, info: SegmentInfo, device) -> torch.Tensor:
        """:meth:`document_rows`' positions on ``device``, copied there once per segment and
        device without a host sync."""
        key = (info.microbatch, "positions", info.index, device)
        found = self._packed.get(key)
        if found is None:
            found = self._packed[key] = on_device(self.document_rows(info)[0], torch.long,
                                                  device)
        return found

    def packed_fields(self, info: SegmentInfo, batch: dict) -> dict:
        """A packed (THD) batch's ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen``
        for this segment (see :func:`slice_batch`), shaped and placed as given."""
        documents = self.documents_of(info.microbatch)
        if documents is None:
            raise ValueError(
                "slice_batch: a packed batch (cu_seqlens) in a segment, but the schedule was not "
                "given its documents; pass documents='cu_seqlens' to get_forward_backward_func")
        if documents.micro_batch_size != 1:
            raise ValueError("slice_batch: packed (THD) batches hold one sample per micro-batch")
        (pieces,) = documents.view(info.start, info.end).sample_pieces(1)
        lengths = [piece.queries for piece in pieces]
        out = {}
        for key in _PACKED_KEYS:
            value = batch.get(key)
            if value is None:
                continue
            if key == "max_seqlen":
                out[key] = (torch.full_like(value, max(lengths)) if isinstance(value, torch.Tensor)
                            else max(lengths))
                continue
            cache_key = (info.microbatch, key, info.index, value.device, value.dim())
            cut = self._packed.get(cache_key)
            if cut is None:
                cumulative = [0]
                for n in lengths:
                    cumulative.append(cumulative[-1] + n)
                cut = on_device(cumulative, value.dtype, value.device)  # no host sync
                cut = cut.view(1, -1) if value.dim() == 2 else cut
                self._packed[cache_key] = cut
            out[key] = cut
        return out

    def forget(self, microbatch: int) -> None:
        """Drop a finished micro-batch's masks, index tensors and rolled MTP columns."""
        for cache in (self._masks, self._packed, self.mtp_rolls):
            for key in [k for k in cache if k[0] == microbatch]:
                del cache[key]
        for key in [k for k in self._views if k[0] == microbatch]:
            del self._views[key]

    def close(self) -> None:
        """End of iteration: caches must be empty (every micro-batch finished)."""
        leftover = self.kv.live_entries() + self.states.live()
        self.kv.clear()
        self.states.clear()
        self._masks.clear()
        self._views.clear()
        self._packed.clear()
        self.mtp_rolls.clear()
        if leftover:
            raise RuntimeError(
                f"Seq1F1B: key/value caches or recurrent states of {leftover} layer(s) were still "
                "alive at the end "
                "of the iteration; a micro-batch's last backward (segment 0, or its last run's "
                "first segment) never ran"
            )


class SegmentData:
    """Iterator wrapper: every segment of a micro-batch gets that micro-batch.

    The caller's iterator advances once per micro-batch, on the first
    ``next()`` inside that micro-batch's segments (or, read ahead as plan data by
    :meth:`prefetch`, on its first segment's); the executor drops the batch after
    the micro-batch's last segment. With a ``device`` (CUDA), a
    micro-batch that is a dict of host tensors is moved there once, from
    pinned memory without blocking the host, so its segments are views of one
    device copy: a ``get_batch`` that copies to the device (``.cuda()``,
    ``.to(device)``) then copies nothing per segment, and the host never waits
    for the device to catch up before a segment.
    """

    def __init__(self, iterator, device: torch.device | None = None):
        self._iterator = iterator
        self._batches: dict[int, Any] = {}
        self._prefetched: dict[int, Any] = {}  # read ahead, on the host until first needed
        self._fetched = 0
        self._device = device
        self._read: list | None = None  # what prefetch read, host side

    def __iter__(self):
        return self

    def __next__(self):
        info = current_segment()
        if info is None:
            return next(self._iterator)
        mb = info.microbatch
        if mb not in self._batches and mb in self._prefetched:
            self._batches[mb] = to_device(self._prefetched.pop(mb), self._device)
        if mb not in self._batches:
            if mb != self._fetched:
                raise RuntimeError(
                    f"Seq1F1B: data for micro-batch {mb} requested before micro-batch "
                    f"{self._fetched}; call next(data_iterator) in every forward step"
                )
            self._batches[mb] = to_device(next(self._iterator), self._device)
            self._fetched += 1
        return self._batches[mb]

    def release(self, microbatch: int) -> None:
        self._batches.pop(microbatch, None)
        self._prefetched.pop(microbatch, None)

    def prefetch(self, count: int) -> list:
        """Read the next ``count`` micro-batches now (their lengths and documents are plan
        data); the segments get them later, as from :meth:`__next__`, each moved to the
        device when its first segment asks (not all ``count`` at once). Returns them as read
        (host); a second call in the same iteration returns the same list. An iterator that
        ends early raises :class:`ShortIterator` saying how many it gave."""
        if self._read is not None:
            if len(self._read) != count:
                raise RuntimeError("Seq1F1B: micro-batches prefetched twice with different "
                                   "counts")
            return self._read
        if self._fetched or self._batches or self._prefetched:
            raise RuntimeError("Seq1F1B: micro-batches prefetched after the iteration began")
        read = []
        for microbatch in range(count):
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise ShortIterator(microbatch) from None
            read.append(batch)
            self._prefetched[microbatch] = batch
        self._fetched = count
        self._read = read
        return read


class ShortIterator(RuntimeError):
    """A data iterator ended before the iteration's micro-batches: ``given`` of them."""

    def __init__(self, given: int):
        super().__init__(f"the data iterator ended after {given} micro-batch(es)")
        self.given = given


def to_device(batch: Any, device: torch.device | None) -> Any:
    """A dict's host tensors on ``device`` (pinned, non-blocking copies); anything else as is."""
    if device is None or device.type != "cuda" or not isinstance(batch, dict):
        return batch
    moved = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            if not value.is_pinned():
                value = value.pin_memory()
            value = value.to(device, non_blocking=True)
        moved[key] = value
    return moved


_SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "input_ids")
_PACKED_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def slice_batch(batch: dict, extra_keys: Sequence[str] = ()) -> dict:
    """This segment's part of a micro-batch (identity outside a segmented step).

    ``[b, s]`` entries (tokens, labels, loss_mask, position_ids, input_ids, and the
    ``extra_keys`` a loss needs, e.g. per-token weights or advantages) are
    cut to ``[:, start:end]``; a ``[b, 1, s, s]`` attention mask to rows
    ``start:end`` and columns ``0:end``. With context parallelism, to this
    rank's two chunks of the segment (:mod:`megatron_seq1f1b.attention.context_parallel`). Slices are contiguous copies (loss
    functions call ``.view(-1)``; fused kernels want dense masks). A packed
    (THD) batch's ``cu_seqlens`` (and ``cu_seqlens_padded``) become the
    segment's own document pieces and ``max_seqlen`` the longest of them, in
    the form they came in (for Megatron's ``PackedSeqParams``: positions
    restart per document, the part of a document that crossed from earlier
    segments continues where it was; the attention adds the keys before the
    segment). Other entries, and None, stay as they are.
    """
    active_now = active()
    if active_now is None or batch is None:
        return batch
    info, run = active_now.info, active_now.run
    seq = sum(info.lengths)
    active_now.batch = batch
    out = dict(batch)
    if any(batch.get(key) is not None for key in _PACKED_KEYS):
        if run.cp_size > 1:
            raise ValueError("slice_batch: packed (THD) batches with context parallelism are "
                             "not supported; give documents by end-of-document tokens")
        out.update(run.packed_fields(info, batch))
    # This rank's positions of the segment: all of it, or a context-parallel rank's chunks.
    ranges = run.rank_ranges(info)

    def cut(value, dim):
        if len(ranges) == 1:
            return value.narrow(dim, info.start, info.length).contiguous()
        return torch.cat([value.narrow(dim, a, b - a) for a, b in ranges], dim=dim)

    for key in _SEQUENCE_KEYS + tuple(extra_keys):
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            if value.dim() < 2 or value.shape[-1] != seq:
                raise ValueError(
                    f"slice_batch: {key!r} has shape {tuple(value.shape)}, expected [..., {seq}] "
                    "(the full micro-batch sequence)"
                )
            out[key] = cut(value, value.dim() - 1)
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        if mask.dim() != 4 or mask.shape[-1] != seq or mask.shape[-2] != seq:
            raise ValueError(
                f"slice_batch: attention_mask has shape {tuple(mask.shape)}, expected "
                f"[b, 1, {seq}, {seq}]"
            )
        out["attention_mask"] = cut(mask[..., : info.end], 2)
    return out
