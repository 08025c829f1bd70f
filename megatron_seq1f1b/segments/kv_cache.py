"""Keys and values of earlier segments, and the gradients flowing back to them.

Segments that read earlier segments' keys form a *chain*
(:func:`megatron_seq1f1b.segments.documents.chains`): without documents all segments
of a micro-batch, with packed documents the runs of segments a document
crosses. Per (micro-batch, model chunk, attention layer, chain) one entry holds:

* ``keys`` / ``values``: one buffer of rows ``[base, end)`` of the micro-batch,
  from the chain's head's start (0 without documents) to its last segment's
  end. Each segment writes its own (post-RoPE) keys and values into its rows
  and attends over the view ``[key_start, end_j)``: from the start of the
  document crossing into it (or its window), never earlier documents. The
  views attention saves for its backward all share this one buffer, so a
  chain's keys and values exist once, not once per segment (a concatenated
  prefix per segment would cost ~(k+1)/2 times as much). Writes go through
  ``.data`` so they do not bump the version counter of views saved by earlier
  segments; they touch rows no earlier segment reads.
* the gradient later segments' attention leaves for earlier rows (half
  precision accumulates in fp32). Without a window one buffer ``prefix``
  holds rows ``[base, R)`` from the first segment that contributes (the last
  one: backward runs in reverse): each backward adds what it owes with one
  operation per tensor, and each segment takes its rows when its turn comes
  (the buffer goes with the head's backward). A per-segment share would cost a
  slice and an add per earlier segment, per layer and segment: O(k) more small
  kernels where Megatron's schedule has none. With a sliding window
  ``pending`` keeps one share per earlier segment in reach instead, so
  segments out of reach hold nothing, and a share lives only between its
  first contributor and its owner.

An attention whose backward adds key gradients itself (the CPU flash kernels of
:mod:`megatron_seq1f1b.attention.prefix`) can add them straight into ``prefix``
(:class:`GradientSink`): for every segment but the first contributor the
buffer already covers the rows it attends to, so the backward allocates no
gradient as large as its keys, and :class:`KVAppend` finds its rows summed.

A segment that reads nothing earlier and is read by nothing later needs no
entry at all. The entry is dropped when the head's backward passes through
the layer (or, forward-only, after the micro-batch's last segment); the
storage goes when the last saved view is freed. A later segment's backward
never runs through an earlier segment's graph: :class:`KVAppend` delivers
gradients through the entry.
"""

from __future__ import annotations

import weakref

import torch


