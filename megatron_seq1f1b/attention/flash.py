"""Flash core attention on PyTorch SDPA, for Megatron-Core's local (Transformer-Engine-free) spec.

Why: Megatron-Core's local ``DotProductAttention`` computes the whole
``[b, heads, sq, sk]`` score and probability matrices; at the 32k-128k
tokens Seq1F1B targets they do not fit. :class:`FlashDotProductAttention`
is a drop-in core attention (same constructor as ``DotProductAttention`` in
Megatron-Core 0.16.1-0.19.x, no parameters, so ``state_dict`` keys do not
change) that calls :func:`torch.nn.functional.scaled_dot_product_attention`
without building any ``[sq, sk]`` tensor itself:

* ``sq == sk`` (the full sequence, or Seq1F1B's first segment):
  ``is_causal=True``; PyTorch serves it with its flash kernel (CUDA, fp16 /
  bf16), else its memory-efficient kernel, else the math kernel.
* ``sk > sq`` (a Seq1F1B segment over its K/V prefix, mask type
  ``causal_bottom_right``): ``attn_mask=causal_lower_right(sq, sk)``, a
  :class:`~torch.nn.attention.bias.CausalBias` that PyTorch serves with its
  flash kernel on CUDA (or the efficient one, e.g. fp32 or MLA's narrower
  values), aligned bottom-right: query ``i`` sees keys ``0 .. sk - sq + i``.
  On CPU, where PyTorch would materialize that mask (and autograd keep it),
  two mask-free flash calls merged by log-sum-exp compute it instead
  (:mod:`megatron_seq1f1b.attention.prefix`).
* Sliding windows (``config.window_size=(w, 0)`` on the layers
  ``is_layer_window_attention`` picks): SDPA's flash kernel has no window,
  so these layers pass a boolean ``[sq, sk]`` mask of the queries x keys
  actually given, aligned bottom-right as Transformer Engine does (query
  ``i`` sees keys ``sk - sq + i - w .. sk - sq + i``). Under Seq1F1B a
  windowed segment gets only the ``L + w`` keys in reach, so the mask is
  ``L x (L + w)``, made once per segment shape and shared by every windowed
  layer and micro-batch of the iteration (the segment run keeps it).
  PyTorch's FlexAttention (block-sparse, no dense mask) would serve windows
  without it; a later option.
* Grouped-query attention: ``enable_gqa=True`` (torch >= 2.5), else the
  keys/values are repeated per query head.
* Separate key and value widths (multi-latent attention: ``k_channels`` /
  ``v_channels``): SDPA's efficient and math kernels take them.
* Dropout: SDPA's ``dropout_p`` inside Megatron's model-parallel RNG fork,
  as Megatron's attention does (not under sequence parallelism, as
  Megatron). Its random stream differs from Megatron's, so with dropout the
  two backends agree in distribution, not bit for bit.

* Packed documents (THD: ``packed_seq_params`` with ``qkv_format='thd'``,
  ``cu_seqlens_q`` / ``cu_seqlens_kv``): causal attention per document,
  aligned bottom-right where a document has more keys than queries
  (``padding_causal_bottom_right``), through :func:`megatron_seq1f1b.attention.varlen.attention`
  (PyTorch's variable-length flash kernel ``varlen_attn`` on CUDA in fp16 / bf16 where
  this torch has one that passes its self-check, one SDPA call per document
  elsewhere); no mask tensor, and within Seq1F1B's segments no host sync.
* Context parallelism: only inside Seq1F1B's segments, which gather the keys
  over the CP group (:mod:`megatron_seq1f1b.attention.context_parallel`); elsewhere refused.

Causal masks only (``causal``, ``causal_bottom_right``, and their padding forms
for THD); an explicit ``attention_mask`` and an ``attention_bias`` are refused
(Seq1F1B's trainer runs without them; Megatron-LM needs
``--no-create-attention-mask-in-dataloader``). The class declares
``bottom_right_causal``: :mod:`megatron_seq1f1b.attention.segmented` then gives it a
segment's K/V prefix with ``causal_bottom_right``, as it does for
Transformer Engine's attention.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_seq1f1b.attention import varlen
from megatron_seq1f1b.attention.context_parallel import attention_layer_specs, refuse_outside_segments
from megatron_seq1f1b.attention.prefix import bottom_right_causal, causal_spans, cpu_kernels_fit
from megatron_seq1f1b.attention.varlen import window_mask
from megatron_seq1f1b.segments import run as segments

_CAUSAL = (AttnMaskType.causal, AttnMaskType.causal_bottom_right)
_TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2])
HAS_ENABLE_GQA = _TORCH >= (2, 5)  # scaled_dot_product_attention(enable_gqa=...)


#: ``_mask``'s answer for keys that outnumber queries: causal, aligned bottom-right, computed
#: by :func:`~megatron_seq1f1b.attention.prefix.bottom_right_causal` (no mask tensor on CPU).
BOTTOM_RIGHT = "bottom-right"


def _unsupported_extras(attention_bias, kwargs: dict) -> list[str]:
    """What neither the dense nor the packed path computes: a bias, or extra arguments."""
    problems = ["an attention_bias"] if attention_bias is not None else []
    given = sorted(name for name, value in kwargs.items() if value is not None)
    if given:
        problems.append(f"the arguments {', '.join(given)}")
    return problems


class FlashDotProductAttention(MegatronModule):
    """Causal core attention on PyTorch SDPA (see the module docstring for kernels and limits).

    Inputs as Megatron's core attention: query ``[sq, b, heads, dk]``, key
    ``[sk, b, groups, dk]``, value ``[sk, b, groups, dv]``; output
    ``[sq, b, heads * dv]``.
    """

    bottom_right_causal = True  # megatron_seq1f1b.attention.segmented gives it TE's K/V-prefix contract

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        **kwargs: Any,
    ):
        super().__init__(config=config)
        # Keywords other core attentions take (e.g. TE's num_splits) are fine while unset.
        unknown = sorted(name for name, value in kwargs.items() if value is not None)
        if unknown:
            raise TypeError(f"FlashDotProductAttention does not take {', '.join(unknown)}")
        problems = []
        self.cp_size = getattr(config, "context_parallel_size", 1) or 1  # Seq1F1B segments only
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            problems.append(f"softmax_type={config.softmax_type!r} (a softmax offset) has no "
                            "SDPA kernel; use softmax_type='vanilla'")
        if attn_mask_type not in _CAUSAL:
            problems.append(f"attn_mask_type={attn_mask_type} (causal attention only: "
                            "AttnMaskType.causal or causal_bottom_right)")
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                             layer_number)
        window = tuple(int(w) for w in config.window_size) if windowed else (-1, 0)
        if windowed and (window[0] < -1 or window[1] != 0):
            problems.append(f"window_size={window}: a causal window looks w >= 0 keys back and "
                            "none ahead; use window_size=(w, 0)")
        if problems:
            raise ValueError("FlashDotProductAttention: " + "; ".join(problems))
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        # Megatron's apply_query_key_layer_scaling divides the scale by the layer number and
        # multiplies the scores back in fp32: the net scale is this one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.k_channels ** -0.5
        self.dropout_p = float(config.attention_dropout if attention_dropout is None
                               else attention_dropout)
        self.window_size = window  # Transformer Engine's convention: (-1, 0) = no window

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``softmax(Q K^T * scale) V``, causal (bottom-right when keys outnumber queries)."""
        refuse_outside_segments(self.cp_size, "FlashDotProductAttention")
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd":
            return self._thd(query, key, value, attention_mask, attn_mask_type, attention_bias,
                             packed_seq_params, kwargs)
        sq, batch, heads, _ = query.shape
        sk, groups = key.shape[0], key.shape[2]
        mask, is_causal = self._mask(attention_mask, attn_mask_type, attention_bias,
                                     packed_seq_params, kwargs, sq, sk, query.device)
        sink = getattr(key, "seq1f1b_grad_sink", None)  # a Seq1F1B segment's carry-over
        # [s, b, h, d] -> [b, h, s, d] (views; SDPA takes strided inputs)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        extra = {}
        if groups != heads:
            if HAS_ENABLE_GQA:
                extra["enable_gqa"] = True
            else:
                key = key.repeat_interleave(heads // groups, dim=1)
                value = value.repeat_interleave(heads // groups, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout):
            if mask is BOTTOM_RIGHT:
                context = bottom_right_causal(query, key, value, scale=self.softmax_scale,
                                              dropout=dropout, sink=sink, **extra)
            else:
                context = torch.nn.functional.scaled_dot_product_attention(
                    query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                    scale=self.softmax_scale, **extra)
        # [b, h, sq, dv] -> [sq, b, h * dv]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * context.shape[-1])

    def attend_spans(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     spans) -> Optional[torch.Tensor]:
        """A context-parallel rank's chunks of a segment in one call: query rows
        ``[row, row + rows)`` over keys ``[low, high)``, causal bottom-right, for each span
        ``(row, rows, low, high)`` (:func:`~megatron_seq1f1b.attention.prefix.causal_spans`:
        one output and one key gradient, nothing padded per chunk); out ``[sq, b, h * dv]``.
        ``None`` where those CPU kernels do not serve this layer (a window, dropout, grouped
        or MLA-shaped keys, CUDA): the caller then attends chunk by chunk."""
        sq, batch, heads, _ = query.shape
        sink = getattr(key, "seq1f1b_grad_sink", None)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0
        if self.window_size[0] >= 0 or not cpu_kernels_fit(query, key, value, dropout):
            return None
        context = causal_spans(query, key, value, spans, scale=self.softmax_scale, sink=sink)
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * context.shape[-1])

    def _thd(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
             packed_seq_params, kwargs) -> torch.Tensor:
        """Packed documents (THD): causal attention per document, no mask tensor.

        ``query`` ``[t, heads, d]``, key/value ``[t_k, groups, d]``, cut by
        ``packed_seq_params.cu_seqlens_q`` / ``cu_seqlens_kv``; aligned
        bottom-right where a document has more keys than queries (mask type
        ``padding_causal_bottom_right``, as Seq1F1B's segments pass); out ``[t, heads * dv]``.
        """
        problems = []
        if attention_mask is not None:
            problems.append("an attention_mask with packed sequences (documents come from "
                            "cu_seqlens)")
        problems += _unsupported_extras(attention_bias, kwargs)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        name = getattr(mask_type, "name", mask_type)
        bottom_right = name in ("causal_bottom_right", "padding_causal_bottom_right")
        if name not in ("causal", "padding_causal") and not bottom_right:
            problems.append(f"attn_mask_type={name} with packed sequences (causal only)")
        if query.dim() != 3:
            problems.append(f"packed (THD) queries of shape {tuple(query.shape)}; expected "
                            "[tokens, heads, dim]")
        params = packed_seq_params
        for field in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            padded = getattr(params, field, None)
            if padded is not None and padded is not getattr(params, field[:-7], None) \
                    and not torch.equal(padded, getattr(params, field[:-7])):
                problems.append(f"{field} different from {field[:-7]} (padded documents are "
                                "for context parallelism)")
        if problems:
            raise ValueError("FlashDotProductAttention does not support " + "; ".join(problems))
        # A Seq1F1B segment's cuts as host integers (its plan; it passes bottom-right and int
        # maxima): nothing below reads a device tensor back. Megatron's own schedules give
        # tensors only; the per-piece path then reads them (varlen.attention).
        cu_q, cu_k = getattr(params, "seq1f1b_host", None) or (None, None)
        if not bottom_right and params.cu_seqlens_q is not params.cu_seqlens_kv \
                and not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise ValueError(
                f"FlashDotProductAttention: attn_mask_type={name} with documents of more keys "
                "than queries is ambiguous (Transformer Engine aligns it top-left); pass "
                "padding_causal_bottom_right")
        dropout = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout):
            context = varlen.attention(
                query, key, value, cu_q, cu_k, int(params.max_seqlen_q),
                int(params.max_seqlen_kv), scale=self.softmax_scale,
                window=self.window_size[0] if self.window_size[0] >= 0 else None, dropout=dropout,
                cu_q_tensor=params.cu_seqlens_q, cu_k_tensor=params.cu_seqlens_kv)
        return context.reshape(context.shape[0], -1)

    def _mask(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params, kwargs,
              sq: int, sk: int, device):
        """(attn_mask, is_causal) for SDPA; refuses what this module does not compute."""
        problems = []
        if attention_mask is not None:
            problems.append("an explicit attention_mask (it computes the causal mask itself; "
                            "Megatron-LM: add --no-create-attention-mask-in-dataloader, and no "
                            "--reset-attention-mask)")
        if packed_seq_params is not None:
            problems.append("packed sequences (packed_seq_params, THD)")
        problems += _unsupported_extras(attention_bias, kwargs)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in _CAUSAL:
            problems.append(f"attn_mask_type={mask_type} (causal only)")
        elif sk < sq:
            problems.append(f"fewer keys ({sk}) than queries ({sq})")
        elif sk != sq and mask_type == AttnMaskType.causal:
            problems.append(f"{sq} queries over {sk} keys with AttnMaskType.causal (ambiguous "
                            "alignment); pass causal_bottom_right")
        if problems:
            raise ValueError("FlashDotProductAttention does not support " + "; ".join(problems))
        if self.window_size[0] >= 0:
            window, current = self.window_size[0], segments.active()
            make = lambda: window_mask(sq, sk, window, device)  # noqa: E731
            # one per segment shape for every windowed layer (and micro-batch, where shapes
            # repeat: SegmentRun.shared_mask)
            return (make() if current is None
                    else current.run.shared_mask(current.info, ("window", sq, sk, window,
                                                                device), make)), False
        if sq == sk:
            return None, True
        return BOTTOM_RIGHT, False

    def _dropout_rng(self, dropout: float):
        """Megatron's model-parallel RNG for attention dropout, forked where its attention forks."""
        if dropout == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return get_cuda_rng_tracker().fork()


