#!/usr/bin/env bash
# A prepared check of Seq1F1B on one NVIDIA GPU, for a machine without network.
#
# 1. Where there is network (any machine, no GPU needed; it must run there), build the
#    wheel folder:
#      scripts/gpu_check.sh --prepare-wheels DIR [--python-version 3.12] [--mcore 0.19.2]
#    It downloads megatron-core and its pure-Python dependencies (numpy, packaging)
#    for CPython 3.12 on manylinux x86_64, and builds this package's wheel. torch is
#    not included: the GPU machine's CUDA build of torch is used as it is.
# 2. Copy DIR and this checkout to the GPU machine (PyTorch with CUDA installed,
#    Python 3.12), then:
#      scripts/gpu_check.sh --wheels DIR [--out DIR] [--venv DIR] [-- CHECK OPTIONS]
#    It installs megatron-core and megatron-seq1f1b from DIR only (pip --no-index,
#    nothing is downloaded) into the current Python, or into a venv made with
#    --system-site-packages (so the preinstalled torch is used), then runs
#    `python -m megatron_seq1f1b.bench.gpu_check` (a few minutes; checks not started after
#    7 minutes are skipped, so the whole script stays under 8): Seq1F1B against the
#    full sequence on CUDA (fp32, bf16; local and Transformer Engine attention),
#    CUDA peak memory, and 20 bf16 iterations of scripts/pretrain_gpt.py under
#    torchrun. Results: OUT/gpu_check.json, a table on stdout; exit status 0 when no
#    check failed, 1 when one did, 2 when it could not start.
#
# Options after `--` go to the check (python -m megatron_seq1f1b.bench.gpu_check --help).
# --run MODULE runs another prepared GPU module after the same offline install (its --out is
# OUT; scripts/gpu_bench.sh is this with --run megatron_seq1f1b.bench.gpu).
# PYTHON selects the interpreter (default python3). --dry-run prints the commands only.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MCORE_DEFAULT=0.19.2   # the newest supported release (scripts/setup.sh)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

usage_from="${BASH_SOURCE[0]}"   # --usage-from FILE: a wrapper's header (gpu_bench.sh, ...)
usage() {
    sed -n '2,/^set -euo/p' "$usage_from" | sed '$d' | sed 's/^# \{0,1\}//'
}
die() { echo "gpu_check.sh: $*" >&2; exit 2; }

wheels="" out="" venv="" prepare="" pyver=3.12 mcore="$MCORE_DEFAULT" dry=0
module=megatron_seq1f1b.bench.gpu_check
check_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --usage-from) usage_from="$2"; shift 2 ;;
        --wheels|--out|--venv|--prepare-wheels|--python-version|--mcore|--run)
            [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#--}" = "$2" ] || die "$1 needs a value"
            case "$1" in
                --wheels) wheels="$2" ;; --out) out="$2" ;; --venv) venv="$2" ;;
                --prepare-wheels) prepare="$2" ;; --python-version) pyver="$2" ;;
                --mcore) mcore="$2" ;; --run) module="$2" ;;
            esac
            shift 2 ;;
        --dry-run) dry=1; shift ;;
        --) shift; check_args=("$@"); break ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

# megatron-core's required dependencies but torch, read from its wheel's metadata (one a
# line). Extras are left out; pip evaluates any other environment marker itself.
wheel_requirements() {
    if [ "$dry" = 1 ]; then echo "<megatron-core's requirements but torch>"; return; fi
    "$PY" - "$1" <<'PYTHON'
import re, sys, zipfile
from email.parser import Parser

with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(wheel.read(name).decode())
for requirement in metadata.get_all("Requires-Dist") or []:
    if re.search(r"\bextra\s*==", requirement):
        continue
    if re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower() != "torch":
        print(requirement.strip())
PYTHON
}

