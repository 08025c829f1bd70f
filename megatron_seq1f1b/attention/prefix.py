"""Causal attention of a segment over earlier keys, aligned bottom-right, with no mask tensor.

A segment's queries ``[sq]`` attend to ``sk >= sq`` keys: all ``sk - sq`` keys
of the prefix (earlier segments, or the start of the document crossing into
the segment) and their own keys causally. PyTorch expresses that as
``attn_mask=causal_lower_right(sq, sk)``; on CUDA its memory-efficient kernel
applies it without a mask, but on CPU SDPA materializes the ``[sq, sk]`` mask
and autograd keeps it for the backward: per layer and segment a
``[segment, prefix]`` tensor, as large as the scores flash attention exists
to avoid (it made CPU measurements of the flash path hold memory a GPU run
does not).

On CPU :class:`_CausalSpans` computes the same attention in two mask-free
flash calls per span of queries, the prefix keys without a mask and the own
keys with ``is_causal`` (square, top-left = bottom-right), merged by their
log-sum-exps; its backward gives each call the merged output and
log-sum-exp, which is exactly how flash attention's backward splits over key
blocks (ring attention does the same), so the gradients are exact. The backward
takes the prefix in blocks of the span's own length, so no kernel's key
gradient is larger than the span: at the stage's peak (a backward) the
temporaries stay a segment's, not its prefix's.

Several spans of one call serve a context-parallel rank (:func:`causal_spans`): its
two chunks of a segment, each over the keys up to its own end, share one output
and one key/value gradient, so nothing is concatenated or padded to full size
per chunk (what chunk-by-chunk SDPA calls and slices of the keys cost).
"""

from __future__ import annotations

from typing import Sequence

import torch

#: A span of queries over keys: query rows ``[row, row + rows)`` attend to keys
#: ``[low, high)``, causal and aligned bottom-right (the span's own keys are the last ``rows``).
Span = tuple[int, int, int, int]


def cpu_kernels_fit(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    dropout: float = 0.0) -> bool:
    """Whether :func:`causal_spans` serves these ``[b, h, s, d]`` inputs: CPU, no dropout, as
    many key heads as query heads and one head size (PyTorch's CPU flash kernels)."""
    return (query.device.type == "cpu" and dropout == 0.0 and query.dim() == 4
            and key.shape[1] == query.shape[1] and value.shape[-1] == query.shape[-1]
            and key.shape[-1] == query.shape[-1])


def bottom_right_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                        scale: float, dropout: float = 0.0, sink=None, **extra) -> torch.Tensor:
    """``softmax(Q K^T * scale, causal bottom-right) V`` for ``[b, h, sq, d]`` queries over
    ``[b, g, sk, d]`` keys and values (``sk >= sq``; ``extra``: SDPA's ``enable_gqa`` where
    ``g < h``; ``sink``: see :func:`causal_spans`); out ``[b, h, sq, dv]``. Where the CPU
    kernels do not fit (grouped or MLA-shaped keys, dropout, CUDA) SDPA gets the mask."""
    sq, sk = query.shape[-2], key.shape[-2]
    if sq == sk:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scale, **extra)
    if cpu_kernels_fit(query, key, value, dropout):
        return causal_spans(query, key, value, [(0, sq, 0, sk)], scale=scale, sink=sink)
    from torch.nn.attention.bias import causal_lower_right

    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(sq, sk), dropout_p=dropout,
        scale=scale, **extra)


def causal_spans(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 spans: Sequence[Span], *, scale: float, sink=None) -> torch.Tensor:
    """Each span's query rows over its keys, causal bottom-right, on CPU flash kernels
    (:func:`cpu_kernels_fit`); spans cover the query rows once. Out ``[b, h, sq, d]`` in
    the kernel's own ``[b, sq, h, d]`` layout, so ``[sq, b, h * d]`` is a view of it.

    ``sink``: a Seq1F1B segment's :class:`~megatron_seq1f1b.segments.kv_cache.GradientSink` (keys
    ``[b, h, sk, d]`` viewed from ``[sk, b, h, d]`` rows of the carry-over); the backward
    then adds the key and value gradients into the carry-over's gradient buffer, where it
    has one, instead of a new tensor as large as the keys."""
    for row, rows, low, high in spans:
        if rows <= 0 or high - low < rows or low < 0 or high > key.shape[-2]:
            raise ValueError(f"causal_spans: span {(row, rows, low, high)} of {rows} queries "
                             f"over keys [{low}, {high}) of {key.shape[-2]}")
    return _CausalSpans.apply(query, key, value, tuple(spans), scale, sink)


def _parts(span: Span, block: int | None = None):
    """(key rows, causal) of the span's prefix (if any; in blocks of at most ``block`` keys
    if given) and of its own rows."""
    row, rows, low, high = span
    split = high - rows
    step = block or max(split - low, 1)
    prefix = [((a, min(a + step, split)), False) for a in range(low, split, step)]
    return prefix + [((split, high), True)]


