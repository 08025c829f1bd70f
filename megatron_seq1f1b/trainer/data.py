"""Datasets for the trainer: Megatron-Core's mock and indexed GPT datasets.

Tokenizers work offline: ``NullTokenizer`` (ids are the data; mock data) and
``ByteTokenizer`` (UTF-8 bytes 0..255, end-of-document 256), enough to train
on real text turned into a Megatron indexed dataset by :func:`write_indexed`.
A real English corpus exists on every machine: the documentation topics
CPython ships in ``pydoc_data``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy
import torch

from megatron_seq1f1b.segments.documents import Documents
from megatron_seq1f1b.trainer.lengths import cut, length_rule


class NullTokenizer:
    """Megatron-LM's NullTokenizer semantics: vocabulary = ids, last id = end of document."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.pad = self.eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": "NullTokenizer", "vocab_size": self.vocab_size})


class ByteTokenizer:
    """UTF-8 bytes as tokens (0..255) and 256 as end of document: no vocabulary files."""

    vocab_size = 257
    eod = 256
    pad = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": "ByteTokenizer"})


def make_tokenizer(args):
    if args.tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    return NullTokenizer(args.vocab_size)


def pydoc_corpus() -> list[str]:
    """English documentation text that ships with CPython (no download)."""
    from pydoc_data import topics

    return [text for _, text in sorted(topics.topics.items()) if text.strip()]


def write_indexed(documents: Iterable[str], prefix: str | Path, tokenizer=None) -> Path:
    """Tokenize documents into a Megatron indexed dataset ``prefix.bin`` / ``prefix.idx``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = tokenizer or ByteTokenizer()
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for text in documents:
        ids = tokenizer.tokenize(text) + [tokenizer.eod]
        builder.add_item(torch.tensor(ids, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


#: Most tokens of a .bin the start-up check reads; a larger data set is read in evenly spaced
#: windows of this many tokens in all (256 MiB of uint16).
SCAN_TOKENS = 2**27
_WINDOW = 2**22
_IDX_HEADER = b"MMIDIDX\x00\x00"  # Megatron's .idx: this, version 1 (<Q), dtype code (<B), ...


def data_path_problems(args) -> list[str]:
    """Why the ``--data-path`` prefixes cannot be trained on with ``--vocab-size`` (one line
    each; empty: they can; the vocabulary is checked where ``args.vocab_size`` is known).

    Checked at start-up, before any process group: otherwise a wrong prefix surfaces as a
    traceback from inside Megatron's dataset builder, and a token id beyond the vocabulary
    as an index error in the embedding (a device-side assert on a GPU).
    """
    problems = []
    for prefix in args.data_path:
        problem = _prefix_problem(prefix)
        if problem is None and args.vocab_size is not None:
            problem = _vocabulary_problem(prefix, args)
        if problem is None:
            problem = _split_problem(prefix, args.split)
        if problem is not None:
            problems.append(f"--data-path {prefix}: {problem}")
    return problems


SPLIT_NAMES = ("training", "validation")  # the parts the trainer asks samples of


def split_weights_problem(split: str) -> str | None:
    """Why ``--split`` is not Megatron's ``train,valid,test`` weights with a training part
    (None: it is). Read as Megatron reads it (``parse_and_normalize_split``: the numbers in
    the text, e.g. ``969, 30, 1`` or ``.5,.5``)."""
    import re

    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    numbers = re.findall(r"[.0-9]+", split)
    try:
        weights = parse_and_normalize_split(split) if 0 < len(numbers) <= 3 else None
    except (AssertionError, ValueError, ZeroDivisionError):
        weights = None
    if weights is None:
        return f"--split {split!r}: give up to three non-negative weights, e.g. 98,2,0"
    if not weights[0] > 0:
        return f"--split {split}: the training part must be > 0"
    return None


def _split_problem(prefix: str, split: str) -> str | None:
    """A part of ``--split`` that the trainer asks samples of (training, validation), with
    weight > 0 and no sequence of `prefix`: Megatron's dataset builder loops forever over its
    empty epochs (None: every such part gets one). The test part is asked for none, and an
    empty one is harmless."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split,
    )

    if split_weights_problem(split) is not None:
        return None  # said once, by the flag's own check
    with open(f"{prefix}.idx", "rb") as index:
        head = index.read(26)
    if len(head) < 26:
        return None  # not an index: the vocabulary check says so
    sequences = int.from_bytes(head[18:26], "little")  # what Megatron's GPT splits
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for name, part in zip(SPLIT_NAMES, bounds):
        if part is not None and round(part[1] * sequences) - round(part[0] * sequences) < 1:
            return (f"--split {split} gives the {name} part none of its {sequences} "
                    f"sequences (documents) (Megatron's dataset builder would loop forever "
                    f"on it); give that part weight 0 (e.g. --split 100,0,0) or more documents")
    return None


