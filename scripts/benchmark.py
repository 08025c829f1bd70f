#!/usr/bin/env python
"""Benchmark Megatron-Core's pipeline schedules against Seq1F1B on one model, side by side.

Launch with torchrun (CPU ranks with gloo, one thread each, or GPUs with NCCL)::

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 2 scripts/benchmark.py \
        --pp 2 --microbatches 4 --splits 4 --seq-length 1024 --hidden-size 256 \
        --num-layers 4 --iters 6 --warmup 2 --out out/bench_p2

One invocation builds the model once per layout (non-interleaved, and
interleaved with ``--vpp``; both hold the same weights, copied across the
layouts) and one fixed set of micro-batches, then runs the schedules
alternately (A B C A B C ...) after warm-up runs:

* ``1f1b``                Megatron-Core 1F1B
* ``seq1f1b-k1``          Seq1F1B with one segment (the cost of our executor)
* ``seq1f1b-uniform``     Seq1F1B, k segments of equal length
* ``seq1f1b-balanced``    Seq1F1B, k segments of equal estimated FLOPs
* ``seq1f1b-documents``   Seq1F1B, k segments cut per micro-batch by its documents (equal
  predicted cost; default with ``--document-length``; on unpacked data one document per sample)
* ``1f1b-interleaved``    Megatron-Core interleaved 1F1B (with ``--vpp``)
* ``seq1f1b-interleaved`` interleaved Seq1F1B (with ``--vpp``)
* ``1f1b-interleaved-recompute`` Megatron interleaved 1F1B with full activation
  recompute (only when named in ``--schedules``): a memory-matched baseline
* ``seq1f1b-k<K>``       Seq1F1B, K balanced segments, one row per ``--sweep-splits`` K
* ``seq1f1b-auto``        with ``--splits auto``: the calibration runs first and
  :func:`megatron_seq1f1b.planner.choose_plan` picks k, partition and schedule (its
  table is printed); reported against the best sweep row (target >= 0.97x its
  tokens/s) with the plan's prediction error

``--attention-backend local|flash`` picks every row's core attention;
``--document-length MEAN`` packs long-tailed documents into every micro-batch
(:mod:`megatron_seq1f1b.bench.packing`, each schedule in its trainer form) and adds
per row the predicted segment cost spread and the attention pairs documents skip
(:mod:`megatron_seq1f1b.bench.document_stats`; results.md "Packed documents").

Each run is one forward-backward over all micro-batches (no optimizer step;
gradient buffers are zeroed between runs); the first run of every schedule
checks that all give the same loss. Reported per schedule: median iteration
time (slowest rank), tokens/s, the paired ratio (median over rounds of the
per-round time ratio), process CPU time per stage, peak memory per pipeline
stage (real allocations, :class:`megatron_seq1f1b.planner.peak_memory.PeakMemory`, above
the resident set at the start of the run), and ratios against Megatron 1F1B.

Then, unless disabled: measured timelines of one extra iteration (the
recorder for Seq1F1B; timed ``forward_step``/``backward_step`` calls for
Megatron), drawn as PNG and Chrome trace; a calibration of every stage's
per-segment forward/backward times and of the p2p message time; a
least-squares fit ``time = a*len + c*quad(len, end) + d`` per stage; and
predictions with :func:`megatron_seq1f1b.schedules.simulate.simulate` (plus a replay
with p2p latency and, when ranks oversubscribe the CPU cores, processor
sharing) for the measured configuration and for larger pipelines.

Outputs in ``--out``: ``results.json``, ``results.md``, ``benchmark.png``,
``timeline_<schedule>_{measured,simulated}.png``, ``timeline_<schedule>_measured.json``
(Chrome trace) and, with ``--profile``, ``profile_<schedule>_rank<r>.txt``.
On CPU set ``MALLOC_MMAP_THRESHOLD_=65536`` before the processes start (see
:mod:`megatron_seq1f1b.planner.peak_memory`); without it peak memory is not valid. CPU
ranks use ``SEQ1F1B_THREADS_PER_RANK`` threads (default 1).

This file is the command line; the work is done by :mod:`megatron_seq1f1b.bench`
(one module per phase), with the model and forward step of
``scripts/pretrain_gpt.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_seq1f1b.bench import cli  # noqa: E402


def load_pretrain_gpt():
    """scripts/pretrain_gpt.py as a module (model_provider, forward_step)."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "scripts" /
                                                  "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    pretrain_gpt = load_pretrain_gpt()
    return cli.main(argv, model_provider=pretrain_gpt.model_provider,
                    forward_step=pretrain_gpt.forward_step)


if __name__ == "__main__":
    raise SystemExit(main())
