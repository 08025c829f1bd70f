"""One segment packed as THD: queries and keys of its document pieces along one token dimension.

A segment with documents is many small causal attentions, one per document piece (queries
``[q0, q1)`` over keys ``[k0, q1)``, aligned bottom-right). Transformer Engine and PyTorch's
variable-length flash kernel take them as one THD batch cut by cumulative lengths
(``cu_seqlens_q``, ``cu_seqlens_kv``). :class:`Packed` is that cut, made once per segment and
window and shared by the segment's layers: with micro-batch size 1 queries and keys are views
(the K/V buffer's rows ``[key_start, end)`` are exactly the pieces' keys); with more samples,
or overlapping keys under context parallelism, they are gathered by one index.

The cuts are kept twice, from the plan: as host integers (``cu_q``, ``max_q``, ...: the
per-piece path slices by them) and as device tensors (``cu_q_tensor``, ...: the kernel's
arguments), so no layer reads a device tensor back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_seq1f1b.segments.documents import SegmentView


def on_device(values: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """``values`` as a tensor on ``device``. To CUDA from pinned memory without blocking: a
    copy from pageable memory waits for the stream, a host sync at every segment's first
    layer; the pinned block stays reserved until the copy ran (the caching host allocator)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _cumulative(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass(frozen=True)
class Packed:
    """One segment packed as THD (see the module docstring)."""

    micro_batch_size: int
    length: int  # queries per sample
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    max_q: int
    max_k: int
    cu_q_tensor: torch.Tensor
    cu_k_tensor: torch.Tensor
    key_index: torch.Tensor | None  # rows of the [keys * b] K/V to gather (b > 1, CP)

    @classmethod
    def of(cls, view: SegmentView, micro_batch_size: int, device,
           key_start: int | None = None) -> "Packed":
        """``view``'s pieces over keys given from row ``key_start`` (default the view's)."""
        key_start = view.key_start if key_start is None else key_start
        pieces = view.sample_pieces(micro_batch_size)
        q_lengths = [p.queries for sample in pieces for p in sample]
        k_lengths = [p.keys for sample in pieces for p in sample]
        cu_q, cu_k = _cumulative(q_lengths), _cumulative(k_lengths)
        (first, *rest), key_index = pieces[0], None
        contiguous = (micro_batch_size == 1 and first.k0 == key_start
                      and pieces[0][-1].q1 == view.end
                      and all(piece.k0 == before.q1 for before, piece in zip(pieces[0], rest)))
        if not contiguous:  # several samples, or pieces whose keys overlap (context parallel)
            rows = [(row - key_start) * micro_batch_size + sample
                    for sample, own in enumerate(pieces) for piece in own
                    for row in range(piece.k0, piece.q1)]
            key_index = on_device(rows, torch.long, device)
        return cls(micro_batch_size, view.num_queries, tuple(cu_q), tuple(cu_k), max(q_lengths),
                   max(k_lengths), on_device(cu_q, torch.int32, device),
                   on_device(cu_k, torch.int32, device), key_index)

    def pack(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """``[L, b, h, d]`` queries and ``[keys, b, g, d]`` K/V -> ``[T, h, d]`` THD tensors."""
        if query.shape[1] != self.micro_batch_size:  # shapes only: no wrong rows, silently
            raise ValueError(f"Seq1F1B: a segment packed for {self.micro_batch_size} sample(s) "
                             f"got queries of {query.shape[1]}")
        if self.key_index is None:
            return query[:, 0], key[:, 0], value[:, 0]
        q = query[:, 0] if self.micro_batch_size == 1 else \
            query.transpose(0, 1).reshape(-1, *query.shape[2:])
        k = key.reshape(-1, *key.shape[2:]).index_select(0, self.key_index)
        v = value.reshape(-1, *value.shape[2:]).index_select(0, self.key_index)
        return q, k, v

    def unpack(self, output: torch.Tensor) -> torch.Tensor:
        """``[T, h * d]`` (or ``[T, h, d]``) -> ``[L, b, h * d]``."""
        output = output.reshape(output.shape[0], -1)
        if self.micro_batch_size == 1:
            return output.unsqueeze(1)
        return output.view(self.micro_batch_size, self.length, -1).transpose(0, 1).contiguous()
