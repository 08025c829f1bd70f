#!/usr/bin/env bash
# The README's main command: set up (if needed), then train a tiny GPT on 4 CPU ranks
# with Seq1F1B and with Megatron's 1F1B, and compare. Extra arguments go to both runs.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$SEQ1F1B_ROOT"
mkdir -p out

echo "== Schedules (simulated, equal unit costs): Megatron 1F1B vs Seq1F1B, p=4, m=8 =="
"$SEQ1F1B_PYTHON" -m megatron_seq1f1b.simulate --pp 4 --microbatches 8 --splits 1 4 \
    --png out/schedule_p4_m8.png

# Real allocations on CPU: let freed tensors leave the resident set (see memory.py).
export MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1
nproc=4
common=(--pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 128
        --num-attention-heads 4 --seq-length 512 --micro-batch-size 1 --global-batch-size 8
        --mock-data --vocab-size 1024 --position-embedding-type rope --train-iters "${DEMO_ITERS:-24}"
        --lr 1e-3 --log-interval 4 --seed 1234)
run() {  # name, extra flags...
    local name=$1; shift
    echo
    echo "== Training on $nproc CPU ranks (gloo): $name =="
    "$SEQ1F1B_VENV/bin/torchrun" --nproc-per-node "$nproc" --master-port "${DEMO_PORT:-29517}" \
        scripts/pretrain_gpt.py "${common[@]}" "$@" --log-json "out/demo_$name.json" \
        2> >(grep -v -i "warn" >&2)
}
run 1f1b "$@"
run seq1f1b --seq1f1b --seq1f1b-splits 4 --seq1f1b-partition balanced "$@"
echo
echo "== Side by side =="
"$SEQ1F1B_PYTHON" scripts/compare_runs.py out/demo_1f1b.json out/demo_seq1f1b.json
