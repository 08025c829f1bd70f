"""One ``forward_data_store`` entry per micro-batch, as Megatron's schedules return it.

``loss_func`` runs once per segment; frameworks index the store by micro-batch (RL
trainers read per-token log-probabilities of micro-batch ``i`` from entry ``i``). The last
stage forwards a micro-batch's segments in order, so once its last segment is forwarded
their reports are joined into one entry:

* a tensor with a token dimension (size the segment's tokens on this rank, per sample or
  for the ``b`` samples flattened) is concatenated along it, in segment order: per-token
  log-probabilities, entropies, losses;
* any other tensor (Megatron's ``[loss sum, token count]`` pairs and scalars first, whatever
  the segment's length) and any number is summed, Megatron's convention for the triple ``(loss_sum, num_tokens, report)``
  (its training loop sums the entries anyway);
* in the 2-tuple form ``(loss, report)``, which Megatron takes as a mean per micro-batch,
  a value that is not per-token cannot be joined (a mean over one segment's tokens is not
  the micro-batch's): refused, saying how to return it;
* values that are neither (``collect_non_loss_data``'s free form, or ``loss_func=None``'s
  output) become the tuple of the segments' values.

A micro-batch of one segment keeps its report as it is. With context parallelism a rank
holds two chunks of every segment, not of the micro-batch: per-token values cannot be laid
out as Megatron's CP ranks hold them, so joining them is refused.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_seq1f1b.base.checks import ConfigError


class MicrobatchReports:
    """Segments' reports of the micro-batches in flight on the last stage (one iteration)."""

    def __init__(self, microbatch_lengths: Sequence[Sequence[int]], micro_batch_size: int,
                 cp_size: int = 1):
        self.lengths = microbatch_lengths
        self.b, self.cp = micro_batch_size, cp_size
        self._open: dict[tuple[int, int], list] = {}

    def add(self, microbatch: int, segment: int, chunk: int, report: Any,
            mean_form: bool = False, free_form: bool = False):
        """Keep one segment's report; returns the micro-batch's entry after its last segment
        (None before)."""
        lengths = self.lengths[microbatch]
        if len(lengths) == 1:
            return report
        key = (microbatch, chunk)
        reports = self._open.setdefault(key, [])
        reports.append(report)
        if segment < len(lengths) - 1:
            return None
        del self._open[key]
        tokens = [n // self.cp for n in lengths]
        return _merge(reports, tokens, self.b, self.cp, mean_form, free_form, "report")


def _merge(values: list, tokens: list[int], b: int, cp: int, mean_form: bool, free_form: bool,
           where: str):
    first = values[0]
    if isinstance(first, dict):
        return {key: _merge([v[key] for v in values], tokens, b, cp, mean_form, free_form,
                            f"{where}[{key!r}]")
                for key in first}
    if isinstance(first, torch.Tensor):
        same = all(v.shape == first.shape for v in values)
        if same and not mean_form and not free_form and first.numel() <= 2:
            return sum(values[1:], first)  # a scalar or Megatron's [sum, count] pair
        dim = _token_dim(values, tokens, b)
        if dim is not None:
            if cp > 1:
                raise ConfigError([
                    f"loss_func's {where} holds per-token values, and with context "
                    "parallelism each rank holds two chunks of every segment, not of the "
                    "micro-batch: they cannot be joined in Megatron's order; report sums "
                    "instead, or run context_parallel_size=1"])
            return torch.cat(values, dim=dim)
        if same and not free_form and not mean_form:
            return sum(values[1:], first)
    elif isinstance(first, (int, float)) and not isinstance(first, bool) and not free_form \
            and not mean_form:
        return sum(values)
    if mean_form:
        raise ConfigError([
            f"loss_func returned (loss, report) and its {where} is not per-token: with "
            "segments each call sees part of the micro-batch, and a per-segment value of a "
            "mean cannot be joined into the micro-batch's; return Megatron's triple "
            "(loss_sum, num_tokens, report) with sums, or per-token tensors"])
    if free_form:
        return tuple(values)
    raise ConfigError([f"loss_func's {where} is neither per-token nor a sum that segments "
                       "can add up (shapes differ between segments)"])


def _token_dim(values: list[torch.Tensor], tokens: list[int], b: int) -> int | None:
    """The dimension that holds each segment's tokens (per sample, or ``b`` samples
    flattened), the same in every segment; None if there is none."""
    first = values[0]
    for dim in range(first.dim()):
        for scale in (1, b) if b > 1 else (1,):
            if all(v.dim() == first.dim() and v.shape[dim] == n * scale
                   and v.shape[:dim] + v.shape[dim + 1:] == first.shape[:dim] + first.shape[dim + 1:]
                   for v, n in zip(values, tokens)):
                return dim
    return None