def _prefix_problem(prefix: str) -> str | None:
    """Why `prefix` names no readable ``.idx``/``.bin`` pair (None: it does)."""
    files = [Path(f"{prefix}.{ext}") for ext in ("idx", "bin")]
    absent = [str(path) for path in files if not path.is_file()]
    stem, ext = os.path.splitext(prefix)
    if absent and ext in (".idx", ".bin") and _prefix_problem(stem) is None:
        return f"give the prefix without {ext}: --data-path {stem}"
    if absent:
        return (f"{' and '.join(absent)} not found (a Megatron indexed data set is a "
                f"prefix.idx and prefix.bin; scripts/make_dataset.py --output {prefix} "
                "makes one)")
    unreadable = [str(path) for path in files if not os.access(path, os.R_OK)]
    if unreadable:
        return f"{' and '.join(unreadable)} not readable"
    return None


def _vocabulary_problem(prefix: str, args) -> str | None:
    """A token id of the data set beyond ``--vocab-size`` (None: all fit, or none found)."""
    try:
        largest = largest_token(prefix)
    except (ValueError, OSError) as exc:
        return str(exc)
    if largest is None or largest < args.vocab_size:
        return None
    return (f"token id {largest} is beyond --vocab-size {args.vocab_size} (--tokenizer-type "
            f"{args.tokenizer_type}: ids 0..{args.vocab_size - 1}); give --vocab-size "
            f"{largest + 1} or more, or the tokenizer the data set was made with")


