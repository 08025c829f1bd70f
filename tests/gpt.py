"""A tiny Megatron-Core GPT, fixed data, a no-pipelining reference, and comparison.

Every correctness test follows one pattern: compute loss and gradients with
pipeline size 1 on the full sequence (the reference), build the layout under
test with the *same* weights, run a schedule, and compare loss, loss reports
and every parameter gradient. Runs inside harness worker processes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from functools import partial
from typing import Any, Callable, Iterable

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from harness import COMM_TIMEOUT_S
from megatron_seq1f1b.attention.flash import flash_layer_spec
from megatron_seq1f1b.base import compat

RTOL = 1e-5
SEED = 1234


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the tiny GPT looks like; hashable so references can be cached."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    vocab_size: int = 64
    seq_length: int = 32
    position_embedding_type: str = "rope"
    tied_embeddings: bool = False
    normalization: str = "LayerNorm"
    gated_linear_unit: bool = False
    mla: bool = False  # multi-latent attention (with the fake TE core attention below)
    attention: str = "local"  # core attention: Megatron's "local" one, or "flash" (SDPA)
    extra: tuple = ()  # further TransformerConfig fields as (name, value) pairs
    # a HybridModel's layer pattern (Megatron-Core 0.18+; "|" between pipeline stages, taken
    # out for the one-stage reference), built with megatron_seq1f1b's local hybrid spec;
    # num_layers is then the pattern's
    hybrid: str = ""


def hybrid_layers(pattern: str) -> int:
    """Layers of a hybrid pattern's main part (stage separators and MTP depths not counted)."""
    return len(pattern.split("/")[0].replace("|", ""))


@dataclasses.dataclass(frozen=True)
class DataSpec:
    num_microbatches: int = 4
    micro_batch_size: int = 1
    seed: int = 7
    explicit_mask: bool = False
    # Packed documents: per micro-batch (cycled), per sample, where documents start. The last
    # vocabulary id ends a document (as Megatron's NullTokenizer); position ids restart per
    # document. ``explicit_mask``: a dense [b, 1, s, s] document mask (--reset-attention-mask);
    # ``thd``: Megatron-LM's packed batch (cu_seqlens, max_seqlen; one sample).
    documents: tuple = ()
    thd: bool = False
    # give the model the loss mask too (Megatron-LM's forward_step does; only multi-token
    # prediction reads it); without it MTP counts every token, as Megatron does then
    model_loss_mask: bool = False


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, timeout_s=None, **kwargs):
    """(Re)initialize Megatron's parallel state with short timeouts."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        distributed_timeout_minutes=(timeout_s or COMM_TIMEOUT_S) / 60,
        create_gloo_process_groups=False,
        **kwargs,
    )
    model_parallel_cuda_manual_seed(SEED)


def make_config(spec: ModelSpec, *, tp=1, pp=1, vpp=None, sp=False, **overrides) -> TransformerConfig:
    fields = dict(
        num_layers=hybrid_layers(spec.hybrid) if spec.hybrid else spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=4 * spec.hidden_size,
        normalization=spec.normalization,
        gated_linear_unit=spec.gated_linear_unit,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True,
    )
    if spec.mla:
        fields.update(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                      v_head_dim=6, rope_type="rope", rotary_scaling_factor=4.0,
                      original_max_position_embeddings=16, apply_rope_fusion=False)
    if "M" in spec.hybrid:  # Mamba-2, small: 4 heads of 8 in 2 groups, state 8, chunks of 8
        fields.update(mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2)
    if "G" in spec.hybrid:  # gated delta net, small: 2 key heads, 4 value heads of 8
        fields.update(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_conv_kernel_dim=4,
                      activation_func=torch.nn.functional.silu)  # GDN's conv takes silu only
    if spec.hybrid and "/" in spec.hybrid:  # Megatron-LM infers MTP depth from the pattern
        fields["mtp_num_layers"] = spec.hybrid.count("/")
    fields.update(dict(spec.extra))
    fields.update(overrides)
    return (MLATransformerConfig if spec.mla else TransformerConfig)(**fields)


def moe_losses() -> dict:
    """Megatron's MoE losses per layer, reduced as its report does.

    Under context parallelism, a loss that Megatron records without any reduce or average
    group (the z-loss before megatron-core 0.19) is reported per CP rank, of its own tokens:
    averaged here over the CP group, which is what the full sequence's value is.
    """
    reported = compat.moe_losses()
    cp_group = parallel_state.get_context_parallel_group()
    if cp_group.size() > 1:
        for name, (_, reduce_group, avg_group) in compat.moe_loss_tracker().items():
            if reduce_group is None and avg_group is None:
                torch.distributed.all_reduce(reported[name], group=cp_group)
                reported[name] /= cp_group.size()
    return reported


def clear_moe_losses() -> None:
    """Forget every tracked MoE and MTP loss (entries are sized by the model that made them)."""
    compat.moe_losses(reset=True)
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def mtp_losses():
    """Megatron's logged MTP loss per depth (summed over this rank's forwards), or None."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values", tracker.get("values"))
    return None if values is None else values.detach().clone()


