"""Variable-length micro-batches, as post-training frameworks drive Megatron-Core: packed (THD)
micro-batches of different lengths, ``variable_seq_lengths=True``, a token budget per segment;
Seq1F1B's losses and gradients against Megatron-Core's own 1F1B on the same micro-batches,
then a log-probability pass (``forward_only``) that returns one entry per micro-batch.

    torchrun --nproc-per-node 2 examples/variable_lengths_pp2.py

What differs from a fixed-length loop (each marked "Seq1F1B:" below):

1. ``config.variable_seq_lengths = True`` (Megatron's flag; it needs the MoE ``alltoall``
   dispatcher setting even without experts). ``seq_length`` is then ignored: pass the longest.
2. ``s1.get_forward_backward_func(num_splits, partition, segment_tokens=T)``: a micro-batch of
   ``S`` tokens gets ``ceil(S / T)`` segments (at most ``num_splits``); a short one stays whole.
   Every stage learns the lengths once per iteration, before any message.
3. The store holds one entry per micro-batch, as Megatron's: per-token tensors of a report
   are joined across the micro-batch's segments, ``[sum, count]`` pairs summed.

CPU notes as in gpt_packed_pp2.py. Runs in seconds; tested by tests/test_examples.py.
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

LENGTHS = [384, 48, 192, 96]  # tokens per micro-batch: 8x apart
VOCAB, BUDGET, CAP = 128, 64, 16
RTOL = 1e-5  # fp32, dropout 0: the schedules agree to rounding


def build_model() -> GPTModel:
    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
        pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",  # Seq1F1B: Megatron's flag
        calculate_per_token_loss=True,  # as RL trainers often run
        apply_rope_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    return GPTModel(
        config=config, transformer_layer_spec=flash_layer_spec(get_gpt_layer_local_spec()),
        vocab_size=VOCAB, max_sequence_length=max(LENGTHS), position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False)


def microbatches() -> list[dict]:
    """One packed micro-batch per length: two documents (sequences) each."""
    gen = torch.Generator().manual_seed(7)  # the same data on every rank
    batches = []
    for n in LENGTHS:
        bounds = [0, n // 3, n]
        batches.append(dict(
            tokens=torch.randint(0, VOCAB, (1, n), generator=gen),
            labels=torch.randint(0, VOCAB, (1, n), generator=gen),
            loss_mask=(torch.rand(1, n, generator=gen) > 0.1).float(),
            position_ids=torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
            .unsqueeze(0),
            cu_seqlens=torch.tensor([bounds], dtype=torch.int32),
            max_seqlen=torch.tensor([max(b - a for a, b in zip(bounds, bounds[1:]))])))
    return batches


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1) * loss_mask.view(-1)
    loss, tokens = losses.sum(), loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def logprob_func(output_tensor: torch.Tensor):
    """A log-probability pass as RL trainers write it: Megatron's 2-tuple, per-token values."""
    return output_tensor.float().mean(), {"logprobs": -output_tensor.detach().float()}


def forward_step(data_iterator, model, forward_only_pass: bool = False):
    batch = s1.slice_batch(next(data_iterator))  # this segment's part (identity otherwise)
    cu_seqlens = batch["cu_seqlens"].squeeze(0)
    longest = int(batch["max_seqlen"])
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=packed)
    return output, (logprob_func if forward_only_pass else partial(loss_func, batch["loss_mask"]))


def run(forward_backward, model, batches, forward_only: bool = False) -> list:
    model.zero_grad(set_to_none=True)
    return forward_backward(forward_step_func=partial(forward_step, forward_only_pass=forward_only),
                            data_iterator=iter(batches), model=model,
                            num_microbatches=len(batches), seq_length=max(LENGTHS),
                            micro_batch_size=1, forward_only=forward_only)


def main() -> int:
    s1.cpu.enable()
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    model = build_model()
    s1.enable(model)
    batches = microbatches()
    seq1f1b = s1.get_forward_backward_func(CAP, "documents", segment_tokens=BUDGET,  # Seq1F1B
                                           documents="cu_seqlens")

    megatron_store = run(get_forward_backward_func(), model, batches)
    megatron_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    seq1f1b_store = run(seq1f1b, model, batches)
    worst = max(float((p.grad - megatron_grads[n]).abs().max() / megatron_grads[n].abs().max())
                for n, p in model.named_parameters())
    megatron_logprobs = run(get_forward_backward_func(), model, batches, forward_only=True)
    seq1f1b_logprobs = run(seq1f1b, model, batches, forward_only=True)

    worst = torch.tensor([worst])
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    ok = worst.item() <= RTOL
    if parallel_state.is_pipeline_last_stage():
        print(f"GPTModel, pipeline 2, variable_seq_lengths: micro-batches of {LENGTHS} tokens, "
              f"Seq1F1B with {BUDGET} tokens per segment vs Megatron-Core 1F1B")
        print("micro-batch  tokens  segments  Megatron loss  Seq1F1B loss  log-probs equal")
        for i, (a, b) in enumerate(zip(megatron_store, seq1f1b_store)):
            la, lb = (float(x["lm loss"][0] / x["lm loss"][1]) for x in (a, b))
            same = torch.allclose(seq1f1b_logprobs[i]["logprobs"],
                                  megatron_logprobs[i]["logprobs"], rtol=RTOL, atol=1e-6)
            ok = ok and abs(la - lb) <= RTOL * abs(la) and same
            segments = -(-LENGTHS[i] // BUDGET)
            print(f"{i:>11}  {LENGTHS[i]:>6}  {segments:>8}  {la:>13.6f}  {lb:>12.6f}  {same}")
        print(f"store entries: Megatron {len(megatron_logprobs)}, Seq1F1B {len(seq1f1b_logprobs)}"
              " (one per micro-batch)")
        print(f"largest relative gradient difference, every parameter: {worst.item():.1e}")
    flag = torch.tensor([int(ok)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    if parallel_state.is_pipeline_last_stage():
        print(f"equal within {RTOL:g}" if flag.item() else f"NOT equal within {RTOL:g}")
    torch.distributed.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main())
