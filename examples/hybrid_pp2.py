"""Seq1F1B with Megatron-Core's HybridModel (0.18+): a Mamba-2 / attention / MLP pattern on 2
pipeline stages, Seq1F1B's losses and gradients against Megatron-Core's own 1F1B schedule.

    torchrun --nproc-per-node 2 examples/hybrid_pp2.py

The pattern ``M*-|M*-`` puts a Mamba-2 layer (``M``), an attention layer (``*``) and an MLP
(``-``) on each of the two stages (``|``). Under Seq1F1B each Mamba-2 layer carries its
convolution window and recurrent state from one segment to the next, as attention carries its
keys and values, so the segments compute what the whole sequence would.

The loop is examples/gpt_packed_pp2.py's (read its docstring first): ``s1.enable(model)``,
``s1.slice_batch`` in ``forward_step_func``, a ``(sum, tokens, report)`` loss, the schedule
from ``s1.get_forward_backward_func`` (here without installing it). The layer spec is the
project's Transformer-Engine-free one (``local_hybrid_stack_spec``): on CPU
``s1.cpu.enable()`` puts torch reference kernels where Mamba-2 looks for its CUDA ones.
Runs in seconds; tested by tests/test_examples.py.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

import megatron_seq1f1b as s1
from megatron_seq1f1b.runtime.hybrid_spec import local_hybrid_stack_spec

PATTERN = "M*-|M*-"
SEQ_LENGTH, MICRO_BATCH, VOCAB, MICROBATCHES, SPLITS = 128, 2, 128, 4, 4
RTOL = 1e-5  # fp32, dropout 0: the schedules agree to rounding
# Mamba-2's per-head A_log and dt_bias gradients are sums over every token of terms that
# nearly cancel (their largest is ~5e-6 here): summed in another order (segments), their
# rounding reaches ~1e-5 of their own size. tests/test_recurrent.py holds them to 1e-5
# at 32 tokens.
PER_HEAD_SCALARS, RTOL_PER_HEAD_SCALARS = ("mixer.A_log", "mixer.dt_bias"), 1e-4


def build_model() -> HybridModel:
    config = TransformerConfig(
        num_layers=len(PATTERN.replace("|", "")), hidden_size=64, num_attention_heads=4,
        ffn_hidden_size=256, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2,
        pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        apply_rope_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    return HybridModel(
        config=config, hybrid_stack_spec=local_hybrid_stack_spec(attention="flash"),
        vocab_size=VOCAB, max_sequence_length=SEQ_LENGTH, hybrid_layer_pattern=PATTERN,
        position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False)


def microbatches(count: int) -> list[dict]:
    gen = torch.Generator().manual_seed(7)  # the same data on every rank
    shape = (MICRO_BATCH, SEQ_LENGTH)
    return [dict(tokens=torch.randint(0, VOCAB, shape, generator=gen),
                 labels=torch.randint(0, VOCAB, shape, generator=gen),
                 loss_mask=(torch.rand(shape, generator=gen) > 0.1).float(),
                 position_ids=torch.arange(SEQ_LENGTH).expand(shape).contiguous(),
                 attention_mask=None)  # causal; no [s, s] mask
            for _ in range(count)]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().reshape(-1) * loss_mask.reshape(-1)
    loss, tokens = losses.sum(), loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def forward_step(data_iterator, model):
    batch = s1.slice_batch(next(data_iterator))  # Seq1F1B: this segment's tokens (else as is)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_step(forward_backward, model, batches) -> tuple[list[float], dict]:
    """Each micro-batch's loss (last stage; one report per micro-batch, Seq1F1B's the sum of its
    segments') and this stage's gradients."""
    model.zero_grad(set_to_none=True)
    store = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                             model=model, num_microbatches=len(batches),
                             seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH)
    sums = torch.stack([r["lm loss"] for r in store]) if store else torch.zeros(0, 2)
    return (sums[:, 0] / sums[:, 1]).tolist(), {n: p.grad.clone()
                                                 for n, p in model.named_parameters()}


def main() -> int:
    s1.cpu.enable()  # Megatron-Core on CPU, Mamba-2's reference kernels: this process only
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    model = build_model()
    s1.enable(model)  # Seq1F1B: attention and Mamba-2 carry their state across segments
    batches = microbatches(MICROBATCHES)

    megatron_losses, megatron_grads = train_step(get_forward_backward_func(), model, batches)
    seq1f1b = s1.get_forward_backward_func(SPLITS, "balanced")  # equal FLOPs per segment
    seq1f1b_losses, seq1f1b_grads = train_step(seq1f1b, model, batches)

    worst = torch.zeros(2)  # largest relative gradient difference: others, Mamba's scalars
    for name, grad in seq1f1b_grads.items():
        expected = megatron_grads[name]
        error = float((grad - expected).abs().max() / expected.abs().max())
        which = int(name.endswith(PER_HEAD_SCALARS))
        worst[which] = max(float(worst[which]), error)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    ok = torch.tensor([all(abs(a - b) <= RTOL * abs(b)
                           for a, b in zip(seq1f1b_losses, megatron_losses))
                       and worst[0] <= RTOL and worst[1] <= RTOL_PER_HEAD_SCALARS],
                      dtype=torch.int)
    torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    if parallel_state.is_pipeline_last_stage():
        print(f"HybridModel {PATTERN!r}, pipeline 2, {MICROBATCHES} micro-batches of "
              f"{MICRO_BATCH} x {SEQ_LENGTH} tokens: Seq1F1B k={SPLITS} (balanced) vs "
              "Megatron-Core 1F1B")
        print("micro-batch  Megatron loss  Seq1F1B loss  relative difference")
        for i, (a, b) in enumerate(zip(megatron_losses, seq1f1b_losses)):
            print(f"{i:>11}  {a:>13.6f}  {b:>12.6f}  {abs(a - b) / abs(a):.1e}")
        print(f"largest relative gradient difference: {worst[0]:.1e} (Mamba-2's A_log and "
              f"dt_bias: {worst[1]:.1e})")
        print(f"equal within {RTOL:g} ({RTOL_PER_HEAD_SCALARS:g})" if ok.item()
              else f"NOT equal within {RTOL:g} ({RTOL_PER_HEAD_SCALARS:g})")
    torch.distributed.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
