"""Megatron-Core's pipeline schedules and Seq1F1B side by side: the code behind
``scripts/benchmark.py`` (method and results in docs/benchmarks.md).

Data flows one way, runner -> measurements -> reports:

* :mod:`.cli`          flags, and ``main`` wiring the phases below in order
* :mod:`.layouts`      one model per layout (plain, interleaved), same weights; the batches
* :mod:`.lineup`       the schedules compared, and each one's measurements
* :mod:`.packing`      ``--document-length``: long-tailed packed documents, each schedule's form
* :mod:`.document_stats` per row: predicted segment cost spread, attention pairs skipped (pure)
* :mod:`.ranks`        rank-0 printing, device sync, values gathered per pipeline stage
* :mod:`.runner`       one timed forward-backward; warm-up, loss check, alternating rounds
* :mod:`.timelines`    per-action timings of real iterations (Megatron's and ours)
* :mod:`.calibration`  per-segment forward/backward times and p2p message times
* :mod:`.fit`          cost fits from those samples (pure)
* :mod:`.autoplan`     ``--splits auto``: the planner's choice from those samples
* :mod:`.sharing`      replay with p2p latency and processor sharing (pure)
* :mod:`.predict`      simulated iterations from the fits (pure, after the calibration)
* :mod:`.summary`, :mod:`.markdown`, :mod:`.pictures`  rows, tables, charts and timelines
* :mod:`.units`        byte units of logs and reports
* :mod:`.p2p_latency`  a gloo receive's wait posted late or ahead (two ranks; its own CLI)

One GPU (``scripts/gpu_*.sh``, one process each): :mod:`.gpu_check` (Seq1F1B equal to the
full sequence on CUDA), :mod:`.gpu` (Megatron's schedule vs Seq1F1B per size, host and GPU
time per unit), :mod:`.gpu_long` (long sequences with the flash attention, calibrations),
:mod:`.rehearsal_check` and :mod:`.predictions` (a pipeline stage rehearsed alone, published
configurations predicted from one-GPU calibrations).

Nothing here imports Megatron-Core at import time; the phases that run models
import it when called.
"""
