"""Documents packed into a micro-batch, and what each segment of it may attend to.

Long-context training packs several documents into one sequence and keeps
them apart: a token attends to the earlier tokens of its own document only.
Under Seq1F1B that decides what a segment needs from earlier segments: the
tail of the document that crosses into it, nothing of the documents before.

* :class:`Documents`: where documents start in each sample of one micro-batch
  (host integers). It is plan data: the executor knows it for every micro-batch
  on every rank before the iteration runs (:mod:`megatron_seq1f1b.runtime.executor`),
  from ``cu_seqlens`` or end-of-document tokens, so no stage needs the batch to
  mask its attention and no segment's shape is exchanged.
* :class:`SegmentView`: one segment as attention sees it, for layers with a
  given sliding window: its queries ``[start, end)``, the first key row any of
  them sees (``key_start``), and per sample the pieces of documents it holds
  (queries ``[q0, q1)`` over keys ``[k0, q1)``, causal and aligned bottom-right).
  Without documents every sample has one piece, and a segment sees the whole
  prefix as before.
* :func:`chains`: consecutive segments linked by a crossing document. Only they
  share a key/value buffer (:mod:`megatron_seq1f1b.segments.kv_cache`); a segment that
  starts with a new document reads no earlier keys, and a segment that neither
  reads nor is read keeps its keys and values to itself, as unsegmented attention does.

Pure Python on host integers (built once per micro-batch); only the
constructors read tensors.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

ALONE, HEAD, MEMBER = "alone", "head", "member"


@dataclass(frozen=True)
class Documents:
    """Document starts per sample of a micro-batch of ``seq_length`` tokens (each starts at 0)."""

    starts: tuple[tuple[int, ...], ...]
    seq_length: int

    def __post_init__(self):
        for sample in self.starts:
            if not sample or sample[0] != 0 or any(b <= a for a, b in zip(sample, sample[1:])) \
                    or sample[-1] >= self.seq_length:
                raise ValueError(
                    f"document starts {list(sample)} are not increasing offsets from 0 below the "
                    f"sequence length {self.seq_length}")

    @property
    def micro_batch_size(self) -> int:
        return len(self.starts)

    @classmethod
    def whole(cls, seq_length: int, micro_batch_size: int = 1) -> "Documents":
        """One document per sample (what a batch without documents means)."""
        return cls(((0,),) * micro_batch_size, seq_length)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, seq_length: int) -> "Documents":
        """From cumulative document lengths: one row ``[0, ..., seq_length]`` per sample.

        Accepts Megatron-LM's forms: a 1-D tensor or list (one sample), a
        ``[1, N]`` row, or ``[b, N]`` rows padded with trailing copies of
        ``seq_length`` (the dataset's ``--dataloader-inter-document-masking``
        output before collation merges them).
        """
        rows = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
        if rows and not isinstance(rows[0], list):
            rows = [rows]
        starts = []
        for row in rows:
            values = [int(v) for v in row]
            if not values or values[0] != 0 or seq_length not in values:
                raise ValueError(
                    f"cu_seqlens {values} must start at 0 and reach the sequence length "
                    f"{seq_length} (one row per sample; THD batches of micro-batch size > 1 "
                    "flattened into one row need seq_length = micro_batch_size * tokens)")
            end = values.index(seq_length)
            body = values[: end + 1]
            if any(b <= a for a, b in zip(body, body[1:])):
                raise ValueError(f"cu_seqlens {values} are not increasing")
            starts.append(tuple(body[:-1]))
        return cls(tuple(starts), seq_length)

    @classmethod
    def from_eod(cls, tokens, eod: int) -> "Documents":
        """A document ends with each end-of-document token (``--reset-attention-mask``).

        ``tokens``: ``[b, s]``. As Megatron's data loader: a token after an
        end-of-document token starts a new document.
        """
        rows = tokens.tolist() if hasattr(tokens, "tolist") else [list(r) for r in tokens]
        if rows and not isinstance(rows[0], list):
            rows = [rows]
        seq_length = len(rows[0])
        starts = []
        for row in rows:
            starts.append((0,) + tuple(i + 1 for i, t in enumerate(row[:-1]) if t == eod))
        return cls(tuple(starts), seq_length)

    def bounds(self, sample: int) -> tuple[int, ...]:
        """Document starts of ``sample`` and the sequence end."""
        return self.starts[sample] + (self.seq_length,)

    def document_start(self, sample: int, position: int) -> int:
        """Where the document holding ``position`` starts."""
        starts = self.starts[sample]
        return starts[bisect.bisect_right(starts, position) - 1]

    def ends(self) -> tuple[int, ...]:
        """Positions where a document ends in every sample (cuts that split no document)."""
        common = set(self.bounds(0)[1:])
        for sample in range(1, self.micro_batch_size):
            common &= set(self.bounds(sample)[1:])
        return tuple(sorted(common))

    def pairs(self, start: int, end: int, dense: bool = False) -> float:
        """Query-key pairs of tokens ``[start, end)`` per sample (the mean over samples) that
        attention computes: each document's causal pairs, or for a kernel that computes
        every score (``dense``) the rectangle of the queries and the keys from the start of
        the document crossing into ``start``. What per-pair costs are fitted and planned on."""
        if end <= start:
            return 0.0
        total = 0.0
        for sample in range(self.micro_batch_size):
            if dense:
                total += (end - start) * (end - self.document_start(sample, start))
            else:
                total += self._causal_before(sample, end) - self._causal_before(sample, start)
        return total / self.micro_batch_size

    def _causal_before(self, sample: int, x: int) -> float:
        """Causal pairs of tokens ``[0, x)`` of a sample, within their documents."""
        if x <= 0:
            return 0.0
        sums = self.__dict__.get("_pair_sums")
        if sums is None:
            sums = []
            for index in range(self.micro_batch_size):
                bounds, running, row = self.bounds(index), 0.0, []
                for a, b in zip(bounds, bounds[1:]):
                    row.append(running)
                    running += (b - a) * (b - a + 1) / 2
                sums.append(row)
            object.__setattr__(self, "_pair_sums", sums)
        starts = self.starts[sample]
        index = bisect.bisect_right(starts, x - 1) - 1
        n = x - starts[index]
        return sums[sample][index] + n * (n + 1) / 2

    def pair_function(self, dense: bool = False):
        """``pairs(length, end)`` of segments ending at ``end`` (a calibration's quadratic)."""
        return lambda length, end: self.pairs(int(round(end - length)), int(round(end)), dense)

    def positions(self, sample: int, start: int, end: int) -> list[int]:
        """Each token's position within its document (THD position ids, RoPE)."""
        return [t - self.document_start(sample, t) for t in range(start, end)]

    def view(self, start: int, end: int, window: int | None = None,
             queries: tuple[tuple[int, int], ...] | None = None) -> "SegmentView":
        """What queries ``[start, end)`` attend to (``window``: keys looked back, or None);
        ``queries``: only these ranges of them (a context-parallel rank's chunks)."""
        pieces = []
        for sample in range(self.micro_batch_size):
            bounds = self.bounds(sample)
            own = []
            for low, high in queries or ((start, end),):
                first = bisect.bisect_right(bounds, low) - 1
                for index in range(first, len(bounds) - 1):
                    doc_start, doc_end = bounds[index], bounds[index + 1]
                    if doc_start >= high:
                        break
                    q0, q1 = max(doc_start, low), min(doc_end, high)
                    k0 = doc_start if window is None else max(doc_start, q0 - window)
                    own.append(Piece(q0, q1, k0, doc_start))
            pieces.append(tuple(own))
        return SegmentView.of(start, end, tuple(pieces), window)


def rank_ranges(start: int, end: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int], ...]:
    """The positions ``[a, b)`` of segment ``[start, end)`` a context-parallel rank holds: chunks
    ``r`` and ``2cp - 1 - r`` of ``2 * cp`` (:mod:`megatron_seq1f1b.attention.context_parallel`)."""
    if cp_size == 1:
        return ((start, end),)
    chunk = (end - start) // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return ((start + first * chunk, start + (first + 1) * chunk),
            (start + second * chunk, start + (second + 1) * chunk))


