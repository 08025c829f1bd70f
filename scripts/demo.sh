#!/usr/bin/env bash
# Set up (if needed), then compare 1F1B and Seq1F1B. Arguments go to the simulator.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$SEQ1F1B_ROOT"
mkdir -p out
echo "== Simulated schedules: Megatron 1F1B vs Seq1F1B (equal unit costs, F=1, B=2) =="
"$SEQ1F1B_PYTHON" -m megatron_seq1f1b.simulate --pp 4 --microbatches 4 --splits 1 4 \
    --png out/schedule_p4_m4.png --trace out/schedule_p4_m4.json "$@"
echo
echo "== Long sequence (32k, 7B-like model, attention-aware costs), p=8, m=16 =="
for partition in uniform balanced; do
    echo "-- $partition partition"
    "$SEQ1F1B_PYTHON" -m megatron_seq1f1b.simulate --pp 8 --microbatches 16 --splits 1 4 \
        --cost attention --partition "$partition"
done
