#!/usr/bin/env bash
# Stage rehearsal on one NVIDIA GPU (issue 27), for a machine without network.
#
# Wheels: the same folder scripts/gpu_check.sh --prepare-wheels DIR makes where there is
# network (megatron-core, its requirements, this package). On the GPU machine:
#   scripts/gpu_rehearse.sh --wheels DIR [--out DIR] [--venv DIR] [--no-calibrate] [-- OPTIONS]
#   scripts/gpu_rehearse.sh --no-install ...   (megatron-core and this package already import)
# It installs megatron-core and megatron-seq1f1b from DIR only (pip --no-index; the install of
# scripts/gpu_check.sh, whose --venv and --dry-run it takes too), then runs
# `python -m megatron_seq1f1b.bench.rehearsal_check --out OUT --calibrate`:
#   1. stage 0 of configuration (a) (GPT 1.3B, PP=4, 32768 tokens, 4 micro-batches, bf16,
#      flash attention, Adam with the distributed optimizer) rehearsed alone with k=1 and
#      k=4 balanced: the CUDA peak (weights, gradients, Adam states, activations) against
#      the planner's predicted total for that stage, within 10 %; the planner's command
#      line for the same layout (about 1-2 minutes);
#   2. (unless --no-calibrate; none starts after 300 s) the first, a middle and the last
#      stage of both configurations rehearsed with --save-calibration, then
#      `python -m megatron_seq1f1b.bench.predictions` on them (about 3-4 minutes).
#   A run still going 420 s after the start (--limit-s) is killed and fails its check.
# Results: OUT/gpu_rehearse.json (checks, numbers; rewritten after every step),
# OUT/rehearse_k{1,4}.json, OUT/plan.json, OUT/calibrations/, OUT/predictions.{json,md}; a
# summary on stdout. More than 8 files: on the lent GPU, tar OUT into one. Exit status 0
# when no check failed, 1 when one did, 2 when it could not start.
#
# Options after `--` go to the check (python -m megatron_seq1f1b.bench.rehearsal_check --help).
# PYTHON selects the interpreter (default python3). --dry-run prints the commands only.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
install=1 calibrate=(--calibrate) dry=0 out="$ROOT/out/gpu_rehearse"
forward=() check_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
                   exit 0 ;;
        --no-install) install=0; shift ;;
        --no-calibrate) calibrate=(); shift ;;
        --dry-run) dry=1; forward+=("$1"); shift ;;
        --out) [ $# -ge 2 ] || { echo "gpu_rehearse.sh: --out needs a value" >&2; exit 2; }
               out="$2"; shift 2 ;;
        --) shift; check_args=("$@"); break ;;
        *) forward+=("$1"); shift ;;
    esac
done
if [ "$install" = 1 ]; then
    exec bash "$ROOT/scripts/gpu_check.sh" --run megatron_seq1f1b.bench.rehearsal_check \
        --out "$out" "${forward[@]}" -- "${calibrate[@]}" "${check_args[@]}"
fi
# --no-install: megatron-core is there; this checkout's package, from OUT
out="$(realpath -m "$out")"
command=("${PYTHON:-python3}" -m megatron_seq1f1b.bench.rehearsal_check --out "$out"
         "${calibrate[@]}" "${check_args[@]}")
if [ "$dry" = 1 ]; then
    printf '+'; printf ' %q' "${command[@]}"; printf '\n'
    exit 0
fi
mkdir -p "$out" && cd "$out"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${command[@]}"