def is_moe(spec: ModelSpec) -> bool:
    return bool(dict(spec.extra).get("num_moe_experts"))


def block_spec(spec: ModelSpec, config, vp_stage=None):
    """The decoder's spec: Megatron's MoE block spec (layer frequency, shared experts) or a layer."""
    if not is_moe(spec):
        return layer_spec(spec)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=spec.normalization,
        vp_stage=vp_stage, pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    return flash_layer_spec(block) if spec.attention == "flash" else block


def layer_spec(spec: ModelSpec, fake_te: bool = False):
    """Megatron's local layer spec; MLA needs a core attention with separate K/V widths
    (Transformer Engine's), so it gets the fake below, or the flash one."""
    layer = get_gpt_layer_local_spec(normalization=spec.normalization,
                                     multi_latent_attention=spec.mla)
    if spec.attention == "flash":
        return flash_layer_spec(layer)
    if fake_te or spec.mla:
        layer = copy.deepcopy(layer)
        layer.submodules.self_attention.submodules.core_attention = TEDotProductAttention
    return layer


def build_hybrid_chunks(spec: ModelSpec, config: TransformerConfig) -> list:
    """HybridModel chunks for this rank, as Megatron-LM's hybrid builder makes them: the
    pattern's "|" stages, one per (virtual) pipeline stage; one stage: the whole pattern."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_seq1f1b.runtime.hybrid_spec import local_hybrid_stack_spec

    vpp = config.virtual_pipeline_model_parallel_size
    pattern = spec.hybrid if config.pipeline_model_parallel_size > 1 \
        else spec.hybrid.replace("|", "")
    core = TEDotProductAttention if spec.mla and spec.attention == "local" else spec.attention
    stack = local_hybrid_stack_spec(attention=core,
                                    num_experts=dict(spec.extra).get("num_moe_experts"))
    if (config.context_parallel_size or 1) > 1:
        from megatron_seq1f1b.attention.context_parallel import context_parallel_layer_spec

        stack = context_parallel_layer_spec(stack)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(HybridModel(
            config=config, hybrid_stack_spec=stack, vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length, hybrid_layer_pattern=pattern,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=spec.tied_embeddings,
            position_embedding_type=spec.position_embedding_type, vp_stage=stage))
    return chunks


def build_chunks(spec: ModelSpec, config: TransformerConfig) -> list[GPTModel]:
    """Model chunks for this rank, as Megatron-LM's model provider builds them (with context
    parallelism, Megatron's local attention made buildable for Seq1F1B's segments)."""
    from megatron_seq1f1b.attention.context_parallel import context_parallel_layer_spec

    if spec.hybrid:
        return build_hybrid_chunks(spec, config)
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        block = block_spec(spec, config, stage)
        if (config.context_parallel_size or 1) > 1:
            block = context_parallel_layer_spec(block)
        mtp = None
        if config.mtp_num_layers:  # Megatron-LM's builder: the block's last layer spec
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp = get_gpt_mtp_block_spec(
                config, block, use_transformer_engine=False, vp_stage=stage,
                pp_rank=parallel_state.get_pipeline_model_parallel_rank())
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=block,
                mtp_block_spec=mtp,
                vocab_size=spec.vocab_size,
                max_sequence_length=spec.seq_length,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=spec.tied_embeddings,
                position_embedding_type=spec.position_embedding_type,
                vp_stage=stage,
            )
        )
    return chunks


def wrap_ddp(chunks: list[GPTModel], config: TransformerConfig, **ddp_kwargs) -> list:
    """Megatron DDP around each chunk plus the config hooks Megatron-LM installs."""
    ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
    wrapped = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
    no_sync = [m.no_sync for m in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_grad_reduce:
        sync = [m.start_grad_sync for m in wrapped]
        config.grad_sync_func = sync[0] if len(sync) == 1 else sync
    return wrapped


def unwrap(module):
    while not isinstance(module, compat.language_models()):
        module = module.module
    return module


# ---------------------------------------------------------------- data


def make_batches(model: ModelSpec, data: DataSpec, count: int | None = None,
                 reference: bool = False) -> list[dict]:
    """Fixed micro-batches; the loss mask has zeros so token counts differ.

    ``reference``: the form the no-pipelining reference runs (Megatron's local attention):
    documents as a dense mask, never packed.
    """
    gen = torch.Generator().manual_seed(data.seed)
    b, s, v = data.micro_batch_size, model.seq_length, model.vocab_size
    batches = []
    for index in range(count or data.num_microbatches):
        documents = data.documents[index % len(data.documents)] if data.documents else None
        tokens = torch.randint(0, v - 1 if documents else v, (b, s), generator=gen)
        labels = torch.randint(0, v, (b, s), generator=gen)
        loss_mask = (torch.rand(b, s, generator=gen) > 0.25).float()
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
        batch = dict(tokens=tokens, labels=labels, loss_mask=loss_mask,
                     position_ids=position_ids, attention_mask=None)
        if documents is not None:
            _add_documents(batch, documents, v - 1, data, reference)
        elif data.explicit_mask:
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
            batch["attention_mask"] = causal.expand(b, 1, s, s).contiguous()
        batches.append(batch)
    return batches


def _add_documents(batch: dict, documents, eod: int, data: DataSpec, reference: bool) -> None:
    """End-of-document tokens, restarting position ids, and the form the run takes them in."""
    b, s = batch["tokens"].shape
    assert len(documents) == b, "one tuple of document starts per sample"
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for sample, starts in enumerate(documents):
        bounds = list(starts) + [s]
        for doc_start, doc_end in zip(bounds, bounds[1:]):
            if doc_end < s:
                batch["tokens"][sample, doc_end - 1] = eod
            batch["position_ids"][sample, doc_start:doc_end] = torch.arange(doc_end - doc_start)
        doc = torch.zeros(s, dtype=torch.long)
        for number, doc_start in enumerate(starts):
            doc[doc_start:] = number
        mask[sample, 0] = (doc.unsqueeze(0) != doc.unsqueeze(1)) | torch.ones(
            s, s, dtype=torch.bool).triu(1)
    if reference or data.explicit_mask:
        batch["attention_mask"] = mask
    elif data.thd:
        assert b == 1, "packed (THD) batches hold one sample"
        cu = list(documents[0]) + [s]
        batch["cu_seqlens"] = torch.tensor([cu], dtype=torch.int32)
        batch["max_seqlen"] = torch.tensor([max(b - a for a, b in zip(cu, cu[1:]))])


def packed_seq_params(batch: dict):
    """Megatron-LM's PackedSeqParams for a packed batch (core_v0.19 pretrain_gpt.forward_step)."""
    if batch.get("cu_seqlens") is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"].squeeze(0)
    longest = int(batch["max_seqlen"].item())
    # total_tokens: Megatron derives Mamba's seq_idx (its documents) from it
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest,
                           **compat.packed_total_tokens(int(batch["tokens"].shape[-1])))


