"""Loss normalization per segment, so results equal full-sequence training.

``loss_func`` returns Megatron's ``(loss_sum, num_tokens, report)`` for one
segment. Full-sequence training divides a micro-batch's loss by its token
count and by the number of micro-batches, but a segment knows only its own
tokens. On the last stage every segment of a micro-batch is forwarded before
the micro-batch's first backward (segment k-1), so :meth:`SegmentLosses.scaled`
divides at backward time, by the micro-batch's total. Reports stay
``[sum, tokens]`` per segment; Megatron's training loop sums them, so logged
losses are exact too. With ``calculate_per_token_loss`` nothing is divided
and the total token count goes to ``finalize_model_grads``, as in Megatron.
"""

from __future__ import annotations

import torch

from megatron_seq1f1b.schedule import Action

TWO_TUPLE_ERROR = (
    "Seq1F1B: loss_func returned a 2-tuple (mean loss, report). With num_splits > 1 each call "
    "sees one segment, and a per-segment mean cannot be weighted into the micro-batch's mean. "
    "Return Megatron's triple (loss_sum, num_tokens, report), as pretrain_gpt.py's loss_func does."
)


class _Microbatch:
    def __init__(self):
        self.sums: dict[int, torch.Tensor] = {}
        self.tokens: torch.Tensor | None = None
        self.legacy = False  # a 2-tuple mean loss (only with one segment)


class SegmentLosses:
    """Loss sums of the micro-batches in flight on the last stage, for one iteration."""

    def __init__(self, num_microbatches: int, num_splits: int, cp_size: int,
                 per_token: bool, device: torch.device):
        self.m, self.k, self.cp_size, self.per_token = num_microbatches, num_splits, cp_size, per_token
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
        if len(result) == 2 and self.k == 1:
            loss, report = result  # Megatron's legacy mean loss per micro-batch
            entry.sums[0] = loss * self.cp_size / self.m
            entry.legacy = True
            return loss, report
        raise ValueError(TWO_TUPLE_ERROR)

    def scaled(self, action: Action) -> torch.Tensor:
        """The loss to backpropagate: the segment's sum / micro-batch tokens / m."""
        key = (action.microbatch, action.chunk)
        entry = self._open[key]
        loss = entry.sums.pop(action.segment)
        if not entry.sums:
            del self._open[key]
        if entry.legacy or self.per_token:
            return loss
        return loss / torch.clamp(entry.tokens, min=1) / self.m

    def close(self) -> None:
        if self._open:
            raise RuntimeError(f"Seq1F1B: losses of {sorted(self._open)} were never backwarded")
