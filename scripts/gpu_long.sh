#!/usr/bin/env bash
# Long sequences on one GPU, prepared for a machine without network (scripts/gpu_check.sh's
# offline install): pipeline stages of a 1.3B and a 7B-shaped GPT at 32k-64k tokens with the
# SDPA flash attention, Megatron-Core's schedule vs Seq1F1B k = 1, 2, 4, 8 (balanced and
# uniform), per-unit times saved as planner calibrations, and the longest sequence that trains
# (python -m megatron_seq1f1b.bench.gpu_long --help; docs/benchmarks.md, "Long sequences on
# one GPU").
#
#   scripts/gpu_long.sh --prepare-wheels DIR              # where there is network
#   scripts/gpu_long.sh --wheels DIR [--out DIR] [--venv DIR] [-- OPTIONS]
#
# Results: OUT/results.json, OUT/results.md, OUT/calibration_*.json (default OUT:
# out/gpu_long). Without CUDA it stops with a message and exit status 2. Its time budget
# (--time-budget-s, default 390 s) keeps it, with the install, inside 8 minutes.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_check.sh" --usage-from "${BASH_SOURCE[0]}" \
    --run megatron_seq1f1b.bench.gpu_long "$@"