def data_documents(data: DataSpec, count: int, seq_length: int):
    """The documents of ``count`` micro-batches as the schedule's plan data (or None)."""
    if not data.documents:
        return None
    from megatron_seq1f1b.segments.documents import Documents

    return [Documents(tuple(tuple(s) for s in data.documents[i % len(data.documents)]),
                      seq_length) for i in range(count)]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's GPT loss: (sum, token count, report)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, slicer: Callable[[dict], dict] | None = None,
                 give_mask: bool = False):
    batch = next(data_iterator)
    if slicer is not None:
        batch = slicer(batch)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
        packed_seq_params=packed_seq_params(batch),
        **({"loss_mask": batch["loss_mask"]} if give_mask else {}),
    )
    return output, partial(loss_func, batch["loss_mask"])


# ---------------------------------------------------------------- reference

_REFERENCES: dict[tuple, dict] = {}


def _one_replica_global_batch(gpt) -> None:
    """global_aux_loss counts tokens over the data-parallel group: the layouts under test hold
    one replica of these micro-batches, so the reference (data-parallel over all workers,
    each with every micro-batch) counts over its own rank only."""
    world = torch.distributed.get_world_size()
    singles = [torch.distributed.new_group([r]) for r in range(world)]
    mine = singles[torch.distributed.get_rank()]
    for module in gpt.modules():
        if hasattr(module, "tp_dp_cp_group") and hasattr(module, "ga_steps"):
            module.tp_dp_cp_group = mine


