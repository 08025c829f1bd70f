"""Context parallelism inside Seq1F1B segments: each segment spread over the CP group.

Context parallelism (CP) divides a sequence over ``cp`` ranks; Seq1F1B divides it
in time. They compose inside segments: every segment (not the whole sequence) is
cut into ``2 * cp`` chunks, and CP rank ``r`` holds chunks ``r`` and
``2cp - 1 - r`` (Megatron's load balancing for causal attention, within each
segment), so every rank does equal work in every segment. The pipeline still
sends one segment's activations per step, now this rank's part of it.

Attention is the only place the ranks meet: before a segment's attention the CP
group all-gathers its keys and values (:class:`GatherKV`, Megatron-TE's
``all_gather`` CP mode), in sequence order, so the K/V carry-over
(:mod:`megatron_seq1f1b.segments.kv_cache`) holds the whole segment for later segments
on every rank; this rank's queries then attend to earlier segments' keys and to
the segment's keys on every rank, each query up to its own position. The
backward reduce-scatters the keys' and values' gradient back to their owners:
what this segment's queries on all ranks owe, plus what later segments left for
it in the carry-over (added before the reduction, so it is summed over ranks
too).

The all-gather runs where attention needs it, on the compute stream: it
overlaps with nothing but the other ranks' own gathers (a layer's projection
must finish before it, attention waits for it). Pipeline transfers of other
steps overlap it as they overlap compute.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from megatron_seq1f1b.segments.cp_group import collective, is_stand_in


@functools.lru_cache(maxsize=64)
def _natural_order(cp_size: int) -> tuple[int, ...]:
    """For each chunk in sequence order, its place in the rank-major gathered tensor."""
    place = {}
    for rank in range(cp_size):
        place[rank] = 2 * rank
        place[2 * cp_size - 1 - rank] = 2 * rank + 1
    return tuple(place[chunk] for chunk in range(2 * cp_size))


@functools.lru_cache(maxsize=64)
def _places(cp_size: int, device: torch.device) -> torch.Tensor:
    """:func:`_natural_order` as an index on ``device`` (made once per CP size and device)."""
    return torch.tensor(_natural_order(cp_size), dtype=torch.long, device=device)


def _in_chunks(tensor: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``tensor`` (rows first) as ``[2 * cp, rows / (2 * cp), ...]`` (a view of the
    contiguous tensors made here; a copy only of a gradient whose rows cannot be viewed)."""
    return tensor.reshape((2 * cp_size, tensor.shape[0] // (2 * cp_size)) + tuple(tensor.shape[1:]))


def _all_gather_rows(local: torch.Tensor, group, meter) -> torch.Tensor:
    """Every CP rank's ``local`` rows, rank-major (over a stand-in group: this rank's, repeated)."""
    import torch.distributed as dist

    local = local.contiguous()
    gathered = local.new_empty((group.size() * local.shape[0],) + tuple(local.shape[1:]))
    if is_stand_in(group):  # a rehearsal: every rank's part made up as this rank's
        gathered.copy_(local.repeat(group.size(), *([1] * (local.dim() - 1))))
    else:
        collective("all-gather of a segment's keys and values", group,
                   lambda: dist.all_gather_into_tensor(gathered, local, group=group))
    if meter is not None:
        meter.add(local.numel() * local.element_size() * (group.size() - 1))
    return gathered


class GatherKV(torch.autograd.Function):
    """This rank's keys and values (its two chunks) -> the segment's, in sequence order.

    One all-gather of keys and values together; the backward reduce-scatters their
    gradients to their owners (summed over the ranks whose queries used them).
    """

    @staticmethod
    def forward(ctx, key: torch.Tensor, value: torch.Tensor, group, meter=None):
        cp = group.size()
        ctx.group, ctx.split, ctx.meter = group, key.shape[-1], meter
        gathered = _all_gather_rows(torch.cat([key, value], dim=-1), group, meter)
        # Into sequence order, keys and values apart, each in one kernel: no reordered copy
        # of the gathered tensor besides the two results.
        keys = key.new_empty((gathered.shape[0],) + tuple(key.shape[1:]))
        values = value.new_empty((gathered.shape[0],) + tuple(value.shape[1:]))
        places, chunks = _places(cp, gathered.device), _in_chunks(gathered, cp)
        torch.index_select(chunks[..., :ctx.split], 0, places, out=_in_chunks(keys, cp))
        torch.index_select(chunks[..., ctx.split:], 0, places, out=_in_chunks(values, cp))
        return keys, values

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        import torch.distributed as dist

        group = ctx.group
        cp = group.size()
        split = ctx.split
        ranked = grad_key.new_empty(tuple(grad_key.shape[:-1])
                                    + (split + grad_value.shape[-1],))
        places, chunks = _places(cp, ranked.device), _in_chunks(ranked, cp)
        chunks[..., :split].index_copy_(0, places, _in_chunks(grad_key, cp))
        chunks[..., split:].index_copy_(0, places, _in_chunks(grad_value, cp))
        local = ranked.new_empty((ranked.shape[0] // cp,) + tuple(ranked.shape[1:]))
        if is_stand_in(group):  # a rehearsal: this rank's part, unreduced
            local.copy_(ranked[: local.shape[0]])
        else:
            collective("reduce-scatter of a segment's key and value gradients", group,
                       lambda: dist.reduce_scatter_tensor(local, ranked, group=group))
        if ctx.meter is not None:
            ctx.meter.add(local.numel() * local.element_size() * (cp - 1))
        return local[..., :ctx.split], local[..., ctx.split:], None, None


class ExchangedBytes:
    """Bytes this rank sent in the CP group (all-gather forward, reduce-scatter backward): what
    a ring algorithm moves per rank, ``(cp - 1) / cp`` of the collective's tensor."""

    def __init__(self):
        self.bytes = 0

    def add(self, count: int) -> None:
        self.bytes += int(count)


def exchanged_bytes(lengths, num_layers: int, kv_bytes_per_token: float, cp_size: int,
                    micro_batch_size: int = 1, units=None, forward_only: bool = False) -> float:
    """Bytes one CP rank sends in its group per micro-batch of segments ``lengths`` on a
    stage of ``num_layers`` layers: per layer and segment, the all-gather of its part of the
    keys and values in the forward and the reduce-scatter of their gradients in the
    backward, ``(cp - 1) / cp`` of the segment's K/V each, as :class:`ExchangedBytes`
    counts them (``kv_bytes_per_token``: keys and values of one token of one layer;
    ``units``: how many times each segment's forward runs, e.g. 2 with recomputation)."""
    if cp_size <= 1:
        return 0.0
    per_pass = sum(lengths) / cp_size * micro_batch_size * kv_bytes_per_token * (cp_size - 1)
    passes = (units or 1) + (0 if forward_only else 1)
    return float(num_layers * per_pass * passes)


def local_attention_class():
    """Megatron's ``DotProductAttention`` buildable with context parallelism (Megatron asserts
    it is 1: its local attention has no CP exchange). Under Seq1F1B the exchange is ours
    (:class:`GatherKV`), so the module is built as for one CP rank; unsegmented calls with
    CP > 1 are refused by :mod:`megatron_seq1f1b.attention.segmented`."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    global _LOCAL
    if _LOCAL is None:
        class ContextParallelDotProductAttention(DotProductAttention):
            """DotProductAttention whose CP exchange Seq1F1B's segments make (see factory)."""

            seq1f1b_context_parallel = True

            def __init__(self, config, *args: Any, **kwargs: Any):
                single = copy.copy(config)
                single.context_parallel_size = 1
                super().__init__(single, *args, **kwargs)
                self.cp_size = config.context_parallel_size or 1

            def forward(self, *args: Any, **kwargs: Any):
                refuse_outside_segments(self.cp_size, type(self).__name__)
                return super().forward(*args, **kwargs)

        _LOCAL = ContextParallelDotProductAttention
    return _LOCAL


_LOCAL = None


def refuse_outside_segments(cp_size: int, module: str) -> None:
    """A core attention built for context parallelism > 1 without an exchange of its own runs
    only inside Seq1F1B segments (which gather the keys); elsewhere it would attend to this
    rank's chunk alone: a wrong result, so an error."""
    if cp_size <= 1:
        return
    from megatron_seq1f1b.segments import run as segments

    current = segments.active()
    if current is None or current.run.cp_size != cp_size:
        raise RuntimeError(
            f"{module} with context_parallel_size={cp_size} runs only inside Seq1F1B's "
            "schedule (megatron_seq1f1b.get_forward_backward_func), whose segments exchange "
            "the keys and values over the context-parallel group; Megatron's own schedules "
            "give it no exchange")


#: A HybridStack spec's fields that hold attention layers (``*``, ``+``; Megatron-Core 0.18+).
HYBRID_ATTENTION_LAYERS = ("attention_layer", "mla_layer")


def attention_layer_specs(spec: Any) -> list:
    """The layer specs inside `spec` that may hold a self-attention: a GPT layer spec itself, a
    block spec's ``layer_specs``, or a ``HybridStack`` spec's attention and MLA layers."""
    layers = getattr(spec, "layer_specs", None)
    if layers is not None:
        return list(layers)
    submodules = getattr(spec, "submodules", None)
    if hasattr(submodules, "attention_layer"):
        return [getattr(submodules, name) for name in HYBRID_ATTENTION_LAYERS
                if hasattr(submodules, name)]
    return [spec]


def context_parallel_layer_spec(spec: Any) -> Any:
    """A copy of a GPT layer (or block, or HybridStack) spec whose Megatron local core attention
    can be built with context parallelism > 1 (Seq1F1B segments make the exchange); other
    core attentions (the flash one, TE's) are left as they are."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    for layer in attention_layer_specs(spec):
        attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
        submodules = getattr(attention, "submodules", None)
        core = getattr(submodules, "core_attention", None)
        if isinstance(core, ModuleSpec) and core.module is DotProductAttention:
            core.module = local_attention_class()
        elif core is DotProductAttention:
            submodules.core_attention = local_attention_class()
    return spec