def flash_layer_spec(spec: Any) -> Any:
    """A copy of a GPT layer spec, block spec (``layer_specs``) or HybridStack spec with flash
    core attention.

    Every self-attention layer's ``core_attention`` (a class, or a ModuleSpec's
    module) becomes :class:`FlashDotProductAttention`; the rest of the spec is
    unchanged, so the built model has the same parameters and names.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    layers = attention_layer_specs(spec)
    replaced = 0
    for layer in layers:
        attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
        submodules = getattr(attention, "submodules", None)
        if submodules is None or not hasattr(submodules, "core_attention"):
            continue
        if isinstance(submodules.core_attention, ModuleSpec):
            submodules.core_attention.module = FlashDotProductAttention
        else:
            submodules.core_attention = FlashDotProductAttention
        replaced += 1
    if layers and not replaced:
        raise ValueError("flash_layer_spec: no layer of this spec has a self-attention "
                         "core_attention to replace")
    return spec


def use_flash_attention(model: Any) -> int:
    """Swap each built Megatron ``DotProductAttention`` of `model` for the flash one; a count.

    For models whose spec cannot be changed (Megatron-LM builds its own): the
    core attention has no parameters, so the swap keeps every parameter,
    buffer and ``state_dict`` key. `model`: a chunk or list of chunks,
    possibly wrapped (DDP, Float16Module); call before
    :func:`megatron_seq1f1b.enable`.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    swapped = 0
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for module in list(chunk.modules()):
            core = getattr(module, "core_attention", None)
            if not isinstance(core, DotProductAttention):
                continue
            # Megatron's local attention keeps softmax_scale / layer_number when it scales
            # query-key products by the layer number; its softmax multiplies them back.
            scale = core.softmax_scale * (core.scale_mask_softmax.scale or 1)
            flash = FlashDotProductAttention(
                config=core.config, layer_number=core.layer_number,
                attn_mask_type=core.attn_mask_type, attention_type=core.attention_type,
                attention_dropout=core.attention_dropout.p, softmax_scale=scale,
                pg_collection=getattr(core, "pg_collection", None))
            flash.train(core.training)
            module.core_attention = flash
            swapped += 1
    return swapped
