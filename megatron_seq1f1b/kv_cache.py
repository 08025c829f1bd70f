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
* ``key_grads`` / ``value_grads``: allocated at the micro-batch's first
  backward; each segment's backward adds the gradient of the prefix rows it
  attended to, and each segment takes its own rows when its turn comes
  (half precision accumulates in fp32).

The entry is dropped when segment 0's backward passes through the layer (or,
forward-only, after the last segment); the storage goes when the last saved
view is freed. A later segment's backward never runs through an earlier
segment's graph: :class:`KVAppend` delivers gradients through the entry.
"""

from __future__ import annotations

import torch


class KVEntry:
    """Caches of one attention layer for one micro-batch (see module docstring)."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, seq_length: int):
        shape_k = (seq_length,) + tuple(key.shape[1:])
        shape_v = (seq_length,) + tuple(value.shape[1:])
        self.keys = torch.empty(shape_k, dtype=key.dtype, device=key.device)
        self.values = torch.empty(shape_v, dtype=value.dtype, device=value.device)
        self.key_grads: torch.Tensor | None = None
        self.value_grads: torch.Tensor | None = None
        self.forwarded: set[int] = set()
        self.store_key: tuple = ()

    def accumulate(self, grad_keys: torch.Tensor, grad_values: torch.Tensor) -> None:
        """Add gradient for prefix rows ``[0, len(grad_keys))``."""
        rows = grad_keys.shape[0]
        if self.key_grads is None:
            dtype = torch.float32 if grad_keys.dtype in (torch.float16, torch.bfloat16) else None
            self.key_grads = torch.zeros(
                (rows,) + tuple(grad_keys.shape[1:]), dtype=dtype or grad_keys.dtype,
                device=grad_keys.device,
            )
            self.value_grads = torch.zeros(
                (rows,) + tuple(grad_values.shape[1:]), dtype=dtype or grad_values.dtype,
                device=grad_values.device,
            )
        self.key_grads[:rows] += grad_keys
        self.value_grads[:rows] += grad_values

    def take(self, start: int, end: int, grad_keys: torch.Tensor, grad_values: torch.Tensor):
        """This segment's own gradient plus what later segments left for it."""
        if self.key_grads is not None and start < self.key_grads.shape[0]:
            grad_keys = grad_keys + self.key_grads[start:end].to(grad_keys.dtype)
            grad_values = grad_values + self.value_grads[start:end].to(grad_values.dtype)
        return grad_keys, grad_values


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
            count += 2 + (entry.key_grads is not None) + (entry.value_grads is not None)
        return count

    def clear(self) -> None:
        self._entries.clear()


class KVAppend(torch.autograd.Function):
    """[earlier segments' K/V ; this segment's K/V] as views of the entry's buffers."""

    @staticmethod
    def forward(ctx, key, value, store, entry, info, write):
        if write:
            entry.keys.data[info.start : info.end].copy_(key)
            entry.values.data[info.start : info.end].copy_(value)
        ctx.store, ctx.entry, ctx.info = store, entry, info
        return entry.keys[: info.end], entry.values[: info.end]

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        entry, info = ctx.entry, ctx.info
        start, end = info.start, info.end
        if grad_keys is None:
            grad_keys = torch.zeros_like(entry.keys[:end])
        if grad_values is None:
            grad_values = torch.zeros_like(entry.values[:end])
        own_k, own_v = entry.take(start, end, grad_keys[start:end], grad_values[start:end])
        if start > 0:
            entry.accumulate(grad_keys[:start], grad_values[:start])
        else:
            ctx.store.release_entry(entry)
        ctx.store = ctx.entry = None
        return own_k, own_v, None, None, None, None
