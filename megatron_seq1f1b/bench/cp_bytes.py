"""Context-parallel bytes in the benchmark: what each Seq1F1B row's CP group exchanged per
iteration, measured, next to the planner's count of it.

The executor counts the bytes a rank sends in its CP group (all-gather of a segment's keys
and values in the forward, reduce-scatter of their gradients in the backward) into
``recorder.cp_bytes`` (an :class:`~megatron_seq1f1b.attention.context_parallel.ExchangedBytes`).
The benchmark times its runs without a timeline recorder, so :class:`ByteMeter` is a
recorder that only counts: its ``begin`` returns no iteration record, which turns every
timing call of the executor off, and counts the runs so that bytes divide per iteration.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron_seq1f1b.attention.context_parallel import ExchangedBytes, exchanged_bytes
from megatron_seq1f1b.bench.lineup import BenchSchedule


class ByteMeter:
    """A recorder that records nothing but the CP bytes and the number of iterations."""

    def __init__(self) -> None:
        self.cp_bytes = ExchangedBytes()
        self.runs = 0

    def begin(self, rank: int) -> None:
        """Called once per forward-backward; no record, so the executor times nothing."""
        self.runs += 1
        return None


def attach_meters(schedules: list[BenchSchedule]) -> dict[str, ByteMeter]:
    """Give every Seq1F1B row a forward-backward that counts its CP bytes; meters by key.

    Each run of a row exchanges the same bytes, so every run it makes (warm-up, measured,
    confirmation) counts; recorded timelines and profiles run their own functions.
    """
    meters = {}
    for s in schedules:
        if s.megatron:
            continue
        meters[s.key] = ByteMeter()
        s.fb = s.forward_backward(recorder=meters[s.key])
    return meters


def measured_bytes(meters: dict[str, ByteMeter]) -> dict[str, float]:
    """Bytes per iteration per rank of every metered row, the most any rank sent
    (collective: every rank holds the same keys in the same order)."""
    keys = sorted(meters)
    if not keys:
        return {}
    mine = torch.tensor([meters[k].cp_bytes.bytes / max(meters[k].runs, 1) for k in keys],
                        dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return {k: float(v) for k, v in zip(keys, mine.tolist())}


def kv_bytes_per_token(config, tp: int, bf16: bool) -> float:
    """Keys and values of one token of one layer on one tensor-parallel rank."""
    groups = config.num_query_groups or config.num_attention_heads
    channels = config.kv_channels or config.hidden_size // config.num_attention_heads
    return 2.0 * groups / tp * channels * (2 if bf16 else 4)


def predicted_bytes(sched: BenchSchedule, args: argparse.Namespace, config) -> float:
    """The planner's count (:func:`~megatron_seq1f1b.attention.context_parallel.exchanged_bytes`) for
    one rank per iteration: the row's segments on a stage's layers, times m micro-batches."""
    per_microbatch = exchanged_bytes(
        sched.lengths, args.num_layers // args.pp, kv_bytes_per_token(config, args.tp, args.bf16),
        args.context_parallel_size, args.micro_batch_size)
    return per_microbatch * args.microbatches
