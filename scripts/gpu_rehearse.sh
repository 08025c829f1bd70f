#!/usr/bin/env bash
# Stage rehearsal on one NVIDIA GPU (issue 27), for a machine without network.
#
# Wheels: the same folder scripts/gpu_check.sh --prepare-wheels DIR makes where there is
# network (megatron-core, its requirements, this package). On the GPU machine:
#   scripts/gpu_rehearse.sh --wheels DIR [--out DIR] [--venv DIR] [--no-calibrate] [-- OPTIONS]
#   scripts/gpu_rehearse.sh --no-install ...   (megatron-core and this package already import)
# It installs megatron-core and megatron-seq1f1b from DIR only (pip --no-index), then runs
# `python -m megatron_seq1f1b.bench.rehearsal_check --out OUT --calibrate`:
#   1. stage 0 of configuration (a) (GPT 1.3B, PP=4, 32768 tokens, 4 micro-batches, bf16,
#      flash attention, Adam with the distributed optimizer) rehearsed alone with k=1 and
#      k=4 balanced: the CUDA peak (weights, gradients, Adam states, activations) against
#      the planner's predicted total for that stage, within 10 %; the planner's command
#      line for the same layout (about 1-2 minutes);
#   2. (unless --no-calibrate; none starts after 300 s) the first, a middle and the last
#      stage of both configurations rehearsed with --save-calibration, then
#      `python -m megatron_seq1f1b.bench.predictions` on them (about 3-4 minutes).
# Results: OUT/gpu_rehearse.json (checks, numbers), OUT/rehearse_k{1,4}.json, OUT/plan.json,
# OUT/calibrations/, OUT/predictions.{json,md}; a summary on stdout. Exit status 0 when no
# check failed, 1 when one did, 2 when it could not start.
#
# Options after `--` go to the check (python -m megatron_seq1f1b.bench.rehearsal_check --help).
# PYTHON selects the interpreter (default python3). --dry-run prints the commands only.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}
die() { echo "gpu_rehearse.sh: $*" >&2; exit 2; }

wheels="" out="$ROOT/out/gpu_rehearse" venv="" dry=0 install=1 calibrate=(--calibrate)
check_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --wheels|--out|--venv)
            [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#--}" = "$2" ] || die "$1 needs a value"
            case "$1" in
                --wheels) wheels="$2" ;; --out) out="$2" ;; --venv) venv="$2" ;;
            esac
            shift 2 ;;
        --no-install) install=0; shift ;;
        --no-calibrate) calibrate=(); shift ;;
        --dry-run) dry=1; shift ;;
        --) shift; check_args=("$@"); break ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

run() {
    if [ "$dry" = 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

PY="${PYTHON:-python3}"
case "$PY" in */*) PY="$(realpath -m "$PY")" ;; esac   # the check runs from OUT
if [ "$install" = 1 ]; then
    [ -n "$wheels" ] || die "give --wheels DIR (scripts/gpu_check.sh --prepare-wheels DIR makes it), or --no-install"
    [ -d "$wheels" ] || die "--wheels $wheels: no such folder"
    shopt -s nullglob
    mcore_wheels=("$wheels"/megatron_core-*.whl)
    own_wheels=("$wheels"/megatron_seq1f1b-*.whl)
    shopt -u nullglob
    [ ${#mcore_wheels[@]} -eq 1 ] || die "need exactly one megatron_core-*.whl in $wheels, found ${#mcore_wheels[@]}"
    [ ${#own_wheels[@]} -gt 0 ] || die "no megatron_seq1f1b-*.whl in $wheels"
    wheels="$(realpath -m "$wheels")"
fi
out="$(realpath -m "$out")"

if [ -n "$venv" ]; then
    [ -x "$venv/bin/python" ] || run "$PY" -m venv --system-site-packages "$venv"
    PY="$venv/bin/python"
fi
if [ "$dry" = 0 ]; then
    "$PY" -c "import torch" 2>/dev/null \
        || die "$PY cannot import torch: install a CUDA build of PyTorch first (or pass --venv/PYTHON)"
fi

if [ "$install" = 1 ]; then
    # Every wheel of the folder, no dependency resolution: the preinstalled torch stays;
    # this package again even at the same version number (newer code).
    echo "[gpu_rehearse.sh] installing the wheels of $wheels (offline)"
    pip_offline=("$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile)
    run "${pip_offline[@]}" "$wheels"/*.whl
    run "${pip_offline[@]}" --force-reinstall "${own_wheels[@]}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # this checkout
fi

run mkdir -p "$out"
run cd "$out"   # the installed package is what gets imported
rc=0
run "$PY" -m megatron_seq1f1b.bench.rehearsal_check --out "$out" "${calibrate[@]}" \
    "${check_args[@]}" || rc=$?
[ "$dry" = 1 ] || echo "[gpu_rehearse.sh] finished in ${SECONDS} s with exit status $rc; summary: $out/gpu_rehearse.json"
exit $rc
