"""``backward_by_documents``: a micro-batch's independent runs of documents scheduled apart.

A stage holds a micro-batch whole before its first backward, since that backward starts at
the micro-batch's last segment (later segments read earlier segments' keys and values). A
packed micro-batch cut where a document ends in every sample has no key/value crossing the
cut: the segments before it (one *run*) need nothing of the segments after it. Scheduling
each run as a micro-batch of its own lets a run go backward before the next run comes
forward, so a stage holds about its longest run, not its longest micro-batch.

The schedule, its validation, its messages and its timing then see runs only (plain data,
:class:`Runs`); the executor maps a run back to its micro-batch and first segment where it
touches the data, the loss, the reports and the segment context. Pure functions of host
integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_seq1f1b.segments.documents import Documents


@dataclass(frozen=True)
class Runs:
    """The schedule's micro-batches (runs) and where each came from."""

    rows: tuple[tuple[int, ...], ...]  # segment lengths per run
    owners: tuple[tuple[int, int], ...]  # per run: (micro-batch, its first segment)
    offsets: tuple[int, ...]  # per run: its first token in its micro-batch
    last_backward: tuple[int, ...]  # per micro-batch: its last run's head, backwarded last

    def documents(self, documents: Sequence[Documents]) -> tuple[Documents, ...]:
        """Each run's own documents (its micro-batch's, from the run's first token): what the
        simulator costs a run's segments by."""
        out = []
        for (microbatch, _), offset, row in zip(self.owners, self.offsets, self.rows):
            length = sum(row)
            found = documents[microbatch]
            out.append(Documents(tuple(tuple(s - offset for s in sample
                                             if offset <= s < offset + length)
                                       for sample in found.starts), length))
        return tuple(out)


def document_runs(rows: Sequence[Sequence[int]],
                  documents: Sequence[Documents | None]) -> Runs:
    """Every micro-batch's segments (``rows``) grouped into runs: a run ends before a segment
    that starts where a document starts in every sample of its micro-batch."""
    out_rows, owners, offsets, last_backward = [], [], [], []
    for microbatch, (row, found) in enumerate(zip(rows, documents)):
        cuts = set(found.ends()) if found is not None else set()
        head, start, head_start = 0, 0, 0
        for index, length in enumerate(row):
            if index > head and start in cuts:
                out_rows.append(tuple(row[head:index]))
                owners.append((microbatch, head))
                offsets.append(head_start)
                head, head_start = index, start
            start += length
        out_rows.append(tuple(row[head:]))
        owners.append((microbatch, head))
        offsets.append(head_start)
        last_backward.append(head)
    return Runs(tuple(out_rows), tuple(owners), tuple(offsets), tuple(last_backward))


#: Megatron's load-balancing kinds whose loss weighs every token by the micro-batch's counts.
_BALANCING_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def backward_by_documents_problems(config, *, num_chunks: int, documents,
                                   layer_pattern: str | None) -> list[str]:
    """What ``backward_by_documents`` cannot train with, found before any message from what
    every stage shares (the config, the whole model's hybrid pattern, the model chunks per
    stage), so every rank refuses alike. A forward-only pass has no backward to move and
    runs its micro-batches whole."""
    name = "backward_by_documents=True"
    problems = []
    if documents is None:
        problems.append(f"{name} needs documents (documents='cu_seqlens' or the end-of-document "
                        "token id): the runs are cut where documents end")
    if not config.calculate_per_token_loss:
        problems.append(
            f"{name} needs config.calculate_per_token_loss=True: a micro-batch's loss is "
            "otherwise divided by its token count, known only once its last run is forwarded, "
            "after its first runs went backward (Megatron then divides by the iteration's "
            "tokens, known at the end)")
    if num_chunks > 1:
        problems.append(f"{name} runs one model chunk per stage: the interleaved schedule "
                        "groups micro-batches by the pipeline size, and the number of runs "
                        "changes with every iteration's documents")
    if (getattr(config, "context_parallel_size", 1) or 1) > 1:
        problems.append(f"{name} with context parallelism is not supported")
    if getattr(config, "num_moe_experts", None) and _balancing_loss(config):
        problems.append(f"{name} with an MoE load-balancing loss: every token's gradient "
                        "uses the whole micro-batch's routing counts (set moe_aux_loss_coeff=0)")
    if getattr(config, "mtp_num_layers", None):
        problems.append(f"{name} with multi-token prediction is not supported")
    if any(kind in (layer_pattern or "") for kind in "MG") \
            or getattr(config, "experimental_attention_variant", None) is not None:
        problems.append(f"{name} with recurrent (Mamba, gated delta net) layers is not "
                        "supported: a run would start from the state of the run before it "
                        "(documents marked by end-of-document tokens), whose backward is done")
    return problems


def _balancing_loss(config) -> bool:
    """Whether the router adds a load-balancing loss (a kind of them, with a nonzero weight)."""
    kinds = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    coeffs = getattr(config, "moe_aux_loss_coeff", 0)
    kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
    return any(kind in _BALANCING_LOSSES and coeff for kind, coeff in zip(kinds, coeffs))
