"""Core attention with separate key and value widths, in plain torch (the trainer's MLA).

Multi-latent attention hands its core attention queries/keys of width
``qk_head_dim + qk_pos_emb_head_dim`` and values of width ``v_head_dim``.
Megatron-Core's local ``DotProductAttention`` assumes one width, so MLA needs
Transformer Engine's attention; this module lets ``scripts/pretrain_gpt.py``
train MLA where TE is absent (CPU, or a GPU without TE). It is causal,
aligned bottom-right when keys outnumber queries (so Seq1F1B segments attend
to their K/V prefix, see :mod:`megatron_seq1f1b.attention`), and honours the
layer's sliding window the way TE does.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention


class TorchCoreAttention(MegatronModule):
    """``softmax(Q K^T * scale) V`` per head, causal (bottom-right), K/V widths may differ."""

    bottom_right_causal = True  # megatron_seq1f1b.attention treats it like TE's attention

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type=None, pg_collection=None, **_):
        super().__init__(config=config)
        self.heads = config.num_attention_heads // config.tensor_model_parallel_size
        width = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else width ** -0.5
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                             layer_number)
        self.window_size = tuple(config.window_size) if windowed else (-1, 0)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("TorchCoreAttention supports neither attention_bias nor packed "
                             "sequences")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.causal_bottom_right):
            raise ValueError(f"TorchCoreAttention is causal only, got {mask_type}")
        sq, batch, heads, _ = query.shape
        sk = key.shape[0]
        if key.shape[2] != heads:  # grouped-query attention
            key = key.repeat_interleave(heads // key.shape[2], dim=2)
            value = value.repeat_interleave(heads // value.shape[2], dim=2)
        positions = torch.arange(sq, device=query.device).unsqueeze(1) + (sk - sq)
        keys = torch.arange(sk, device=query.device)
        visible = keys <= positions
        if self.window_size[0] >= 0:
            visible &= keys >= positions - self.window_size[0]
        with self._dropout_rng():
            context = torch.nn.functional.scaled_dot_product_attention(
                query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                attn_mask=visible, dropout_p=self.dropout if self.training else 0.0,
                scale=self.softmax_scale,
            )
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * value.shape[-1])

    def _dropout_rng(self):
        """Megatron's model-parallel RNG for attention dropout (as its own attention forks it)."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return get_cuda_rng_tracker().fork()
