"""Datasets for the trainer: Megatron-Core's mock and indexed GPT datasets.

Tokenizers work offline: ``NullTokenizer`` (ids are the data; mock data) and
``ByteTokenizer`` (UTF-8 bytes 0..255, end-of-document 256), enough to train
on real text turned into a Megatron indexed dataset by :func:`write_indexed`.
A real English corpus exists on every machine: the documentation topics
CPython ships in ``pydoc_data``.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator

import numpy
import torch


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


def build_datasets(args, tokenizer, train_samples: int, eval_samples: int):
    """(train, validation) datasets, built on every rank (they are cheap here)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        blend=None if args.mock_data else (list(args.data_path), None),
        split=None if args.mock_data else args.split,
        path_to_cache=args.data_cache_path,
    )
    cls = MockGPTDataset
    if args.mock_data:
        config.mock = True
    else:
        cls = GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(
        cls, [train_samples, eval_samples, None], lambda: True, config
    ).build()
    return train, valid


def batches(dataset, micro_batch_size: int, first_block: int, stride: int) -> Iterator[dict]:
    """This data-parallel rank's micro-batches.

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
        yield {key: value.pin_memory() for key, value in batch.items()} if pin else batch
        block += stride


def quiet_logs() -> None:
    """Megatron logs every dataset index it builds and warns about missing TE/apex."""
    import logging
    import warnings

    for name in ("megatron.core.datasets", "megatron.core"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
