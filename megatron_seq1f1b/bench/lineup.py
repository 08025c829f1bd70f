"""The schedules compared (keys, labels, forward-backward functions) and what each one measured."""

from __future__ import annotations

import argparse
import contextlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from megatron_seq1f1b.bench.layouts import Layout
from megatron_seq1f1b.megatron_lm.arguments import AUTO

if TYPE_CHECKING:
    from megatron_seq1f1b.planner import Plan

ALL_SCHEDULES = ("1f1b", "seq1f1b-k1", "seq1f1b-uniform", "seq1f1b-balanced",
                 "seq1f1b-documents", "seq1f1b-zb-h1", "seq1f1b-zb-h2", "1f1b-interleaved",
                 "seq1f1b-interleaved", "seq1f1b-interleaved-zb-h1", "1f1b-interleaved-recompute")
INTERLEAVED = ("1f1b-interleaved", "seq1f1b-interleaved", "seq1f1b-interleaved-zb-h1",
               "1f1b-interleaved-recompute")
# Zero-bubble rows (balanced partition) and the memory-matched baseline run when named.
OPT_IN = ("seq1f1b-zb-h1", "seq1f1b-zb-h2", "seq1f1b-interleaved-zb-h1",
          "1f1b-interleaved-recompute", "seq1f1b-documents")
# Segment lengths chosen per micro-batch by the executor from its documents (default with
# --document-length; on unpacked data it cuts as balanced does).
DOCUMENTS_KEY = "seq1f1b-documents"
ZERO_BUBBLE = ("zb-h1", "zb-h2")
# Added by flags, not named in --schedules: the planner's choice (--splits auto) and a sweep of
# k, balanced 1F1B (--sweep-splits; "seq1f1b-k1" is the default k=1 row).
AUTO_KEY = "seq1f1b-auto"
SWEEP_KEY = re.compile(r"seq1f1b-k(\d+)")


def sweep_key(k: int) -> str:
    return f"seq1f1b-k{k}"


@dataclass
class BenchSchedule:
    """One contender: how to run it, and the measurements of its runs (filled in by phases)."""

    key: str
    label: str
    layout: Layout
    megatron: bool
    k: int
    partition: str | None
    lengths: list[int]
    fb: Callable | None = None
    times: list[float] = field(default_factory=list)
    peaks: list[list[int]] = field(default_factory=list)  # per run, per stage (bytes)
    cpu: list[list[float]] = field(default_factory=list)  # per run, per stage (CPU seconds)
    first_loss: float | None = None
    timeline: dict | None = None
    prediction: dict | None = None
    recompute: bool = False  # full activation recompute (Megatron's, one layer at a time)
    schedule: str = "1f1b"  # Seq1F1B's variant: "1f1b", or zero bubble "zb-h1" / "zb-h2"
    segment_costs: tuple | None = None  # W placement (the auto plan's); None: the FLOP model
    documents: object = None  # Seq1F1B's documents source (DocumentSource), or None
    batches: list | None = None  # the micro-batches in this schedule's form (packing.py)
    form: str = "plain"  # which form (packing.FORMS)
    document_stats: dict | None = None  # document_stats.row_stats
    saved_peaks: list[float] | None = None  # --count-saved: bytes kept for backward per stage
    segment_tokens: int | None = None  # a token budget per segment (variable lengths)
    backward_by_documents: bool = False  # a micro-batch's runs of documents scheduled apart

    @property
    def split_lengths(self) -> list[int] | None:
        """What the executor is given: None for the documents partition (it cuts each
        micro-batch itself); ``lengths`` are then its nominal (uniform) ones."""
        return None if self.partition == "documents" else self.lengths

    def forward_backward(self, recorder=None) -> Callable:
        """Seq1F1B's forward-backward for this row (with ``recorder``: timed actions)."""
        import megatron_seq1f1b as s1

        return s1.get_forward_backward_func(self.k, self.partition,
                                            split_lengths=self.split_lengths,
                                            recorder=recorder, schedule=self.schedule,
                                            segment_costs=self.segment_costs,
                                            documents=self.documents,
                                            segment_tokens=self.segment_tokens,
                                            backward_by_documents=self.backward_by_documents)

    @contextlib.contextmanager
    def options(self) -> Iterator[None]:
        """Per-schedule model options (set on the shared config only while this one runs)."""
        if not self.recompute:
            yield
            return
        config = self.layout.config
        saved = (config.recompute_granularity, config.recompute_method,
                 config.recompute_num_layers)
        config.recompute_granularity, config.recompute_method = "full", "uniform"
        config.recompute_num_layers = 1
        try:
            yield
        finally:
            (config.recompute_granularity, config.recompute_method,
             config.recompute_num_layers) = saved

    def record(self, result: dict) -> None:
        """Keep one measured run's time, per-stage peak memory and per-stage CPU time."""
        self.times.append(result["time"])
        self.peaks.append(result["peaks"])
        self.cpu.append(result["cpu"])