def reference(model: ModelSpec, batches_key: tuple, batches: list[dict], per_token: bool) -> dict:
    """Loss reports and gradients of pp=1 full-sequence training (cached per worker).

    With Megatron's local attention (the fake TE one for MLA): other core attentions are
    compared against it; packed (THD) batches, given only where the form changes the result
    (MTP), with the flash attention's THD path.
    """
    # Packed (THD) reference batches (MTP rolls per document only in that form): flash's THD.
    packed = any(batch.get("cu_seqlens") is not None for batch in batches)
    model = dataclasses.replace(model, attention="flash" if packed else "local")
    key = (model, batches_key, per_token)
    if key in _REFERENCES:
        return _REFERENCES[key]
    init_parallel()
    config = make_config(model, calculate_per_token_loss=per_token)
    (gpt,) = build_chunks(model, config)
    if dict(model.extra).get("moe_router_load_balancing_type") == "global_aux_loss":
        _one_replica_global_batch(gpt)
    clear_moe_losses()
    store = schedules.forward_backward_no_pipelining(
        forward_step_func=partial(forward_step, give_mask=getattr(batches_key[0], "model_loss_mask", False)),
        data_iterator=iter(batches),
        model=[gpt],
        num_microbatches=len(batches),
        seq_length=model.seq_length,
        micro_batch_size=batches[0]["tokens"].shape[0],
    )
    reports = torch.stack([entry["lm loss"] for entry in store])
    grads = {}
    for name, param in gpt.named_parameters():
        grad = param.grad.detach().clone()
        if per_token:
            grad /= reports[:, 1].sum()
        grads[name] = grad
    result = dict(
        state={name: p.detach().clone() for name, p in gpt.named_parameters()},
        grads=grads,
        reports=reports,
        moe_losses=moe_losses(),
        mtp_losses=mtp_losses(),
    )
    clear_moe_losses()
    parallel_state.destroy_model_parallel()
    _REFERENCES[key] = result
    return result


def global_name(chunk: GPTModel, local_name: str, spec: ModelSpec) -> str:
    """Name of `local_name` of a pipeline chunk in the pp=1 reference model."""
    if local_name.startswith("decoder.layers."):
        _, _, index, rest = local_name.split(".", 3)
        layer = chunk.decoder.layers[int(index)]
        if rest.startswith("mlp.experts.local_experts."):  # expert parallel: global expert index
            expert, tail = rest.split(".", 4)[3:]
            local = len(layer.mlp.experts.local_experts)
            expert = parallel_state.get_expert_model_parallel_rank() * local + int(expert)
            rest = f"mlp.experts.local_experts.{expert}.{tail}"
        return f"decoder.layers.{layer.layer_number - 1}.{rest}"
    if local_name == "output_layer.weight" and spec.tied_embeddings:
        return "embedding.word_embeddings.weight"
    return local_name


