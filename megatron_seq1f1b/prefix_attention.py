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

On CPU :class:`_PrefixCausal` computes the same attention in two mask-free
flash calls, the prefix keys without a mask and the own keys with
``is_causal`` (square, top-left = bottom-right), merged by their
log-sum-exps; its backward gives each call the merged output and
log-sum-exp, which is exactly how flash attention's backward splits over key
blocks (ring attention does the same), so the gradients are exact.
"""

from __future__ import annotations

import torch


def bottom_right_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                        scale: float, dropout: float = 0.0, **extra) -> torch.Tensor:
    """``softmax(Q K^T * scale, causal bottom-right) V`` for ``[b, h, sq, d]`` queries over
    ``[b, g, sk, d]`` keys and values (``sk >= sq``; ``extra``: SDPA's ``enable_gqa`` where
    ``g < h``); out ``[b, h, sq, dv]``. The CPU kernels need equal heads and head sizes and no
    dropout; otherwise SDPA gets the mask (grouped or MLA-shaped keys, dropout)."""
    sq, sk = query.shape[-2], key.shape[-2]
    if sq == sk:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scale, **extra)
    if query.device.type == "cpu" and dropout == 0.0 and query.dim() == 4 \
            and key.shape[1] == query.shape[1] and value.shape[-1] == query.shape[-1]:
        return _PrefixCausal.apply(query, key, value, scale)
    from torch.nn.attention.bias import causal_lower_right

    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(sq, sk), dropout_p=dropout,
        scale=scale, **extra)


def _parts(key: torch.Tensor, value: torch.Tensor, prefix: int):
    """(keys, values, causal) of the prefix and of the segment's own rows."""
    return ((key[..., :prefix, :], value[..., :prefix, :], False),
            (key[..., prefix:, :], value[..., prefix:, :], True))


class _PrefixCausal(torch.autograd.Function):
    """Prefix keys (no mask) + own keys (causal), merged by log-sum-exp; CPU flash kernels."""

    @staticmethod
    def forward(ctx, query, key, value, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        prefix = key.shape[-2] - query.shape[-2]
        results = [flash(query, k, v, 0.0, causal, scale=scale)[:2]
                   for k, v, causal in _parts(key, value, prefix)]
        (out_a, lse_a), (out_b, lse_b) = results
        lse = torch.logaddexp(lse_a, lse_b)
        out = (out_a * torch.exp(lse_a - lse).unsqueeze(-1)
               + out_b * torch.exp(lse_b - lse).unsqueeze(-1)).to(query.dtype)
        merged = torch.empty_strided(lse_a.shape, lse_a.stride(), dtype=lse_a.dtype)
        merged.copy_(lse)  # the kernel's own layout for its backward
        ctx.save_for_backward(query, key, value, out, merged)
        ctx.scale, ctx.prefix = scale, prefix
        return out

    @staticmethod
    def backward(ctx, grad_out):
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        query, key, value, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        grad_query, grad_keys, grad_values = None, [], []
        for k, v, causal in _parts(key, value, ctx.prefix):
            gq, gk, gv = backward(grad_out, query, k, v, out, lse, 0.0, causal, scale=ctx.scale)
            grad_query = gq if grad_query is None else grad_query + gq
            grad_keys.append(gk)
            grad_values.append(gv)
        return grad_query, torch.cat(grad_keys, dim=-2), torch.cat(grad_values, dim=-2), None