class KVEntry:
    """Caches of one attention layer, one chain of one micro-batch (module docstring).

    ``starts`` / ``lengths``: the micro-batch's segments (to know who is owed
    gradient for which rows); ``windowed``: keep per-segment shares.
    """

    def __init__(self, key: torch.Tensor, value: torch.Tensor, head: int, base: int, end: int,
                 starts: tuple[int, ...], lengths: tuple[int, ...], windowed: bool = False):
        shape_k = (end - base,) + tuple(key.shape[1:])
        shape_v = (end - base,) + tuple(value.shape[1:])
        self.keys = torch.empty(shape_k, dtype=key.dtype, device=key.device)
        self.values = torch.empty(shape_v, dtype=value.dtype, device=value.device)
        # What segments write through: aliases with a version counter of their own (``.data``,
        # made once), so a write never invalidates the views earlier segments saved.
        self.writable = (self.keys.data, self.values.data)
        self.head, self.base, self.end = head, base, end
        self.starts, self.lengths, self.windowed = starts, lengths, windowed
        self.prefix: list[torch.Tensor] | None = None  # [key grads, value grads] of rows [base, R)
        self.pending: dict[int, list[torch.Tensor]] = {}  # windows: segment -> its share
        self.owed: set[int] = set()  # segments with gradient waiting for them
        self.forwarded: set[int] = set()
        self.sunk: tuple | None = None  # (segment, rows) whose attention added into prefix
        self.store_key: tuple = ()

    @staticmethod
    def _accumulation_dtype(grad: torch.Tensor) -> torch.dtype:
        return torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """A segment's rows from ``start`` on, as far as the buffer holds them."""
        skip = max(0, self.base - start)
        first, last = start + skip - self.base, start + key.shape[0] - self.base
        self.writable[0][first:last].copy_(key[skip:] if skip else key)
        self.writable[1][first:last].copy_(value[skip:] if skip else value)

    def view(self, first_row: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.keys[first_row - self.base : end - self.base],
                self.values[first_row - self.base : end - self.base])

    def accumulate(self, first_row: int, grad_keys: torch.Tensor,
                   grad_values: torch.Tensor) -> None:
        """Add gradient for rows ``[first_row, first_row + len(grad_keys))`` to their segments."""
        last_row = first_row + grad_keys.shape[0]
        self._owe(first_row, last_row)
        if not self.windowed:
            low, high = first_row - self.base, last_row - self.base
            if self.prefix is None:  # the first contributor reaches furthest: rows [base, R)
                # Its rows are the buffer's first writes: copied in (converted), not added
                # to zeros; only rows before it are zeroed.
                dtype = self._accumulation_dtype(grad_keys)
                self.prefix = [grad.new_empty((high,) + tuple(grad.shape[1:]), dtype=dtype)
                               for grad in (grad_keys, grad_values)]
                for buffer, grad in zip(self.prefix, (grad_keys, grad_values)):
                    buffer[:low].zero_()
                    buffer[low:high].copy_(grad)
                return
            self.prefix[0][low:high] += grad_keys
            self.prefix[1][low:high] += grad_values
            return
        for index, (start, length) in enumerate(zip(self.starts, self.lengths)):
            end = start + length
            low, high = max(start, first_row), min(end, last_row)
            if low < high:
                shares = self.pending.get(index)
                if shares is None:
                    dtype = self._accumulation_dtype(grad_keys)
                    shares = [grad.new_zeros((length,) + tuple(grad.shape[1:]), dtype=dtype)
                              for grad in (grad_keys, grad_values)]
                    self.pending[index] = shares
                shares[0][low - start : high - start] += grad_keys[low - first_row : high - first_row]
                shares[1][low - start : high - start] += grad_values[low - first_row : high - first_row]

    def _owe(self, first_row: int, last_row: int) -> None:
        """Segments with rows in ``[first_row, last_row)`` have gradient waiting."""
        for index, (start, length) in enumerate(zip(self.starts, self.lengths)):
            if start >= last_row:
                break
            if start + length > first_row:
                self.owed.add(index)

    def sink_rows(self, index: int, first_row: int, end: int, dtype: torch.dtype,
                  fresh_ok: bool = False):
        """Rows ``[first_row, end)`` of ``prefix`` for segment ``index``'s attention to add its
        key and value gradients into, and whether they are fresh, or ``None`` (a window,
        another accumulation dtype, rows the buffer does not hold): :class:`GradientSink`.

        The first contributor finds no buffer: it gets one made for rows ``[base, end)``,
        fresh (its attention writes them; rows before ``first_row`` zeroed) where
        ``fresh_ok``, zeroed otherwise. So no contributor allocates a key-sized gradient
        of its own, and nothing is copied from one buffer into another."""
        if self.windowed or first_row < self.base:
            return None
        fresh = False
        if self.prefix is None:
            if self.keys.dtype != dtype or self._accumulation_dtype(self.keys) != dtype:
                return None
            rows = end - self.base
            make = torch.empty if fresh_ok else torch.zeros
            self.prefix = [make((rows,) + tuple(buffer.shape[1:]), dtype=dtype,
                                device=buffer.device) for buffer in (self.keys, self.values)]
            if fresh_ok:
                for buffer in self.prefix:
                    buffer[: first_row - self.base].zero_()
            fresh = fresh_ok
        elif self.prefix[0].dtype != dtype or end - self.base > self.prefix[0].shape[0]:
            return None
        self.sunk = (index, first_row, end)
        low, high = first_row - self.base, end - self.base
        return self.prefix[0][low:high], self.prefix[1][low:high], fresh

    def take_sunk(self, index: int, start: int, first_row: int, end: int,
                  grad_keys: torch.Tensor, grad_values: torch.Tensor):
        """Segment `index`'s gradient when its attention added into ``prefix``
        (:meth:`sink_rows`): the rows ``[start, end)`` hold its own and what later segments
        left; earlier rows are owed to earlier segments. ``grad_keys`` must be those
        rows (nothing added on the way), else the sum would count them twice."""
        low, high = first_row - self.base, end - self.base
        for grad, buffer in ((grad_keys, self.prefix[0]), (grad_values, self.prefix[1])):
            if grad.data_ptr() != buffer[low:high].data_ptr() or grad.shape != buffer[low:high].shape:
                raise RuntimeError(
                    f"Seq1F1B: segment {index}'s attention added its key/value gradient into "
                    "the carry-over, but another gradient reached the keys (they feed more "
                    "than the attention); this path cannot sum them")
        self.sunk = None
        self.owed.discard(index)
        self._owe(first_row, start)
        own = start - first_row
        keys, values = grad_keys[own:], grad_values[own:]
        if index == self.head:
            self.prefix = None
        return keys, values

    def take(self, index: int, start: int, end: int, grad_keys: torch.Tensor,
             grad_values: torch.Tensor):
        """Segment `index`'s (rows ``[start, end)``) own gradient plus what later segments
        left for it (rows from ``base`` on)."""
        if index not in self.owed:
            return grad_keys, grad_values
        self.owed.discard(index)
        low = max(start, self.base)
        if self.prefix is not None:
            keys = self.prefix[0][low - self.base : end - self.base]
            values = self.prefix[1][low - self.base : end - self.base]
            if index == self.head:
                self.prefix = None
        else:
            keys, values = self.pending.pop(index)
            keys, values = keys[low - start:], values[low - start:]
        skip = low - start
        if skip == 0:
            return grad_keys + keys.to(grad_keys.dtype), grad_values + values.to(grad_values.dtype)
        return (torch.cat([grad_keys[:skip], grad_keys[skip:] + keys.to(grad_keys.dtype)]),
                torch.cat([grad_values[:skip], grad_values[skip:] + values.to(grad_values.dtype)]))


