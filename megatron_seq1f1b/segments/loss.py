"""Loss normalization per segment, so results equal full-sequence training.

``loss_func`` returns Megatron's ``(loss_sum, num_tokens, report)`` for one
segment. Full-sequence training divides a micro-batch's loss by its token
count and by the number of micro-batches, but a segment knows only its own
tokens. On the last stage every segment of a micro-batch is forwarded before
the micro-batch's first backward (segment k-1), so :meth:`SegmentLosses.scaled`
divides at backward time, by the micro-batch's total (runs of documents going
backward apart, ``backward_by_documents``, need ``calculate_per_token_loss``,
which divides nothing). Reports stay
``[sum, tokens]`` per segment; Megatron's training loop sums them, so logged
losses are exact too. With ``calculate_per_token_loss`` nothing is divided
and the total token count goes to ``finalize_model_grads``, as in Megatron.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_seq1f1b.schedules.schedule import Action

TWO_TUPLE_ERROR = (
    "Seq1F1B: loss_func returned a 2-tuple (mean loss, report). With num_splits > 1 each call "
    "sees one segment, and a per-segment mean cannot be weighted into the micro-batch's mean. "
    "Return Megatron's triple (loss_sum, num_tokens, report), as pretrain_gpt.py's loss_func does "
    "(a loss whose weights depend on the whole micro-batch, e.g. per-sequence means: give each "
    "token its weight and return the weighted sum; docs/variable_lengths.md). A forward-only "
    "pass may return the 2-tuple: its per-token report tensors are joined per micro-batch."
)


class _Microbatch:
    def __init__(self):
        self.sums: dict[int, torch.Tensor] = {}
        self.tokens: torch.Tensor | None = None
        self.tokens_summed = False  # over the context-parallel group
        self.legacy = False  # a 2-tuple mean loss (only with one segment)


class SegmentLosses:
    """Loss sums of the micro-batches in flight on the last stage, for one iteration."""

    def __init__(self, num_microbatches: int, num_splits: int | Sequence[int], cp_size: int,
                 per_token: bool, device: torch.device, cp_group=None):
        self.m, self.cp_size, self.per_token = num_microbatches, cp_size, per_token
        self.counts = (tuple(num_splits) if not isinstance(num_splits, int)
                       else (num_splits,) * num_microbatches)  # segments per micro-batch
        self.cp_group = cp_group if cp_size > 1 else None
        self.total_tokens = torch.zeros([], dtype=torch.int, device=device)
        self._open: dict[tuple[int, int], _Microbatch] = {}

    def record(self, action: Action, result) -> tuple[torch.Tensor, object]:
        """Keep a segment's ``loss_func`` result; return (loss to keep, report)."""
        entry = self._open.setdefault((action.microbatch, action.chunk), _Microbatch())
        if len(result) == 3:
            loss_sum, num_tokens, report = result
            self.total_tokens += num_tokens
            entry.sums[action.segment] = loss_sum
            entry.tokens = num_tokens if entry.tokens is None else entry.tokens + num_tokens
            return loss_sum, report
        if len(result) == 2 and self.counts[action.microbatch] == 1:
            loss, report = result  # Megatron's legacy mean loss per micro-batch
            entry.sums[0] = loss * self.cp_size / self.m
            entry.legacy = True
            return loss, report
        raise ValueError(TWO_TUPLE_ERROR)

    def scaled(self, action: Action) -> torch.Tensor:
        """The loss to backpropagate: the segment's sum / micro-batch tokens / m.

        With context parallelism each rank holds part of the micro-batch's tokens: they
        are summed over the CP group (one small all-reduce per micro-batch, at its first
        backward, in the same order on every CP rank), and the loss is multiplied by the
        CP size because Megatron's DDP averages gradients over data- x context-parallel
        ranks (as Megatron scales its own CP losses).
        """
        key = (action.microbatch, action.chunk)
        entry = self._open[key]
        if self.cp_group is not None and not entry.legacy and not self.per_token \
                and not entry.tokens_summed:
            import torch.distributed as dist

            from megatron_seq1f1b.segments.cp_group import collective

            entry.tokens = entry.tokens.clone()
            collective("sum of a micro-batch's tokens", self.cp_group,
                       lambda: dist.all_reduce(entry.tokens, group=self.cp_group))
            entry.tokens_summed = True
        loss = entry.sums.pop(action.segment)
        if not entry.sums:
            del self._open[key]
        if entry.legacy or self.per_token:
            return loss
        return loss / torch.clamp(entry.tokens, min=1) / self.m * self.cp_size

    def close(self) -> None:
        if self._open:
            raise RuntimeError(f"Seq1F1B: losses of {sorted(self._open)} were never backwarded")


def auxiliary_loss_scale(config, scale_func: str, num_microbatches: int,
                         context_parallel: bool) -> torch.Tensor:
    """The backward scale Megatron's forward step gives an auxiliary loss that rides on the
    activations (MoE router losses, MTP losses): ``config.<scale_func>()`` where the config
    has one, else the loss scale (``grad_scale_func``), else 1; over the number of
    micro-batches (times the context-parallel size where ``context_parallel``), or as it is
    with per-token loss."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    own = getattr(config, scale_func, None)
    if own is not None:
        scale = torch.as_tensor(own(), device=device, dtype=torch.float32).reshape(1)
    elif config.grad_scale_func is not None:
        scale = config.grad_scale_func(torch.ones(1, device=device))
    else:
        scale = torch.ones(1, device=device)
    if config.calculate_per_token_loss:
        return scale
    cp = (getattr(config, "context_parallel_size", 1) or 1) if context_parallel else 1
    return scale * cp / num_microbatches

