#!/usr/bin/env bash
# The README's first command: set up (if needed), then train a small GPT with Megatron-Core's
# 1F1B and with Seq1F1B on CPU ranks (gloo), each with Megatron's unfused attention and with
# flash attention, and compare: loss curves, tokens/s, stage-0 peak memory, measured bubbles
# (the schedule's part of the gain), and the measured timelines on one time axis (out/demo/).
#
#   scripts/demo.sh            # four training runs: several minutes on 2 cores after set-up
#   scripts/demo.sh --quick    # a shorter run (CI)
#
# One pipeline stage per core (2 to 4 stages): with more ranks than cores, idle ranks lend
# their core to busy ones and hide the bubbles that Seq1F1B removes. Extra arguments go to
# the training runs; the --seq1f1b-* ones (e.g. --seq1f1b-schedule zb-h1) only to Seq1F1B's.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
# The extra arguments without --seq1f1b and the --seq1f1b-* flags (with their values),
# for Megatron's runs.
plain=()
skip=0
for arg in "$@"; do
    if [ "$skip" = 1 ]; then skip=0; continue; fi
    case "$arg" in
        --seq1f1b|--seq1f1b-*=*) ;;
        --seq1f1b-*) skip=1 ;;
        *) plain+=("$arg") ;;
    esac
done
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$SEQ1F1B_ROOT"
out=out/demo
mkdir -p "$out"

cores=$("$SEQ1F1B_PYTHON" -c "import os; print(len(os.sched_getaffinity(0)))")
stages=$(( cores < 2 ? 2 : (cores > 4 ? 4 : cores) ))
iters=${DEMO_ITERS:-$([ "$quick" = 1 ] && echo 3 || echo 12)}
seq=$([ "$quick" = 1 ] && echo 512 || echo 1024)
echo "== Schedules (simulated, equal unit costs): Megatron 1F1B vs Seq1F1B, p=$stages, m=$stages =="
"$SEQ1F1B_PYTHON" -m megatron_seq1f1b.schedules.simulate --pp "$stages" --microbatches "$stages" \
    --splits 1 4 --png "$out/simulated.png"

# Real allocations on CPU: let freed tensors leave the resident set (see planner/peak_memory.py).
export MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1
common=(--pipeline-model-parallel-size "$stages" --num-layers 4 --hidden-size 256
        --num-attention-heads 4 --seq-length "$seq" --micro-batch-size 1
        --global-batch-size "$stages" --mock-data --vocab-size 1024
        --position-embedding-type rope --train-iters "$iters" --lr 1e-3 --log-interval 2
        --seed 1234)
run() {  # name, extra flags...
    local name=$1; shift
    echo
    echo "== Training on $stages CPU ranks ($cores cores, gloo): $name =="
    # Megatron-Core's and torch's ~30 warning lines per rank on a CPU without Transformer
    # Engine are silenced as Python warnings (not by filtering stderr: an error line stays)
    PYTHONWARNINGS=ignore "$SEQ1F1B_VENV/bin/torchrun" --nproc-per-node "$stages" \
        --master-port "${DEMO_PORT:-29517}" scripts/pretrain_gpt.py "${common[@]}" "$@" \
        --log-json "$out/$name.json" --timeline-dir "$out/$name"
}
seq1f1b=(--seq1f1b --seq1f1b-splits 4 --seq1f1b-partition balanced)
run 1f1b ${plain[@]+"${plain[@]}"}
run seq1f1b "${seq1f1b[@]}" "$@"
# The same pair on flash attention (PyTorch SDPA), which skips masked scores in both schedules.
run 1f1b-flash --attention-backend flash ${plain[@]+"${plain[@]}"}
run seq1f1b-flash "${seq1f1b[@]}" --attention-backend flash "$@"
echo
echo "== Summary =="
"$SEQ1F1B_PYTHON" scripts/compare_runs.py --timelines "$out/timelines.png" \
    "$out/1f1b.json" "$out/seq1f1b.json" "$out/1f1b-flash.json" "$out/seq1f1b-flash.json"