class KVStore:
    """All entries of one iteration, keyed by (micro-batch, chunk, layer, chain head)."""

    def __init__(self):
        self._entries: dict[tuple[int, int, int, int], KVEntry] = {}

    def get(self, microbatch: int, chunk: int, layer: object, head: int = 0) -> KVEntry | None:
        return self._entries.get((microbatch, chunk, id(layer), head))

    def create(self, microbatch: int, chunk: int, layer: object, key, value, *, head: int = 0,
               base: int = 0, end: int, starts: tuple[int, ...], lengths: tuple[int, ...],
               windowed: bool = False) -> KVEntry:
        entry = KVEntry(key, value, head, base, end, starts, lengths, windowed)
        entry.store_key = (microbatch, chunk, id(layer), head)
        self._entries[entry.store_key] = entry
        return entry

    def release_entry(self, entry: KVEntry) -> None:
        if self._entries.get(entry.store_key) is entry:
            del self._entries[entry.store_key]

    def release(self, microbatch: int, chunk: int) -> None:
        for key in [k for k in self._entries if k[0] == microbatch and k[1] == chunk]:
            del self._entries[key]

    def live_entries(self, microbatch: int | None = None) -> int:
        """Entries alive (for one micro-batch, or all)."""
        return sum(1 for key in self._entries if microbatch in (None, key[0]))

    def live_tensors(self) -> int:
        """Cached tensors still referenced by the store (for leak tests)."""
        count = 0
        for entry in self._entries.values():
            count += 2 + 2 * len(entry.pending) + (2 if entry.prefix is not None else 0)
        return count

    def clear(self) -> None:
        self._entries.clear()


class KVAppend(torch.autograd.Function):
    """A chain segment's keys/values ``[first_row, end)`` as views of the entry, its own
    rows written in (``write``; not when a recomputation runs the forward again)."""

    @staticmethod
    def forward(ctx, key, value, store, entry, info, write, first_row):
        if write:
            entry.write(info.start, key, value)
        # Weak: a graph that outlives the iteration (Megatron's MoE dispatcher keeps the last
        # forward's tensors) must not keep the cache objects alive.
        ctx.store, ctx.entry = weakref.ref(store), weakref.ref(entry)
        ctx.info, ctx.first_row = info, first_row
        return entry.view(first_row, info.end)

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        entry, store, info, first_row = ctx.entry(), ctx.store(), ctx.info, ctx.first_row
        if entry is None or store is None:
            raise RuntimeError(
                f"Seq1F1B: backward of micro-batch {info.microbatch}, segment {info.index} "
                "after its iteration ended (its key/value cache is gone)"
            )
        own = info.start - first_row
        if entry.sunk == (info.index, first_row, info.end):
            own_k, own_v = entry.take_sunk(info.index, info.start, first_row, info.end,
                                           grad_keys, grad_values)
            if info.index == entry.head:
                store.release_entry(entry)
            return own_k, own_v, None, None, None, None, None
        if grad_keys is None:
            grad_keys = torch.zeros((info.end - first_row,) + tuple(entry.keys.shape[1:]),
                                    dtype=entry.keys.dtype, device=entry.keys.device)
        if grad_values is None:
            grad_values = torch.zeros((info.end - first_row,) + tuple(entry.values.shape[1:]),
                                      dtype=entry.values.dtype, device=entry.values.device)
        own_k, own_v = entry.take(info.index, info.start, info.end, grad_keys[own:],
                                  grad_values[own:])
        if own > 0:
            entry.accumulate(first_row, grad_keys[:own], grad_values[:own])
        if info.index == entry.head:
            store.release_entry(entry)
        return own_k, own_v, None, None, None, None, None


class GradientSink:
    """Where a segment's attention may add its key and value gradients: the carry-over's
    rows ``[first_row, end)`` (:meth:`KVEntry.sink_rows`), if they exist yet. Handed to the
    attention on the keys :class:`KVAppend` returns (``keys.seq1f1b_grad_sink``); the
    attention calls :meth:`claim` in its backward and, given views, adds into them and
    returns them as the keys' gradient."""

    def __init__(self, entry: KVEntry, info, first_row: int):
        self._entry, self._info, self._first_row = weakref.ref(entry), info, first_row

    def claim(self, dtype: torch.dtype, fresh_ok: bool = False):
        """(key rows, value rows, fresh) to add into (or, fresh, to write), or ``None``
        (allocate as usual); ``fresh_ok``: the attention writes each row at most once."""
        entry = self._entry()
        if entry is None:
            return None
        return entry.sink_rows(self._info.index, self._first_row, self._info.end, dtype,
                               fresh_ok)
