"""``--variable-seq-lengths``: micro-batches of their own length, at most ``--seq-length``.

Post-training packs each micro-batch to its own length and runs Megatron-Core with
``variable_seq_lengths=True``; the trainer makes such micro-batches from its samples, in one
of two modes:

* ``documents``: each sample (``--seq-length`` tokens of the dataset's concatenated
  documents) is cut where its last whole document ends, so a micro-batch holds whole
  documents plus, where a document is longer than what is left, that document's head: bins
  of varying size up to ``--seq-length``. A sample that is one document, or ends with an
  end-of-document token, stays whole. Documents end at end-of-document tokens, or where the
  dataset cut them into the sample with ``--dataloader-inter-document-masking``. One sample
  per micro-batch (``--micro-batch-size 1``), as packed post-training batches are.
* ``lognormal``: the length of global micro-batch ``i`` is drawn from a log-normal
  distribution seeded by ``--seed`` and ``i`` alone, clipped to
  ``[--variable-seq-lengths-min, --seq-length]``, its median their geometric mean, its
  spread ``--variable-seq-lengths-sigma``; every sample of the micro-batch is cut to it.

Lengths are rounded down to the layout's multiple (the tensor-parallel size with sequence
parallelism, 2 x the context-parallel size). A length depends on the micro-batch's global
index and its samples only, so every pipeline stage and every rank of a data-parallel
replica computes the same one without a message (Seq1F1B's stages still check that they
agree: :mod:`megatron_seq1f1b.segments.length_plan`). Cutting drops the tail of a sample; no
micro-batch is padded, so every token counted is a real one.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy
import torch

from megatron_seq1f1b.base.checks import segment_multiple
from megatron_seq1f1b.segments.documents import Documents

DOCUMENTS, LOGNORMAL = "documents", "lognormal"
MODES = (DOCUMENTS, LOGNORMAL)
DEFAULT_SIGMA = 0.8
#: --variable-seq-lengths-min by default: this fraction of --seq-length (lognormal).
DEFAULT_MIN_FRACTION = 16
#: The part of the seed that tells training micro-batches from validation ones.
SPLIT_SALT = {"train": 0, "valid": 1}

_SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")

#: length(global micro-batch index, collated micro-batch) -> its tokens
LengthRule = Callable[[int, dict], int]


def shortest(args) -> int:
    """The shortest length ``lognormal`` draws (``--variable-seq-lengths-min`` or 1/16 of
    ``--seq-length``), rounded up to the layout's multiple."""
    multiple = segment_multiple(args)
    low = args.variable_seq_lengths_min or max(args.seq_length // DEFAULT_MIN_FRACTION, 1)
    return min(math.ceil(low / multiple) * multiple, args.seq_length)


def lognormal_length(index: int, *, seed: int, salt: int, low: int, high: int, sigma: float,
                     multiple: int = 1) -> int:
    """Tokens of global micro-batch ``index``: log-normal with median ``sqrt(low * high)``,
    clipped to ``[low, high]``, rounded down to ``multiple``; a function of its arguments
    only (``numpy``'s generator seeded by ``(seed, salt, index)``)."""
    draw = numpy.random.default_rng([seed, salt, index]).lognormal(
        math.log(math.sqrt(low * high)), sigma)
    length = int(min(max(draw, low), high))
    return max(multiple, length // multiple * multiple)


def document_length(batch: dict, eod: int, multiple: int = 1) -> int:
    """Where a one-sample micro-batch's last whole document ends (the whole sample if it
    is one document or ends with an end-of-document token), rounded down to ``multiple``."""
    tokens = batch["tokens"]
    s = tokens.shape[-1]
    if "cu_seqlens" in batch:  # the dataset's boundaries; its last part is cut by the sample
        starts = Documents.from_cu_seqlens(batch["cu_seqlens"], s).starts[0]
        end = starts[-1] if len(starts) > 1 else s
    elif int(tokens[0, -1]) == eod:
        end = s
    else:
        starts = Documents.from_eod(tokens, eod).starts[0]
        end = starts[-1] if len(starts) > 1 else s
    end = end // multiple * multiple
    return end if end > 0 else s


def cut(batch: dict, length: int) -> dict:
    """A collated micro-batch's first ``length`` tokens: the per-token fields, a dense
    ``[b, 1, s, s]`` mask, and the dataset's ``cu_seqlens`` rows (``[b, n]`` padded with the
    length, as the dataset pads them) and ``max_seqlen``."""
    s = batch["tokens"].shape[-1]
    if length == s:
        return batch
    out = dict(batch)
    for key in _SEQUENCE_KEYS:
        if key in batch:
            out[key] = batch[key][..., :length].contiguous()
    if batch.get("attention_mask") is not None:
        out["attention_mask"] = batch["attention_mask"][..., :length, :length].contiguous()
    if "cu_seqlens" in batch:
        rows = [[v for v in row if v < length] + [length]
                for row in batch["cu_seqlens"].reshape(-1, batch["cu_seqlens"].shape[-1]).tolist()]
        width = max(len(row) for row in rows)
        out["cu_seqlens"] = torch.tensor([row + [length] * (width - len(row)) for row in rows],
                                         dtype=batch["cu_seqlens"].dtype)
        longest = [max(b - a for a, b in zip(row, row[1:])) for row in rows]
        out["max_seqlen"] = torch.tensor(longest, dtype=batch["max_seqlen"].dtype).reshape(
            batch["max_seqlen"].shape)
    return out


def length_rule(args, eod: int, split: str = "train") -> LengthRule | None:
    """The rule of ``--variable-seq-lengths`` (None: every micro-batch ``--seq-length``)."""
    mode = getattr(args, "variable_seq_lengths", None)
    if mode is None:
        return None
    multiple = segment_multiple(args)
    if mode == DOCUMENTS:
        return lambda index, batch: document_length(batch, eod, multiple)
    low, high = shortest(args), args.seq_length
    sigma, seed, salt = args.variable_seq_lengths_sigma, args.seed, SPLIT_SALT[split]
    return lambda index, batch: lognormal_length(index, seed=seed, salt=salt, low=low,
                                                 high=high, sigma=sigma, multiple=multiple)


def describe(args) -> str:
    """The start-up line's words for the lengths."""
    mode = getattr(args, "variable_seq_lengths", None)
    if mode == DOCUMENTS:
        return "variable lengths: each sample cut after its last whole document"
    return (f"variable lengths: log-normal, seed {args.seed}, {shortest(args)} to "
            f"{args.seq_length} tokens, sigma {args.variable_seq_lengths_sigma}")


def flag_problems(args) -> list[str]:
    """The ``--variable-seq-lengths`` flags against the others (one line each)."""
    mode = getattr(args, "variable_seq_lengths", None)
    given = getattr(args, "given_flags", set())
    problems = []
    steering = [flag for flag in ("--variable-seq-lengths-min", "--variable-seq-lengths-sigma")
                if flag in given]
    if steering and mode != LOGNORMAL:
        verb = "shapes" if len(steering) == 1 else "shape"
        problems.append(f"{' / '.join(steering)} {verb} the lengths of --variable-seq-lengths "
                        "lognormal only: add --variable-seq-lengths lognormal, or leave it out")
    if mode is None:
        return problems
    if mode == DOCUMENTS and args.micro_batch_size > 1:
        problems.append(
            f"--variable-seq-lengths documents with --micro-batch-size {args.micro_batch_size}: "
            "each sample is cut after its own last whole document, so the samples of a "
            "micro-batch would differ in length; use --micro-batch-size 1 (one packed sequence "
            "per micro-batch, as post-training does) or --variable-seq-lengths lognormal")
    if args.num_experts and args.moe_token_dispatcher_type != "alltoall":
        problems.append(
            f"--variable-seq-lengths with --moe-token-dispatcher-type "
            f"{args.moe_token_dispatcher_type}: Megatron-Core requires the alltoall dispatcher "
            "with variable_seq_lengths; add --moe-token-dispatcher-type alltoall")
    if args.seq1f1b and args.seq1f1b_splits == "auto" and \
            args.seq1f1b_memory_budget_microbatches is not None:
        problems.append(
            "--seq1f1b-memory-budget-microbatches with --variable-seq-lengths: micro-batches of "
            "their own lengths have no one size to count in; give --seq1f1b-memory-budget GIB")
    low = args.variable_seq_lengths_min
    if mode == LOGNORMAL and low is not None and low > args.seq_length:
        problems.append(f"--variable-seq-lengths-min {low} exceeds --seq-length "
                        f"{args.seq_length}")
    multiple = segment_multiple(args)
    if args.seq_length % multiple:
        problems.append(
            f"--variable-seq-lengths with --seq-length {args.seq_length}: every micro-batch "
            f"length must be a multiple of {multiple} (the tensor-parallel size with "
            "--sequence-parallel, 2 x --context-parallel-size); make --seq-length one")
    return problems