def tp_sections(chunk) -> dict[str, list[int]]:
    """This rank's section sizes of the chunk's packed tensor-parallel parameters, by name.

    A recurrent mixer's in_proj (a ColumnParallelLinear) concatenates sections that tensor
    parallelism splits one by one (Mamba: z x B C dt; gated delta net: q k v z beta alpha), and
    so does its depthwise conv1d (x B C; q k v): a rank holds its part of every section, not
    one contiguous chunk of the whole. The sizes come from the module: Mamba marks them as
    `partition_sizes` (what Megatron's resharding reads), the gated delta net keeps its in_proj
    ones as `in_proj_split_sections`, whose first three (q k v) are its conv1d channels.
    """
    sections = {name: list(param.partition_sizes) for name, param in chunk.named_parameters()
                if getattr(param, "partition_sizes", None)}
    for prefix, module in chunk.named_modules():
        split = getattr(module, "in_proj_split_sections", None)
        if split is None:
            continue
        for part, sizes in (("in_proj", list(split)), ("conv1d", list(split[:3]))):
            for name, param in getattr(module, part).named_parameters():
                assert sum(sizes) == param.shape[0], (prefix, part, name, sizes)
                sections.setdefault(f"{prefix}.{part}.{name}", sizes)
    return sections


def tp_partial_grads(chunk) -> set[str]:
    """Names of the chunk's TP-replicated parameters whose gradient is only this rank's part.

    The gated delta net's out_norm normalizes each value head and TP splits the heads, so each
    rank's gradient of the (replicated) norm sums over its heads only. Megatron sums such
    gradients over TP in finalize_model_grads only when marked sequence parallel (TENorm under
    sequence parallelism) or for q/k layernorms; the local spec's torch norms allow no sequence
    parallelism, so the harness compares the sum over TP ranks.
    """
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return set()
    return {f"{prefix}.out_norm.{name}" for prefix, module in chunk.named_modules()
            if hasattr(module, "in_proj_split_sections")
            for name, param in module.out_norm.named_parameters()
            if not getattr(param, "sequence_parallel", False)}  # else Megatron sums them