def long_tailed(seq_length: int, mean_length: float, seed: int = 0,
                micro_batch_size: int = 1) -> Documents:
    """Packed documents of log-normal lengths (sigma 1: a long tail; median ~0.6 x the mean),
    cut where the sequence ends, as packing a web-like corpus gives them (benchmarks, the
    stage rehearsal)."""
    import math
    import random

    rng = random.Random(seed)
    mu = math.log(mean_length) - 0.5
    samples = []
    for _ in range(micro_batch_size):
        starts = [0]
        while True:
            end = starts[-1] + max(1, int(rng.lognormvariate(mu, 1.0)))
            if end >= seq_length:
                break
            starts.append(end)
        samples.append(tuple(starts))
    return Documents(tuple(samples), seq_length)


@dataclass(frozen=True)
class Piece:
    """One document's part of a segment: queries ``[q0, q1)`` over keys ``[k0, q1)``.

    ``doc``: where the document starts (``k0`` unless a window cuts it off).
    """

    q0: int
    q1: int
    k0: int
    doc: int = 0

    @property
    def queries(self) -> int:
        return self.q1 - self.q0

    @property
    def keys(self) -> int:
        return self.q1 - self.k0


@dataclass(frozen=True)
class SegmentView:
    """Queries ``[start, end)`` and what they see (see the module docstring).

    ``pieces`` is None without documents: causal attention over keys
    ``[key_start, end)``, aligned bottom-right. ``plain`` is true when the
    documents change nothing for this segment (one piece per sample, all from
    ``key_start``), so backends take their mask-free causal path.
    """

    start: int
    end: int
    key_start: int
    window: int | None
    pieces: tuple[tuple[Piece, ...], ...] | None = None

    @classmethod
    def causal(cls, start: int, end: int, window: int | None = None,
               queries: tuple[tuple[int, int], ...] | None = None) -> "SegmentView":
        """No documents: the whole prefix (or the window's part of it); ``queries``: only
        these ranges of the segment's queries (one causal piece each)."""
        if queries is None or len(queries) == 1 and tuple(queries[0]) == (start, end):
            return cls(start, end, 0 if window is None else max(0, start - window), window)
        pieces = (tuple(Piece(a, b, 0 if window is None else max(0, a - window), 0)
                        for a, b in queries),)
        return cls(start, end, min(p.k0 for p in pieces[0]), window, pieces)

    @classmethod
    def of(cls, start: int, end: int, pieces, window: int | None) -> "SegmentView":
        key_start = min(sample[0].k0 for sample in pieces)
        plain = all(len(sample) == 1 and sample[0].k0 == key_start for sample in pieces)
        return cls(start, end, key_start, window, None if plain else pieces)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def num_queries(self) -> int:
        """Queries per sample (the segment's, or a context-parallel rank's part of them)."""
        if self.pieces is None:
            return self.length
        return sum(piece.queries for piece in self.pieces[0])

    @property
    def num_keys(self) -> int:
        return self.end - self.key_start

    @property
    def needs_prefix(self) -> bool:
        return self.key_start < self.start

    def sample_pieces(self, micro_batch_size: int) -> tuple[tuple[Piece, ...], ...]:
        """Pieces per sample, also without documents (one causal piece each)."""
        if self.pieces is not None:
            if len(self.pieces) == 1 and micro_batch_size > 1:  # the same for every sample
                return self.pieces * micro_batch_size
            return self.pieces
        return ((Piece(self.start, self.end, self.key_start, 0),),) * micro_batch_size

    def attended_pairs(self, micro_batch_size: int = 1) -> int:
        """Query-key pairs the causal document mask lets through (all samples)."""
        total = 0
        for sample in self.sample_pieces(micro_batch_size):
            for piece in sample:
                offset = piece.q0 - piece.k0  # keys before the piece's first query
                n = piece.queries
                if self.window is None:
                    total += n * offset + n * (n + 1) // 2
                else:
                    total += sum(min(piece.q0 + i - piece.k0, self.window) + 1 for i in range(n))
        return total


