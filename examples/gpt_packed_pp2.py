"""Seq1F1B in your own Megatron-Core loop: a GPTModel on 2 pipeline stages, packed (THD)
micro-batches, Seq1F1B's losses and gradients against Megatron-Core's own 1F1B schedule.

    torchrun --nproc-per-node 2 examples/gpt_packed_pp2.py

What Seq1F1B asks of a training loop (each marked "Seq1F1B:" below):

1. ``s1.enable(model)`` once the model is built: attention carries keys and values from
   segment to segment, RoPE takes the segment's offset; parameters and ``state_dict`` do not
   change, and outside a Seq1F1B schedule the model runs as before.
2. ``s1.slice_batch(batch)`` in ``forward_step_func``: the schedule calls it once per segment
   and every call's ``next(data_iterator)`` returns the same micro-batch, which it cuts to the
   segment (packed ``cu_seqlens`` included). Forgetting it fails with a message naming it.
3. A ``loss_func`` that returns Megatron's triple ``(loss sum, token count, report)``.
4. The schedule: ``s1.install(...)`` makes Megatron-Core's ``get_forward_backward_func()``
   return Seq1F1B's function, even where it was imported by name before (as here);
   ``s1.get_forward_backward_func(...)`` gives the same function without installing it.

On CPU (gloo), as here: ``s1.cpu.enable()`` before anything else, the flash layer spec
(packed THD attention without Transformer Engine), ``apply_rope_fusion=False`` and Megatron's
other CUDA fusions off, untied embeddings. Runs in seconds; tested by tests/test_examples.py.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

import megatron_seq1f1b as s1
from megatron_seq1f1b.attention.flash import flash_layer_spec

SEQ_LENGTH, VOCAB, MICROBATCHES, SPLITS = 128, 128, 4, 4
RTOL = 1e-5  # fp32, dropout 0: the schedules agree to rounding


def build_model() -> GPTModel:
    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
        pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        # CUDA kernels Megatron would otherwise call (the fused RoPE takes no segment offset)
        apply_rope_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=flash_layer_spec(get_gpt_layer_local_spec()),  # SDPA, THD-capable
        vocab_size=VOCAB, max_sequence_length=SEQ_LENGTH, position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False)


def packed_microbatches(count: int) -> list[dict]:
    """Micro-batches of one packed sequence each: documents of random lengths, positions
    restarting per document, ``cu_seqlens`` / ``max_seqlen`` as Megatron-LM's packed data."""
    gen = torch.Generator().manual_seed(7)  # the same data on every rank
    batches = []
    for _ in range(count):
        cuts = torch.randperm(SEQ_LENGTH - 1, generator=gen)[:4].add(1).sort().values.tolist()
        bounds = [0, *cuts, SEQ_LENGTH]
        position_ids = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
        batches.append(dict(
            tokens=torch.randint(0, VOCAB, (1, SEQ_LENGTH), generator=gen),
            labels=torch.randint(0, VOCAB, (1, SEQ_LENGTH), generator=gen),
            loss_mask=(torch.rand(1, SEQ_LENGTH, generator=gen) > 0.1).float(),
            position_ids=position_ids.unsqueeze(0),
            cu_seqlens=torch.tensor([bounds], dtype=torch.int32),
            max_seqlen=torch.tensor([max(b - a for a, b in zip(bounds, bounds[1:]))])))
    return batches


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Seq1F1B: Megatron's triple; the schedule divides by the micro-batch's token count."""
    losses = output_tensor.float().view(-1) * loss_mask.view(-1)
    loss, tokens = losses.sum(), loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def forward_step(data_iterator, model):
    batch = s1.slice_batch(next(data_iterator))  # Seq1F1B: this segment's tokens (else as is)
    cu_seqlens = batch["cu_seqlens"].squeeze(0)
    longest = int(batch["max_seqlen"])
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=packed)
    return output, partial(loss_func, batch["loss_mask"])


def train_step(forward_backward, model, batches) -> tuple[list[float], dict]:
    """One forward-backward over the micro-batches: each micro-batch's loss (last stage), and
    this stage's gradients."""
    model.zero_grad(set_to_none=True)
    store = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                             model=model, num_microbatches=len(batches),
                             seq_length=SEQ_LENGTH, micro_batch_size=1)
    # One report per micro-batch (both schedules; Seq1F1B sums its segments' [sum, tokens]):
    # each micro-batch's loss is its sum over its tokens / its token count.
    sums = torch.stack([r["lm loss"] for r in store]) if store else torch.zeros(0, 2)
    return (sums[:, 0] / sums[:, 1]).tolist(), {n: p.grad.clone()
                                                 for n, p in model.named_parameters()}


def main() -> int:
    s1.cpu.enable()  # Megatron-Core on CPU: this process only
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    model = build_model()
    s1.enable(model)  # Seq1F1B: segments can run on it now; nothing else changes
    batches = packed_microbatches(MICROBATCHES)

    megatron_losses, megatron_grads = train_step(get_forward_backward_func(), model, batches)
    # Seq1F1B: k segments per micro-batch, cut where its documents make equal work
    seq1f1b = s1.install(SPLITS, "documents", documents="cu_seqlens")
    assert get_forward_backward_func() is seq1f1b  # this module's name was rebound
    seq1f1b_losses, seq1f1b_grads = train_step(get_forward_backward_func(), model, batches)
    s1.uninstall()

    worst = max(float((a - megatron_grads[n]).abs().max() / megatron_grads[n].abs().max())
                for n, a in seq1f1b_grads.items())
    worst = torch.tensor([worst])
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    ok = torch.tensor([all(abs(a - b) <= RTOL * abs(b)
                           for a, b in zip(seq1f1b_losses, megatron_losses))
                       and worst.item() <= RTOL], dtype=torch.int)
    torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    if parallel_state.is_pipeline_last_stage():
        print(f"GPTModel, pipeline 2, {MICROBATCHES} packed micro-batches of {SEQ_LENGTH} tokens:"
              f" Seq1F1B k={SPLITS} (documents partition) vs Megatron-Core 1F1B")
        print("micro-batch  documents  Megatron loss  Seq1F1B loss  relative difference")
        for i, (a, b) in enumerate(zip(megatron_losses, seq1f1b_losses)):
            documents = batches[i]["cu_seqlens"].numel() - 1
            print(f"{i:>11}  {documents:>9}  {a:>13.6f}  {b:>12.6f}  {abs(a - b) / abs(a):.1e}")
        print(f"largest relative gradient difference, every parameter: {worst.item():.1e}")
        print(f"equal within {RTOL:g}" if ok.item() else f"NOT equal within {RTOL:g}")
    torch.distributed.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