# Print a command (shell-quoted) under --dry-run, run it otherwise.
run() {
    if [ "$dry" = 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

PY="${PYTHON:-python3}"

if [ -n "$prepare" ]; then
    [ -z "$wheels" ] || die "--prepare-wheels and --wheels are separate steps (network / GPU machine)"
    [[ "$pyver" =~ ^3\.[0-9]+$ ]] || die "--python-version must look like 3.12, got $pyver"
    download=("$PY" -m pip download --disable-pip-version-check --no-deps --only-binary=:all:
              --dest "$prepare" --python-version "$pyver" --implementation cp
              --abi "cp${pyver/./}" "${PLATFORMS[@]/#/--platform=}")
    run mkdir -p "$prepare"
    run "${download[@]}" "megatron-core==$mcore"
    # Then what megatron-core needs besides torch (0.19: numpy, packaging), as its wheel says.
    shopt -s nullglob; fetched=("$prepare"/megatron_core-"$mcore"-*.whl); shopt -u nullglob
    [ "$dry" = 1 ] || [ ${#fetched[@]} -gt 0 ] || die "megatron-core $mcore was not downloaded"
    mapfile -t requirements < <(wheel_requirements "${fetched[0]:-}")
    [ ${#requirements[@]} -eq 0 ] || run "${download[@]}" "${requirements[@]}"
    # Built from a copy: an in-tree build would leave build/ behind, whose stale files
    # would go into later wheels.
    if [ "$dry" = 1 ]; then src=/tmp/megatron-seq1f1b-src; else src="$(mktemp -d)"; fi
    run cp -r "$ROOT/setup.py" "$ROOT/README.md" "$ROOT/megatron_seq1f1b" "$src/"
    run "$PY" -m pip wheel --disable-pip-version-check --no-deps --wheel-dir "$prepare" "$src"
    run rm -rf "$src"
    if [ "$dry" = 0 ]; then
        ls -1 "$prepare"/megatron_core-"$mcore"-*.whl "$prepare"/megatron_seq1f1b-*.whl >/dev/null \
            || die "the wheels are not all in $prepare"
        echo "[gpu_check.sh] wheels for Python $pyver in $prepare:"
        ls -1 "$prepare" | sed 's/^/  /'
        echo "[gpu_check.sh] next, on the GPU machine: scripts/gpu_check.sh --wheels $prepare"
    fi
    exit 0
fi

[[ "$module" =~ ^megatron_seq1f1b(\.[a-z_]+)+$ ]] || die "--run takes a megatron_seq1f1b module, got $module"
if [ -z "$out" ]; then
    case "$module" in
        megatron_seq1f1b.bench.gpu) out="$ROOT/out/gpu_bench" ;;
        megatron_seq1f1b.bench.gpu_long) out="$ROOT/out/gpu_long" ;;
        megatron_seq1f1b.bench.rehearsal_check) out="$ROOT/out/gpu_rehearse" ;;
        *) out="$ROOT/out/${module##*.}" ;;
    esac
fi
[ -n "$wheels" ] || die "give --wheels DIR (made by --prepare-wheels where there is network); see --help"
[ -d "$wheels" ] || die "--wheels $wheels: no such folder"
shopt -s nullglob
mcore_wheels=("$wheels"/megatron_core-*.whl)
own_wheels=("$wheels"/megatron_seq1f1b-*.whl)
shopt -u nullglob
[ ${#mcore_wheels[@]} -gt 0 ] || die "no megatron_core-*.whl in $wheels (run --prepare-wheels where there is network)"
[ ${#mcore_wheels[@]} -eq 1 ] || die "several megatron-core wheels in $wheels: keep one: ${mcore_wheels[*]##*/}"
[ ${#own_wheels[@]} -gt 0 ] || die "no megatron_seq1f1b-*.whl in $wheels (run --prepare-wheels where there is network)"
mcore_version="$(basename "${mcore_wheels[0]}" | cut -d- -f2)"
out="$(realpath -m "$out")"
wheels="$(realpath -m "$wheels")"

if [ -n "$venv" ]; then
    if [ ! -x "$venv/bin/python" ]; then
        run "$PY" -m venv --system-site-packages "$venv"
    fi
    PY="$venv/bin/python"
fi
if [ "$dry" = 0 ]; then
    "$PY" -c "import torch" 2>/dev/null \
        || die "$PY cannot import torch: install a CUDA build of PyTorch first (or pass --venv/PYTHON)"
fi

# --no-deps for the two packages, their other requirements named: pip then never
# re-resolves the preinstalled torch (whose own requirements need not all be met offline).
pip_offline=("$PY" -m pip install --disable-pip-version-check --no-index --find-links "$wheels")
echo "[gpu_check.sh] installing megatron-core $mcore_version and megatron-seq1f1b from $wheels (offline)"
mapfile -t requirements < <(wheel_requirements "${mcore_wheels[0]}")
[ ${#requirements[@]} -eq 0 ] || run "${pip_offline[@]}" "${requirements[@]}"
run "${pip_offline[@]}" --no-deps "megatron-core==$mcore_version"
# Same version number, newer code: replace whatever megatron-seq1f1b was installed.
run "${pip_offline[@]}" --no-deps --force-reinstall megatron-seq1f1b
if [ "$dry" = 0 ] && ! "$PY" -c "import triton" 2>/dev/null; then
    shopt -s nullglob; triton_wheels=("$wheels"/triton-*.whl); shopt -u nullglob
    if [ ${#triton_wheels[@]} -gt 0 ]; then
        run "${pip_offline[@]}" triton
    else
        echo "[gpu_check.sh] warning: triton does not import and $wheels has no triton wheel;" \
             "megatron-core 0.19 imports it (CUDA builds of torch normally bring it)" >&2
    fi
fi

run "$PY" -W ignore -c "import torch, megatron.core.pipeline_parallel, megatron_seq1f1b; print(f'[gpu_check.sh] torch {torch.__version__} (CUDA {torch.version.cuda}), megatron-core {megatron.core.__version__}')"

# The wheel is built from a checkout; one built before the latest changes would run old code.
# Then this checkout's package goes first on the path (and the results say so).
stale_wheel() {  # from /: Python puts the current folder first, and that may be the checkout
    (cd / && "$PY" - "$ROOT/megatron_seq1f1b") <<'PYTHON'
import sys
from pathlib import Path

import megatron_seq1f1b

installed, checkout = Path(megatron_seq1f1b.__file__).parent, Path(sys.argv[1])
files = lambda root: {p.relative_to(root): p.read_bytes() for p in root.rglob("*.py")}
sys.exit(1 if files(installed) != files(checkout) else 0)
PYTHON
}
if [ "$dry" = 0 ] && ! stale_wheel; then
    echo "[gpu_check.sh] warning: the megatron_seq1f1b wheel in $wheels differs from this" \
         "checkout (rebuild it with --prepare-wheels); running this checkout's code" >&2
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    export SEQ1F1B_STALE_WHEEL=1
fi

# Megatron-Core's fusions are torch.compile'd; Triton builds its launchers with a C compiler
# and Python's headers. Without them, run the fusions eagerly rather than fail every row.
if [ "$dry" = 0 ] && ! "$PY" - <<'PYTHON'
import os, shutil, sys, sysconfig
headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
compiler = shutil.which(os.environ["CC"]) if os.environ.get("CC") else \
    shutil.which("gcc") or shutil.which("clang")  # what Triton's build looks for
sys.exit(0 if headers and compiler else 1)
PYTHON
then
    echo "[gpu_check.sh] warning: no C compiler or Python headers for Triton: torch.compile" \
         "is switched off (TORCHDYNAMO_DISABLE=1); Megatron's fusions run unfused" >&2
    export TORCHDYNAMO_DISABLE=1
fi

# From the output folder, so the installed package is what gets imported.
run mkdir -p "$out"
run cd "$out"
rc=0
if [ "$module" = megatron_seq1f1b.bench.gpu_check ]; then
    run "$PY" -m "$module" --out "$out" \
        --pretrain-script "$ROOT/scripts/pretrain_gpt.py" "${check_args[@]}" || rc=$?
else
    run "$PY" -m "$module" --out "$out" "${check_args[@]}" || rc=$?
fi
[ "$dry" = 1 ] || echo "[gpu_check.sh] $module finished in ${SECONDS} s with exit status $rc; results in $out"
exit $rc