@dataclass(frozen=True)
class Chain:
    """Segments ``head..last`` linked by a crossing document: one K/V buffer of rows ``[base, end)``."""

    head: int
    last: int
    base: int
    end: int


def views_of(starts: Sequence[int], lengths: Sequence[int], documents: Documents | None,
             window: int | None, queries=None) -> tuple[SegmentView, ...]:
    """Every segment's view for layers with ``window`` (None: no window); ``queries(start,
    end)``: the ranges of each segment's queries to see (a context-parallel rank's)."""
    views = []
    for start, length in zip(starts, lengths):
        end = start + length
        mine = queries(start, end) if queries is not None else None
        views.append(documents.view(start, end, window, mine) if documents is not None
                     else SegmentView.causal(start, end, window, mine))
    return tuple(views)


def chains(views: Sequence[SegmentView]) -> tuple[Chain, ...]:
    """Maximal runs of segments where each one after the first reads keys of earlier ones.

    A chain's buffer holds its rows from the head's start: the head's own attention
    keeps its keys and values until the head's backward anyway, when the buffer goes,
    so rows of its documents that no later segment reads cost nothing more there
    (and the head's attention reads the buffer as every member does, with no second
    copy of its keys).
    """
    found = []
    head = 0
    for index in range(1, len(views) + 1):
        if index < len(views) and views[index].needs_prefix:
            continue
        last = index - 1
        if last > head:
            found.append(Chain(head, last, views[head].start, views[last].end))
        head = index
    return tuple(found)


def roles(views: Sequence[SegmentView], found: Sequence[Chain]) -> tuple[tuple[str, int], ...]:
    """Per segment: (ALONE | HEAD | MEMBER, index of its chain in ``found`` or -1)."""
    result = [(ALONE, -1)] * len(views)
    for number, chain in enumerate(found):
        result[chain.head] = (HEAD, number)
        for index in range(chain.head + 1, chain.last + 1):
            result[index] = (MEMBER, number)
    return tuple(result)
