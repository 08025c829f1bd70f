"""A HybridModel stack spec without Transformer Engine, for CPU runs, tests and the trainer.

Megatron-Core's hybrid specs (``hybrid_layer_specs``) are Transformer Engine's: the
norms are fused into the linear layers, and without TE those classes are mocks
that fail at build or forward. Its one local spec (ModelOpt's) still builds TE norms.
:func:`local_hybrid_stack_spec` mirrors the TE spec with Megatron's own local
modules (``ColumnParallelLinear`` / ``RowParallelLinear``, ``DotProductAttention``
or :class:`~megatron_seq1f1b.attention.flash.FlashDotProductAttention`, separate
norms as the local GPT spec has them, ``SequentialMLP`` experts), so the same
parameters exist as in a TE build, under the local GPT spec's names.

``HybridStack`` builds its final norm with ``TENorm`` whatever the spec; where
Transformer Engine is not installed :func:`local_hybrid_stack_spec` gives it
Megatron's ``WrappedTorchNorm`` (same constructor, reads ``config.normalization``).
"""

from __future__ import annotations

import importlib.util

from megatron_seq1f1b.attention.flash import FlashDotProductAttention


def _final_norm_without_te() -> None:
    """HybridStack's final ``TENorm`` becomes Megatron's torch norm where TE is missing."""
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if importlib.util.find_spec("transformer_engine") is None:
        hybrid_block.TENorm = WrappedTorchNorm


def local_hybrid_stack_spec(*, attention: str | type = "local", num_experts: int | None = None):
    """A ``HybridStack`` spec for the symbols ``*`` (self-attention), ``+`` (multi-latent
    attention, Megatron's unfused ``MLASelfAttention``), ``M`` (Mamba-2, ``MambaMixer``),
    ``G`` (gated delta net), ``-`` (MLP), ``E`` (MoE, ``num_experts`` experts) and ``/``
    (multi-token prediction) from Megatron's local modules.

    ``attention``: ``"local"`` (Megatron's ``DotProductAttention``), ``"flash"``, or a core
    attention class. MLA's values are narrower than its queries, which Megatron's local
    ``DotProductAttention`` does not take: ``+`` needs ``"flash"`` or a class that does
    (Transformer Engine's). Megatron-Core 0.18 or later (``megatron.core.models.hybrid``)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.multi_latent_attention import (
        MLASelfAttention, MLASelfAttentionSubmodules,
    )
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock, MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer, MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer, TransformerLayer, TransformerLayerSubmodules,
    )

    if isinstance(attention, str) and attention not in ("local", "flash"):
        raise ValueError(f"local_hybrid_stack_spec: attention={attention!r}; 'local', 'flash' "
                         "or a core attention class")
    _final_norm_without_te()
    core = {"flash": FlashDotProductAttention, "local": DotProductAttention}.get(attention, attention)

    def mixer_layer(mixer: ModuleSpec) -> ModuleSpec:
        """A TransformerLayer of one sequence mixer (attention, MLA, gated delta net)."""
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm, self_attention=mixer,
            self_attn_bda=get_bias_dropout_add))

    causal = {"attn_mask_type": AttnMaskType.causal}
    attention_layer = mixer_layer(ModuleSpec(
        module=SelfAttention, params=causal, submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear, core_attention=core, linear_proj=RowParallelLinear,
            q_layernorm=IdentityOp, k_layernorm=IdentityOp)))
    mla_layer = mixer_layer(ModuleSpec(
        module=MLASelfAttention, params=causal, submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear, core_attention=core,
            linear_proj=RowParallelLinear, q_layernorm=IdentityOp, kv_layernorm=IdentityOp)))
    gdn_layer = mixer_layer(ModuleSpec(
        module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
            out_proj=RowParallelLinear)))
    mamba_layer = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add,
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    moe_layer = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=num_experts or 1,
                                    moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    mtp_block = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[ModuleSpec(
            module=MultiTokenPredictionLayer,
            submodules=MultiTokenPredictionLayerSubmodules(
                enorm=WrappedTorchNorm, hnorm=WrappedTorchNorm, layer_norm=WrappedTorchNorm,
                eh_proj=ColumnParallelLinear, mtp_model_layer=None),
        )]),
    )
    # "+" from Megatron-Core 0.19 (0.18's HybridStackSubmodules has no mla_layer), "G" 0.18
    optional = {name: layer for name, layer in (("mla_layer", mla_layer), ("gdn_layer", gdn_layer))
                if hasattr(HybridStackSubmodules, name)}
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        **optional, mamba_layer=mamba_layer, attention_layer=attention_layer, mlp_layer=mlp_layer, moe_layer=moe_layer,
        mtp_block_spec=mtp_block))


__all__ = ["local_hybrid_stack_spec"]
