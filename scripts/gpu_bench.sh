#!/usr/bin/env bash
# The one-GPU benchmark, prepared for a machine without network (like scripts/gpu_check.sh,
# whose offline install it uses): Megatron-Core's schedule vs Seq1F1B k = 1, 2, 4, 8 and auto,
# side by side, bf16, pipeline size 1, for a ladder of sizes (python -m
# megatron_seq1f1b.bench.gpu --help; docs/benchmarks.md, "One GPU").
#
#   scripts/gpu_bench.sh --prepare-wheels DIR              # where there is network
#   scripts/gpu_bench.sh --wheels DIR [--out DIR] [--venv DIR] [-- BENCHMARK OPTIONS]
#
# Results: OUT/results.json, OUT/results.md, OUT/profile_seq1f1b.txt (default OUT:
# out/gpu_bench), saved after every row, so a run cut short keeps what it measured. Without
# CUDA it stops with a message and exit status 2. About 3-5 minutes on an H200 with the
# default sizes; rows not started within --time-budget-s (400 s) are listed as not run. Add
# `-- --megatron-lm DIR` for Megatron-LM's own loop (a checkout patched by
# scripts/apply_patches.sh or python -m megatron_seq1f1b.patch, ~1-2 minutes more, within the same budget: raise it to ~480).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_check.sh" --usage-from "${BASH_SOURCE[0]}" \
    --run megatron_seq1f1b.bench.gpu "$@"