def largest_token(prefix: str | Path, scan_tokens: int = SCAN_TOKENS) -> int | None:
    """The largest token id in ``prefix.bin`` (None: no tokens); of a data set beyond
    `scan_tokens` tokens, the largest in evenly spaced windows of that many in all.

    ValueError: ``prefix.idx`` is not a Megatron index (read here, not by Megatron's
    IndexedDataset, which leaves tracebacks from ``__del__`` on a broken file).
    """
    from megatron.core.datasets.indexed_dataset import DType

    with open(f"{prefix}.idx", "rb") as index:
        head = index.read(18)
    if len(head) < 18 or head[:9] != _IDX_HEADER or int.from_bytes(head[9:17], "little") != 1:
        raise ValueError(f"{prefix}.idx is not a Megatron indexed data set's index")
    dtype = numpy.dtype(DType.dtype_from_code(head[17]))  # ValueError: an unknown code
    count = os.path.getsize(f"{prefix}.bin") // dtype.itemsize
    if count == 0:
        return None
    tokens = numpy.memmap(f"{prefix}.bin", dtype=dtype, mode="r", shape=(count,))
    starts = (range(0, count, _WINDOW) if count <= scan_tokens else numpy.linspace(
        0, count - _WINDOW, max(scan_tokens // _WINDOW, 1)).astype(numpy.int64))
    return max(int(tokens[start:start + _WINDOW].max()) for start in starts)


def build_datasets(args, tokenizer, train_samples: int, eval_samples: int):
    """(train, validation) datasets, built on every rank (they are cheap here)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    from megatron_seq1f1b.base import compat

    documents = getattr(args, "documents", None)
    boundaries = {}
    if documents == "dataset" and compat.dataset_has_inter_document_masking():
        boundaries = dict(inter_document_masking=True)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        tokenizer=tokenizer,
        reset_position_ids=getattr(args, "reset_position_ids", False),
        reset_attention_mask=getattr(args, "reset_attention_mask", False),
        eod_mask_loss=getattr(args, "eod_mask_loss", False),
        # Megatron's dense [s, s] mask from end-of-document tokens: only where it is the
        # documents' form (Megatron's schedules on local attention).
        create_attention_mask=documents == "eod" and dense_document_mask(args),
        blend=None if args.mock_data else (list(args.data_path), None),
        split=None if args.mock_data else args.split,
        path_to_cache=args.data_cache_path,
        **boundaries,
    )
    cls = MockGPTDataset
    if args.mock_data:
        config.mock = True
    else:
        cls = GPTDataset
    if documents == "dataset" and not boundaries:
        cls = compat.with_document_boundaries(cls)
    train, valid, _ = BlendedMegatronDatasetBuilder(
        cls, [train_samples, eval_samples, None], lambda: True, config
    ).build()
    return train, valid


def batches(dataset, micro_batch_size: int, first_block: int, stride: int,
            form: Callable[[dict], dict] | None = None,
            length: Callable[[int, dict], int] | None = None) -> Iterator[dict]:
    """This data-parallel rank's micro-batches (``form``: how they carry documents,
    :func:`document_form`; ``length``: the tokens each keeps with --variable-seq-lengths,
    from its global index and samples, :mod:`megatron_seq1f1b.trainer.lengths`).

    The global stream of micro-batches is blocks of ``micro_batch_size``
    consecutive samples; rank d of D takes blocks d, d + D, d + 2D, ...
    (``first_block`` = d + D * micro-batches already consumed, ``stride`` = D).
    """
    pin = torch.cuda.is_available()  # copied to the GPU without blocking the host (both schedules)
    block = first_block
    while True:
        start = block * micro_batch_size
        samples = [dataset[(start + i) % len(dataset)] for i in range(micro_batch_size)]
        batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        if length is not None:
            batch = cut(batch, length(block, batch))
        if form is not None:
            batch = form(batch)
        yield {key: value.pin_memory() for key, value in batch.items()} if pin else batch
        block += stride


class Counted:
    """An iterator of micro-batches that counts their tokens (``tokens``: since the last
    :meth:`take`): what tokens/s counts, the real ones whatever the lengths."""

    def __init__(self, iterator: Iterator[dict]):
        self.iterator, self.tokens = iterator, 0

    def __iter__(self) -> "Counted":
        return self

    def __next__(self) -> dict:
        batch = next(self.iterator)
        self.tokens += batch["tokens"].numel()
        return batch

    def take(self) -> int:
        tokens, self.tokens = self.tokens, 0
        return tokens


# ------------------------------------------------------------------------------- documents
#
# --reset-attention-mask (documents end at end-of-document tokens, Megatron's
# _get_ltor_masks_and_position_ids) and --dataloader-inter-document-masking (the dataset's
# document boundaries as cu_seqlens) reach attention in the form the backend and schedule
# take. Tokens, labels, loss mask and position ids are the dataset's in every form.
#
#   attention  schedule   the micro-batch carries              Seq1F1B's documents source
#   flash      any, CP 1  packed THD: cu_seqlens, max_seqlen    "cu_seqlens"
#                         ([1, b*s], flattened as Megatron-LM)
#   local      Megatron   attention_mask [b, 1, s, s]           -
#   local, or  Seq1F1B    nothing more (eod) or                 the eod id, or the rows
#   flash CP>1            document_cu_seqlens [b, s+1]          (document_rows)
#
# Under context parallelism the flash attention takes the documents as local attention does
# (each CP rank attends to its chunks' documents among the gathered keys): a THD batch would
# need every document cut over the CP group.
#
# Megatron's local DotProductAttention cannot take packed batches, and the flash attention
# takes no dense mask (nor is one built for it): each gets the documents its own way, and
# the losses of all forms agree (tests/test_trainer.py).

#: [b, s + 1] cumulative document lengths per sample (padded with s): the documents of a
#: local-attention Seq1F1B run with --dataloader-inter-document-masking; the model ignores it.
DOCUMENT_ROWS = "document_cu_seqlens"
_SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def dense_document_mask(args) -> bool:
    """Whether documents reach attention as a dense mask: Megatron's schedules on local."""
    return args.attention_backend == "local" and not args.seq1f1b


def batch_documents(batch: dict, eod: int | None) -> Documents:
    """A collated micro-batch's documents: the dataset's cu_seqlens rows, or end-of-document
    tokens."""
    if "cu_seqlens" in batch:
        return Documents.from_cu_seqlens(batch["cu_seqlens"], batch["tokens"].shape[-1])
    return Documents.from_eod(batch["tokens"], eod)


def packed(batch: dict, documents: Documents) -> dict:
    """One THD sequence: ``[1, b * s]`` entries, ``cu_seqlens`` ``[1, documents + 1]`` over all
    samples' documents and ``max_seqlen`` ``[1]`` (Megatron-LM's
    ``flatten_batch_for_packed_sequences``)."""
    b, s = batch["tokens"].shape
    cu = [0]
    for sample in range(b):
        cu += [sample * s + end for end in documents.bounds(sample)[1:]]
    out = {key: batch[key].reshape(1, b * s) for key in _SEQUENCE_KEYS if key in batch}
    out["cu_seqlens"] = torch.tensor([cu], dtype=torch.int32)
    longest = max(end - start for start, end in zip(cu, cu[1:]))
    out["max_seqlen"] = torch.tensor([longest], dtype=torch.int32)
    return out


def document_mask(documents: Documents) -> torch.Tensor:
    """``[b, 1, s, s]`` bool, True where masked (Megatron's convention): each token sees the
    earlier tokens of its own document."""
    s = documents.seq_length
    number = torch.zeros(documents.micro_batch_size, s, dtype=torch.int32)
    for sample, starts in enumerate(documents.starts):
        for start in starts[1:]:
            number[sample, start:] += 1
    later = torch.ones(s, s, dtype=torch.bool).triu(1)
    return ((number.unsqueeze(2) != number.unsqueeze(1)) | later).unsqueeze(1)


def document_form(args, eod: int) -> Callable[[dict], dict] | None:
    """What a collated micro-batch becomes for this run (the table above), or None."""
    documents = getattr(args, "documents", None)
    if documents is None:
        return None
    if args.packed_documents:
        return lambda batch: packed(batch, batch_documents(batch, eod))
    if documents == "eod":
        return None  # the dataset's own mask (Megatron's schedules) or none (Seq1F1B: eod id)

    def unpacked(batch: dict) -> dict:
        out = {key: value for key, value in batch.items()
               if key not in ("cu_seqlens", "max_seqlen")}
        if dense_document_mask(args):
            out["attention_mask"] = document_mask(batch_documents(batch, eod))
        else:
            out[DOCUMENT_ROWS] = batch["cu_seqlens"]
        return out

    return unpacked


def document_rows(batch: dict, seq_length: int) -> Documents:
    """Seq1F1B's documents source for :data:`DOCUMENT_ROWS` (local attention)."""
    return Documents.from_cu_seqlens(batch[DOCUMENT_ROWS], seq_length)


def seq1f1b_documents(args, eod: int):
    """``documents=`` for :func:`megatron_seq1f1b.get_forward_backward_func` (None: none)."""
    documents = getattr(args, "documents", None)
    if documents is None:
        return None
    if args.packed_documents:
        return "cu_seqlens"
    return eod if documents == "eod" else document_rows


def quiet_logs() -> None:
    """Megatron logs every dataset index it builds and warns about missing TE/apex."""
    import logging
    import warnings

    for name in ("megatron.core.datasets", "megatron.core"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def data_iterators(args, dataset, model, consumed_microbatches: int, split: str = "train"):
    """(the schedule's data iterator(s), the last chunk's, which counts the tokens read)."""
    from megatron.core import parallel_state

    # The data-parallel rank without context parallelism: every CP rank of a replica reads
    # the same micro-batches, and Seq1F1B's cut (slice_batch) gives each its part.
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=False)
    dp = args.data_parallel_size
    first = dp_rank + dp * consumed_microbatches
    eod = make_tokenizer(args).eod
    form = document_form(args, eod)
    length = length_rule(args, eod, split)
    made = [batches(dataset, args.micro_batch_size, first, dp, form, length)
            for _ in model]
    # The last stage's last chunk reads every micro-batch once (it needs the labels): its
    # count there is the replica's (the loss reduction sums the replicas).
    made[-1] = counted = Counted(made[-1])
    return (made if len(made) > 1 else made[0]), counted