def tp_slice(param: torch.Tensor, full: torch.Tensor,
             sections: list[int] | None = None) -> torch.Tensor:
    """This rank's part of `full` (the one-rank tensor); `sections`: see tp_sections."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    if not sections:
        return full.chunk(tp, dim=param.partition_dim)[rank]
    parts = full.split([size * tp for size in sections], dim=param.partition_dim)
    return torch.cat([part.chunk(tp, dim=param.partition_dim)[rank] for part in parts],
                     dim=param.partition_dim)


def copy_weights(chunks: Iterable, ref: dict, spec: ModelSpec) -> None:
    with torch.no_grad():
        for chunk in chunks:
            chunk = unwrap(chunk)
            sections = tp_sections(chunk)
            for name, param in chunk.named_parameters():
                full = ref["state"][global_name(chunk, name, spec)]
                param.copy_(tp_slice(param, full, sections.get(name)))


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> tuple[bool, float]:
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    return err <= rtol * max(scale, 1e-30), err / max(scale, 1e-30)


def compare_grads(chunks: Iterable, ref: dict, spec: ModelSpec, rtol: float = RTOL) -> list[str]:
    """Every parameter gradient of this rank against the reference; mismatches listed."""
    problems = []
    for chunk in chunks:
        gpt = unwrap(chunk)
        sections, partial = tp_sections(gpt), tp_partial_grads(gpt)
        for name, param in gpt.named_parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if name in partial and grad is not None:
                grad = grad.clone()
                torch.distributed.all_reduce(
                    grad, group=parallel_state.get_tensor_model_parallel_group())
            expected = tp_slice(param, ref["grads"][global_name(gpt, name, spec)],
                                sections.get(name))
            if grad is None:
                problems.append(f"{name}: no gradient")
                continue
            ok, rel = _close(grad.float(), expected, rtol)
            if not ok:
                problems.append(f"{name}: max rel err {rel:.2e}")
    return problems


def compare_reports(store: list, ref: dict, group_size: int = 1, rtol: float = RTOL) -> list[str]:
    """Loss reports ([sum, tokens] per entry) against the reference, per micro-batch.

    `group_size` consecutive entries belong to one micro-batch (one per segment).
    """
    reports = torch.stack([entry["lm loss"] for entry in store])
    per_mb = reports.view(-1, group_size, 2).sum(dim=1)
    expected = ref["reports"]
    if per_mb.shape != expected.shape:
        return [f"report shape {tuple(per_mb.shape)} != {tuple(expected.shape)}"]
    ok, rel = _close(per_mb, expected, rtol)
    total = per_mb[:, 0].sum() / per_mb[:, 1].sum()
    expected_total = expected[:, 0].sum() / expected[:, 1].sum()
    problems = [] if ok else [f"loss reports: max rel err {rel:.2e}"]
    if not torch.allclose(total, expected_total, rtol=rtol, atol=0):
        problems.append(f"loss {total.item():.8f} != reference {expected_total.item():.8f}")
    return problems


def compare_moe_losses(chunks, expected: dict, actual: dict, rtol: float = RTOL) -> list[str]:
    """Reported MoE losses (aux, seq, global, z) of this rank's layers against the reference
    (a rank without MoE layers, e.g. a hybrid pattern's stage of "*-" layers, reports none)."""
    layers = [layer.layer_number - 1 for chunk in chunks
              for layer in unwrap(chunk).decoder.layers]
    if not actual and not any(values[layers].any() for values in expected.values()):
        return []
    if set(expected) != set(actual):
        return [f"MoE losses reported: {sorted(actual)}, reference {sorted(expected)}"]
    problems = []
    for name, values in expected.items():
        ok, rel = _close(actual[name][layers], values[layers], rtol)
        if not ok:
            problems.append(f"reported {name} per layer {actual[name][layers].tolist()} != "
                            f"reference {values[layers].tolist()} (rel err {rel:.2e})")
    return problems


def run_layout(
    *,
    model: ModelSpec,
    data: DataSpec,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    sp: bool = False,
    per_token: bool = False,
    forward_backward: Callable | None = None,
    prepare: Callable[[list], Any] | None = None,
    slicer: Callable[[dict], dict] | None = None,
    ddp: dict | None = None,
    config_overrides: dict | None = None,
    tamper: Callable[[list, list], None] | None = None,
    seq1f1b: dict | None = None,
    forward_only: bool = False,
    ep: int = 1,
    cp: int = 1,
    count_cp_bytes: bool = False,
) -> dict:
    """Reference vs. `forward_backward` on the layout; returns problems found on this rank.

    Data parallel size is world / (tp * pp); DP rank d gets its own slice of
    the global batch, which the reference processes as a whole. `seq1f1b`
    holds get_forward_backward_func's arguments to run Seq1F1B instead.
    """
    recorder = None
    if seq1f1b is not None:
        import megatron_seq1f1b as s1
        from megatron_seq1f1b.runtime.trace import TimelineRecorder

        recorder = TimelineRecorder()
        if count_cp_bytes:
            from megatron_seq1f1b.attention.context_parallel import ExchangedBytes

            recorder.cp_bytes = ExchangedBytes()
        forward_backward = s1.get_forward_backward_func(**seq1f1b, recorder=recorder)
        prepare, slicer = s1.enable, s1.slice_batch
    world = torch.distributed.get_world_size()
    dp = world // (tp * pp * cp)
    batches = make_batches(model, data, count=data.num_microbatches * dp)
    # Megatron's MTP rolls a packed batch per document, a dense-masked one across documents,
    # and its recurrent mixers restart only on packed ones: with MTP, Mamba-2 or gated delta
    # net layers the reference runs packed batches as packed.
    packed_reference = data.thd and (bool(dict(model.extra).get("mtp_num_layers"))
                                     or bool(set(model.hybrid) & set("MG")))
    ref = reference(model, (data, dp),
                    make_batches(model, data, count=data.num_microbatches * dp,
                                 reference=not packed_reference),
                    per_token)

    init_parallel(tp, pp, vpp, expert_model_parallel_size=ep,
                  **(dict(context_parallel_size=cp) if cp > 1 else {}))
    config = make_config(
        model, tp=tp, pp=pp, vpp=vpp, sp=sp, calculate_per_token_loss=per_token,
        **(dict(expert_model_parallel_size=ep) if ep > 1 else {}),
        **(dict(context_parallel_size=cp) if cp > 1 else {}), **(config_overrides or {}),
    )
    chunks = build_chunks(model, config)
    copy_weights(chunks, ref, model)
    if prepare is not None:
        chunks = prepare(chunks) or chunks
    models = wrap_ddp(chunks, config, **(ddp or {}))

    dp_rank = parallel_state.get_data_parallel_rank()
    m = data.num_microbatches
    mine = batches[dp_rank * m : (dp_rank + 1) * m]
    iterators = [iter(mine) for _ in models]
    fwd_bwd = forward_backward or schedules.get_forward_backward_func()
    clear_moe_losses()
    moved = _count_cp_collectives() if count_cp_bytes else contextlib.nullcontext([])
    with moved as cp_calls:
        store = fwd_bwd(
            forward_step_func=partial(forward_step, slicer=slicer,
                                      give_mask=data.model_loss_mask),
            data_iterator=iterators if len(models) > 1 else iterators[0],
            model=models if len(models) > 1 else models[0],
            num_microbatches=m,
            seq_length=model.seq_length,
            micro_batch_size=data.micro_batch_size,
            forward_only=forward_only,
        )
    if tamper is not None:
        tamper(models, store)

    problems = [] if forward_only else compare_grads(models, ref, model)
    if not forward_only:
        reported = moe_losses()
        if dp > 1:  # the reference ran every replica's micro-batches
            for values in reported.values():
                torch.distributed.all_reduce(values, group=parallel_state.get_data_parallel_group())
        problems += compare_moe_losses(models, ref["moe_losses"], reported)
        logged = mtp_losses()
        if logged is not None and dp == 1:  # the MTP stage logs what the whole sequence does
            ok, rel = _close(logged, ref["mtp_losses"], RTOL)
            if not ok:
                problems.append(f"logged MTP losses {logged.tolist()} != reference "
                                f"{ref['mtp_losses'].tolist()} (rel err {rel:.2e})")
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        group = len(store) // m if store else 1
        mine_ref = dict(ref, reports=ref["reports"][dp_rank * m : (dp_rank + 1) * m])
        if cp > 1 and not forward_only:  # each context-parallel rank reports its tokens' part
            cp_group = parallel_state.get_context_parallel_group()
            for entry in store:
                torch.distributed.all_reduce(entry["lm loss"], group=cp_group)
        problems += compare_reports(store, mine_ref, group_size=group)
    result = {"rank": torch.distributed.get_rank(), "problems": problems, "entries": len(store)}
    if recorder is not None:
        result["peak_live_units"] = recorder.last.peak_live_units
        result["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
        if count_cp_bytes:
            result["cp_bytes"] = recorder.cp_bytes.bytes
            result["cp_bytes_moved"] = sum(cp_calls)
    return result


@contextlib.contextmanager
def _count_cp_collectives():
    """Bytes this rank's CP collectives moved to or from its peers, read off the tensors
    torch.distributed was given: an all-gather's output less this rank's input, a
    reduce-scatter's input less this rank's output."""
    dist = torch.distributed
    group = parallel_state.get_context_parallel_group()
    originals = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
    moved: list[int] = []

    def all_gather(output, local, group=None, **kwargs):
        if group is cp_group:
            moved.append((output.numel() - local.numel()) * output.element_size())
        return originals[0](output, local, group=group, **kwargs)

    def reduce_scatter(output, ranked, group=None, **kwargs):
        if group is cp_group:
            moved.append((ranked.numel() - output.numel()) * ranked.element_size())
        return originals[1](output, ranked, group=group, **kwargs)

    cp_group = group
    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = all_gather, reduce_scatter
    try:
        yield moved
    finally:
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor = originals


class TEDotProductAttention(torch.nn.Module):
    """Stands in for Megatron's ``TEDotProductAttention`` over Transformer Engine 2.x, computing
    with torch, strict where they are (so tests fail where real TE would):

    * Megatron's wrapper: for ``qkv_format='thd'`` it turns ``causal`` into ``padding_causal``
      (never ``causal_bottom_right``) and passes the mask type's ``.name`` on.
    * TE: THD needs a padding mask type and ``cu_seqlens_q`` / ``cu_seqlens_kv``; per sequence
      ``padding_causal`` is aligned top-left and ``padding_causal_bottom_right`` bottom-right;
      ``causal`` (sbhd) is top-left when query and key lengths differ, ``causal_bottom_right``
      bottom-right. A given ``attention_mask``: the unfused backend ORs it into its causal
      mask, the flash and fused backends ignore it (``backend`` picks which).
    """

    calls: list = []
    backend = "flash"

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, **kwargs):
        super().__init__()
        self.config = config
        self.attn_mask_type = attn_mask_type
        self.heads = config.num_attention_heads // config.tensor_model_parallel_size
        self.scale = softmax_scale or config.kv_channels ** -0.5
        # Megatron passes the window only to windowed layers; TE stores (-1, 0) otherwise.
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                             layer_number)
        self.window_size = tuple(config.window_size) if windowed else (-1, 0)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        mask_type = attn_mask_type or self.attn_mask_type
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd and mask_type == AttnMaskType.causal:  # Megatron's wrapper, TE >= 1.7
            mask_type = AttnMaskType.padding_causal
        name = mask_type.name
        TEDotProductAttention.calls.append(
            (tuple(query.shape), tuple(key.shape), tuple(value.shape), mask_type,
             attention_mask is None,
             (packed_seq_params.cu_seqlens_q.tolist(), packed_seq_params.cu_seqlens_kv.tolist())
             if thd else None)
        )
        if thd:
            if "padding" not in name:
                raise ValueError(f"TE: qkv_format=thd needs a padding mask type, got {name}")
            if name not in ("padding_causal", "padding_causal_bottom_right"):
                raise NotImplementedError(name)
            cu_q = packed_seq_params.cu_seqlens_q.tolist()
            cu_k = packed_seq_params.cu_seqlens_kv.tolist()
            outputs = [
                self._attend(query[cu_q[i]:cu_q[i + 1]].unsqueeze(1),
                             key[cu_k[i]:cu_k[i + 1]].unsqueeze(1),
                             value[cu_k[i]:cu_k[i + 1]].unsqueeze(1),
                             name.endswith("bottom_right"), None)
                for i in range(len(cu_q) - 1)
            ]
            return torch.cat(outputs).squeeze(1)
        if "padding" in name:
            raise NotImplementedError(f"{name} without packed sequences")
        given = attention_mask if self.backend == "unfused" else None
        return self._attend(query, key, value, mask_type == AttnMaskType.causal_bottom_right, given)

    def _attend(self, query, key, value, bottom_right: bool, given):
        sq, b, heads, d = query.shape
        sk, groups = key.shape[0], key.shape[2]
        key = key.repeat_interleave(heads // groups, dim=2)
        value = value.repeat_interleave(heads // groups, dim=2)
        scores = torch.einsum("qbhd,kbhd->bhqk", query, key) * self.scale
        shift = sk - sq if bottom_right else 0
        masked = torch.ones(sq, sk, dtype=torch.bool).triu(diagonal=1 + shift)
        if self.window_size[0] >= 0:
            masked = masked | torch.ones(sq, sk, dtype=torch.bool).tril(
                diagonal=shift - self.window_size[0] - 1)
        if given is not None:
            masked = masked | given
        scores = scores.masked_fill(masked, float("-inf"))
        context = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), value)
        return context.reshape(sq, b, heads * value.shape[-1])  # MLA: value dim != query dim
