"""Packed documents for the benchmark: mock micro-batches re-cut into long-tailed documents,
then handed to each schedule in the form its backend and schedule take.

Mock data has no documents worth measuring (Megatron's mock documents are long and
regular). ``--document-length MEAN`` packs every micro-batch with documents of a
log-normal length distribution (:func:`megatron_seq1f1b.segments.documents.long_tailed`, seeded
with ``--seed`` + the micro-batch's index) and writes them into the micro-batch as
Megatron-LM's data loader would have with ``--reset-attention-mask --reset-position-ids
--eod-mask-loss``: an end-of-document token ends each document, position ids restart
per document and the loss skips end-of-document tokens.

Which form each schedule then receives is the trainer's table
(:mod:`megatron_seq1f1b.trainer.data`), built with the trainer's own functions so the
benchmark measures what training runs: Megatron's schedules on local attention get a
dense ``[b, 1, s, s]`` mask, Seq1F1B on local gets the tokens alone (its executor finds
the documents from the end-of-document id), and on flash every schedule gets packed THD.
"""

from __future__ import annotations

import argparse
import torch

from megatron_seq1f1b.segments.documents import Documents, long_tailed

#: A collated micro-batch's form for one schedule: "megatron-local", "seq1f1b-local",
#: "packed" (THD, flash) or "plain" (no documents).
FORMS = ("plain", "megatron-local", "seq1f1b-local", "packed")


def microbatch_documents(seq_length: int, mean_length: float, seed: int, count: int,
                         micro_batch_size: int) -> list[Documents]:
    """The documents of ``count`` micro-batches: micro-batch i draws with seed ``seed + i``."""
    return [long_tailed(seq_length, mean_length, seed=seed + index,
                        micro_batch_size=micro_batch_size) for index in range(count)]


def pack(batch: dict, documents: Documents, eod: int) -> dict:
    """``batch`` (tokens, labels, ...; ``[b, s]``) re-cut into ``documents``.

    Every document that ends inside the sequence ends with ``eod``; the last one,
    cut where the sequence ends (as packing a corpus cuts it), carries none, and no
    other token is ``eod``. Labels stay the tokens shifted by one (the sample's text is
    ``tokens`` + the last label), position ids restart per document and the loss mask
    is 0 on ``eod`` tokens. Other entries (a dataset's attention mask) are dropped:
    :func:`form` adds what a schedule needs.
    """
    tokens, labels = batch["tokens"], batch["labels"]
    b, s = tokens.shape
    if (documents.micro_batch_size, documents.seq_length) != (b, s):
        raise ValueError(f"documents of {documents.micro_batch_size} x {documents.seq_length} "
                         f"tokens for a micro-batch of {b} x {s}")
    text = torch.cat([tokens, labels[:, -1:]], dim=1).clone()
    text[text == eod] = eod - 1 if eod > 0 else eod + 1  # no stray end-of-document token
    positions = torch.empty(b, s, dtype=batch.get("position_ids", tokens).dtype)
    for sample in range(b):
        for end in documents.bounds(sample)[1:-1]:
            text[sample, end - 1] = eod
        positions[sample] = torch.tensor(documents.positions(sample, 0, s))
    tokens = text[:, :s].contiguous()
    loss_mask = batch.get("loss_mask", torch.ones(b, s)).clone()
    loss_mask[tokens == eod] = 0
    return {"tokens": tokens, "labels": text[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": positions}


def pack_all(batches: list[dict], args: argparse.Namespace, eod: int) -> list[dict]:
    """Every micro-batch packed with ``--document-length`` documents (module docstring)."""
    b, s = batches[0]["tokens"].shape
    found = microbatch_documents(s, args.document_length, args.seed, len(batches), b)
    return [pack(batch, documents, eod) for batch, documents in zip(batches, found)]


def form_of(megatron: bool, attention_backend: str, packed_documents: bool) -> str:
    """Which form (:data:`FORMS`) a schedule takes (the trainer's table)."""
    if not packed_documents:
        return "plain"
    if attention_backend == "flash":
        return "packed"
    return "megatron-local" if megatron else "seq1f1b-local"


def form(batch: dict, name: str, eod: int) -> dict:
    """One packed micro-batch in form ``name``, by the trainer's own functions."""
    from megatron_seq1f1b.trainer import data

    if name in ("plain", "seq1f1b-local"):
        return batch
    documents = data.batch_documents(batch, eod)
    if name == "packed":
        return data.packed(batch, documents)
    if name == "megatron-local":
        return {**batch, "attention_mask": data.document_mask(documents)}
    raise ValueError(f"unknown form {name!r}; one of {FORMS}")


def documents_source(targs: argparse.Namespace, eod: int) -> object | None:
    """``documents=`` for Seq1F1B's forward-backward, as the trainer passes it (None: none)."""
    from megatron_seq1f1b.trainer import data

    return data.seq1f1b_documents(targs, eod)


def whole_documents(batch: dict, seq_length: int) -> Documents:
    """A documents source for unpacked data: one document per sample (the documents
    partition then cuts as ``balanced`` does)."""
    return Documents.whole(seq_length, batch["tokens"].shape[0])


def batches_by_form(batches: list[dict], names: set[str], eod: int) -> dict[str, list[dict]]:
    """Each needed form of the micro-batches, built once and shared by the schedules."""
    return {name: [form(batch, name, eod) for batch in batches] for name in sorted(names)}