class _CausalSpans(torch.autograd.Function):
    """Per span: prefix keys (no mask) + own keys (causal), merged by log-sum-exp.

    Lean where it runs once per segment and layer: the kernels' outputs are merged in
    place (one span: the first kernel's output is the result, nothing copied), the first
    contribution to a gradient is the gradient (no zero-filled buffer to add into), and
    the key blocks are planned once in the forward."""

    @staticmethod
    def forward(ctx, query, key, value, spans, scale, sink):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        b, h, sq, _ = query.shape
        whole = len(spans) == 1 and spans[0][:2] == (0, sq)
        out = lse = None
        if not whole:
            out = query.new_empty((b, sq, h, value.shape[-1])).transpose(1, 2)  # kernel layout
            accumulate = torch.float64 if query.dtype == torch.float64 else torch.float32
            lse = query.new_empty((b, sq, h), dtype=accumulate).transpose(1, 2)
        for span in spans:
            rows = slice(span[0], span[0] + span[1])
            q = query[..., rows, :]
            results = [flash(q, key[..., a:z, :], value[..., a:z, :], 0.0, causal, scale=scale)
                       for (a, z), causal in _parts(span)]
            span_out, span_lse = results[0][:2]
            if len(results) == 2:
                other_out, other_lse = results[1][:2]
                merged = torch.logaddexp(span_lse, other_lse)
                # out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse), in the kernels'
                # own buffers
                span_out.mul_(span_lse.sub_(merged).exp_().unsqueeze(-1))
                span_out.addcmul_(other_out, other_lse.sub_(merged).exp_().unsqueeze(-1))
                span_lse = merged
            if whole:
                out, lse = span_out, span_lse
            else:
                out[..., rows, :].copy_(span_out)
                lse[..., rows].copy_(span_lse)
        ctx.save_for_backward(query, key, value, out, lse)
        # The backward's kernels: per span its rows and key blocks of the span's own length
        # (each kernel's key and value gradients stay that small; the backward splits over
        # key blocks exactly).
        ctx.plan = [(slice(span[0], span[0] + span[1]), _parts(span, block=span[1]))
                    for span in spans]
        ctx.scale, ctx.sink, ctx.low_high = scale, sink, (spans[0][2], spans[0][3])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        query, key, value, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        plan = ctx.plan
        # One span: every key row gets at most one kernel's gradient, so a fresh buffer is
        # written, not added into (rows outside the span's keys are zeroed).
        grad_key, grad_value, fresh = _gradient_buffers(ctx.sink, key, value, len(plan) == 1)
        if fresh:
            low, high = ctx.low_high
            for grad in (grad_key, grad_value):
                grad[..., :low, :].zero_()
                grad[..., high:, :].zero_()
        grad_query = None if len(plan) == 1 and plan[0][0] == slice(0, query.shape[-2]) \
            else torch.empty_like(query)
        for rows, parts in plan:
            for number, ((a, z), causal) in enumerate(parts):
                gq, gk, gv = backward(grad_out[..., rows, :], query[..., rows, :],
                                      key[..., a:z, :], value[..., a:z, :], out[..., rows, :],
                                      lse[..., rows], 0.0, causal, scale=ctx.scale)
                if grad_query is None:
                    grad_query = gq
                elif number == 0:
                    grad_query[..., rows, :].copy_(gq)
                else:
                    grad_query[..., rows, :] += gq
                if fresh:
                    grad_key[..., a:z, :].copy_(gk)
                    grad_value[..., a:z, :].copy_(gv)
                else:
                    grad_key[..., a:z, :] += gk
                    grad_value[..., a:z, :] += gv
        return grad_query, grad_key, grad_value, None, None, None


def _gradient_buffers(sink, key: torch.Tensor, value: torch.Tensor, may_be_fresh: bool):
    """(key gradient, value gradient, fresh): the carry-over's rows to add into (``sink``;
    fresh where the carry-over made them for this segment: not yet written), else new
    buffers (fresh, unwritten, where ``may_be_fresh``; zeroed otherwise)."""
    claimed = None if sink is None else sink.claim(key.dtype, fresh_ok=may_be_fresh)
    if claimed is None:
        if may_be_fresh:
            return torch.empty_like(key), torch.empty_like(value), True
        return torch.zeros_like(key), torch.zeros_like(value), False
    rows_k, rows_v, fresh = claimed
    grads = tuple(rows.permute(1, 2, 0, 3) for rows in (rows_k, rows_v))  # [sk, b, h, d] -> [b, h, sk, d]
    if grads[0].shape != key.shape or grads[1].shape != value.shape:
        raise RuntimeError(f"causal_spans: the carry-over's gradient rows {tuple(grads[0].shape)}"
                           f" do not match the keys {tuple(key.shape)}")
    return grads[0], grads[1], fresh