def backend_attention(args: argparse.Namespace):
    """The attention kind of the benchmark's backend, which every rank knows alike (a rank
    whose stage has no attention layer cannot read it from its chunks): what cuts, fits and
    plans weigh attention by."""
    from megatron_seq1f1b.runtime.model_hooks import AttentionKind

    return AttentionKind.of_backend(args.attention_backend)


def segment_lengths(args: argparse.Namespace, k: int, partition: str, layout: Layout,
                    vocab_size: int) -> list[int]:
    """The lengths the executor itself would choose for this model (passed explicitly), cut
    with the backend's attention on every rank."""
    from megatron_seq1f1b.runtime.executor import resolve_lengths

    return resolve_lengths(k, partition, None, args.seq_length, layout.model, layout.config,
                           vocab_size, attention=backend_attention(args))


def make_schedules(args: argparse.Namespace, layouts: dict[str, Layout], vocab_size: int,
                   plan: Plan | None = None, documents: object = None) -> list[BenchSchedule]:
    """The schedules named by --schedules, in that order, each with its forward-backward.

    ``plan`` (a :class:`megatron_seq1f1b.planner.Plan`, with ``--splits auto``) is what the
    ``seq1f1b-auto`` row runs, and its k is the k of the fixed-k rows (uniform, balanced, ...).
    ``documents``: every Seq1F1B row's documents source, as the trainer passes it (None:
    unpacked data; the documents row then sees one document per sample).
    """
    from megatron.core.pipeline_parallel import schedules as msched

    from megatron_seq1f1b.bench.packing import whole_documents

    if args.splits == AUTO and plan is None:
        raise ValueError("--splits auto: make_schedules needs the planner's plan")
    fixed_k = plan.num_splits if args.splits == AUTO else args.splits
    made = []
    for key in args.schedules:
        interleaved = key in INTERLEAVED
        layout = layouts["interleaved" if interleaved else "plain"]
        v = f", v={args.vpp}" if interleaved else ""
        if key.startswith("1f1b"):
            label = ("Megatron interleaved 1F1B" if interleaved else "Megatron 1F1B") + v
            recompute = key.endswith("-recompute")
            label += " + full recompute" if recompute else ""
            sched = BenchSchedule(key, label, layout, True, 1, None, [args.seq_length],
                                  recompute=recompute)
            sched.fb = msched.get_forward_backward_func(args.pp, args.vpp if interleaved else None)
        else:
            variant = next((z for z in ZERO_BUBBLE if key.endswith(z)), "1f1b")
            sweep = SWEEP_KEY.fullmatch(key)
            if key == AUTO_KEY:
                k, partition, variant = plan.num_splits, plan.partition, plan.schedule
            elif sweep:
                k = int(sweep[1])
                partition = "balanced" if k > 1 else "uniform"
            elif key.startswith("seq1f1b-interleaved"):
                k, partition = fixed_k, args.interleaved_partition
            elif variant != "1f1b":
                k, partition = fixed_k, "balanced"
            else:
                k, partition = fixed_k, key.split("-")[1]
            # the documents partition's nominal lengths are the executor's (uniform)
            nominal = "uniform" if partition == "documents" else partition
            lengths = (list(plan.lengths) if key == AUTO_KEY
                       else segment_lengths(args, k, nominal, layout, vocab_size))
            if key == AUTO_KEY:
                label = f"Seq1F1B auto (k={k}, {partition}, {variant})"
            elif key == DOCUMENTS_KEY:
                label = f"Seq1F1B k={k} documents (cut per micro-batch)"
            else:
                name = "interleaved Seq1F1B" if interleaved else "Seq1F1B"
                label = f"{name} k={k}" + (f" {partition}" if k > 1 else "") + v
                label += f" {variant.upper()}" if variant != "1f1b" else ""
            source = documents
            if source is None and key == DOCUMENTS_KEY:
                source = whole_documents  # unpacked: one document per sample
            sched = BenchSchedule(key, label, layout, False, k, partition, lengths,
                                  schedule=variant,
                                  segment_costs=plan.segment_costs if key == AUTO_KEY else None,
                                  documents=source)
            sched.fb = sched.forward_backward()
        made.append(sched)
    return made
