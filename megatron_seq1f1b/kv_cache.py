"""Keys and values of earlier segments, and the gradients flowing back to them.

Per (micro-batch, model chunk, attention layer) one entry holds:

* ``keys`` / ``values``: one buffer of the whole sequence, ``[S, b, g, d]``.
  Segment j writes its own (post-RoPE) keys and values into rows
  ``[start_j, end_j)`` and attends over the view ``[0, end_j)``. The views
  that attention saves for its backward all share this one buffer, so a
  micro-batch's keys and values exist once, not once per segment (keeping a
  concatenated prefix per segment would cost ~(k+1)/2 times as much). Writes
  go through ``.data`` so they do not bump the version counter of views saved
  by earlier segments; they touch rows no earlier segment reads.
* the gradient later segments' attention leaves for earlier rows (half
  precision accumulates in fp32). Without a window one buffer ``prefix``
  holds rows ``[0, start)`` of the first segment that contributes (the last
  one, backward runs in reverse): each backward adds what it owes with one
  operation per tensor, and each segment takes its rows when its turn comes
  (the buffer goes with segment 0's backward). A per-segment share would cost
  a slice and an add per earlier segment, per layer and segment: O(k) more
  small kernels where Megatron's schedule has none. With a sliding window
  ``pending`` keeps one share per earlier segment in reach instead, so
  segments out of reach hold nothing, and a share lives only between its
  first contributor and its owner.

With a sliding window of ``w`` keys (``window_size=(w, 0)``), segment j
attends to rows ``[max(0, start_j - w), end_j)`` only: its attention never
sees, and its backward never owes gradient to, rows older than the window.
The rows themselves stay until their own segment's backward (which needs
them); what the window saves is attention over the prefix (the local
backend's score and probability matrices are ``L x (L + w)``, not
``L x end``) and the pending gradient of segments out of reach.

The entry is dropped when segment 0's backward passes through the layer (or,
forward-only, after the last segment); the storage goes when the last saved
view is freed. A later segment's backward never runs through an earlier
segment's graph: :class:`KVAppend` delivers gradients through the entry.
"""

from __future__ import annotations

import weakref

import torch


class KVEntry:
    """Caches of one attention layer for one micro-batch (see module docstring)."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, seq_length: int):
        shape_k = (seq_length,) + tuple(key.shape[1:])
        shape_v = (seq_length,) + tuple(value.shape[1:])
        self.keys = torch.empty(shape_k, dtype=key.dtype, device=key.device)
        self.values = torch.empty(shape_v, dtype=value.dtype, device=value.device)
        # What segments write through: aliases with a version counter of their own (``.data``,
        # made once), so a write never invalidates the views earlier segments saved.
        self.writable = (self.keys.data, self.values.data)
        self.prefix: list[torch.Tensor] | None = None  # [key grads, value grads] of rows [0, R)
        self.pending: dict[int, list[torch.Tensor]] = {}  # windows: segment -> its share
        self.owed: set[int] = set()  # segments with gradient waiting for them
        self.forwarded: set[int] = set()
        self.store_key: tuple = ()

    @staticmethod
    def _accumulation_dtype(grad: torch.Tensor) -> torch.dtype:
        return torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype

    def accumulate(self, first_row: int, grad_keys: torch.Tensor, grad_values: torch.Tensor,
                   lengths: tuple[int, ...]) -> None:
        """Add gradient for rows ``[first_row, first_row + len(grad_keys))`` to their segments."""
        last_row = first_row + grad_keys.shape[0]
        start = 0
        for index, length in enumerate(lengths):  # plain integers: who is owed something
            if start >= last_row:
                break
            if start + length > first_row:
                self.owed.add(index)
            start += length
        if self.prefix is not None or (first_row == 0 and not self.pending):
            if self.prefix is None:  # the first contributor reaches furthest: rows [0, R)
                dtype = self._accumulation_dtype(grad_keys)
                self.prefix = [grad.new_zeros((last_row,) + tuple(grad.shape[1:]), dtype=dtype)
                               for grad in (grad_keys, grad_values)]
            self.prefix[0][first_row:last_row] += grad_keys
            self.prefix[1][first_row:last_row] += grad_values
            return
        start = 0
        for index, length in enumerate(lengths):
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
            start = end

    def take(self, index: int, start: int, end: int, grad_keys: torch.Tensor,
             grad_values: torch.Tensor):
        """Segment `index`'s (rows ``[start, end)``) own gradient plus what later segments
        left for it."""
        if index not in self.owed:
            return grad_keys, grad_values
        self.owed.discard(index)
        if self.prefix is not None:
            keys, values = self.prefix[0][start:end], self.prefix[1][start:end]
            if index == 0:
                self.prefix = None
        else:
            keys, values = self.pending.pop(index)
        return grad_keys + keys.to(grad_keys.dtype), grad_values + values.to(grad_values.dtype)


class KVStore:
    """All entries of one iteration, keyed by (micro-batch, chunk, layer)."""

    def __init__(self):
        self._entries: dict[tuple[int, int, int], KVEntry] = {}

    def get(self, microbatch: int, chunk: int, layer: object) -> KVEntry | None:
        return self._entries.get((microbatch, chunk, id(layer)))

    def create(self, microbatch: int, chunk: int, layer: object, key, value, seq_length: int):
        entry = KVEntry(key, value, seq_length)
        entry.store_key = (microbatch, chunk, id(layer))
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
    """[earlier segments' K/V within reach ; this segment's K/V] as views of the entry's buffers.

    Rows ``[first_row, end)`` of the micro-batch: ``first_row`` is 0 without a
    window, ``max(0, start - w)`` with a window of ``w`` keys.
    """

    @staticmethod
    def forward(ctx, key, value, store, entry, info, write, first_row=0):
        if write:
            entry.writable[0][info.start : info.end].copy_(key)
            entry.writable[1][info.start : info.end].copy_(value)
        # Weak: a graph that outlives the iteration (Megatron's MoE dispatcher keeps the last
        # forward's tensors) must not keep the cache objects alive.
        ctx.store, ctx.entry = weakref.ref(store), weakref.ref(entry)
        ctx.info, ctx.first_row = info, first_row
        return entry.keys[first_row : info.end], entry.values[first_row : info.end]

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        entry, store, info, first_row = ctx.entry(), ctx.store(), ctx.info, ctx.first_row
        if entry is None or store is None:
            raise RuntimeError(
                f"Seq1F1B: backward of micro-batch {info.microbatch}, segment {info.index} "
                "after its iteration ended (its key/value cache is gone)"
            )
        own = info.start - first_row
        if grad_keys is None:
            grad_keys = torch.zeros_like(entry.keys[first_row : info.end])
        if grad_values is None:
            grad_values = torch.zeros_like(entry.values[first_row : info.end])
        own_k, own_v = entry.take(info.index, info.start, info.end, grad_keys[own:],
                                  grad_values[own:])
        if own > 0:
            entry.accumulate(first_row, grad_keys[:own], grad_values[:own], info.lengths)
        if info.index == 0:
            store.release_entry(entry)
        return own_k, own_v, None, None, None, None, None
