#!/usr/bin/env bash
# Create or reuse a virtual environment with torch, Megatron-Core and this package.
#
#   source scripts/setup.sh      # sets SEQ1F1B_PYTHON to the environment's python
#
# Quick when nothing changed: a stamp file records what was installed.
# torch is installed first and pinned (2.13.0 unless SEQ1F1B_TORCH says otherwise)
# so that pip does not pull a multi-GB CUDA build as a dependency of megatron-core.
# An environment that already has torch keeps it (e.g. a CUDA build on a GPU machine).
set -euo pipefail

SEQ1F1B_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SEQ1F1B_VENV="${SEQ1F1B_VENV:-$SEQ1F1B_ROOT/.venv}"
torch_spec="${SEQ1F1B_TORCH:-torch==2.13.0}"

if [ ! -x "$SEQ1F1B_VENV/bin/python" ]; then
    echo "[setup] creating $SEQ1F1B_VENV"
    "${PYTHON:-python3}" -m venv "$SEQ1F1B_VENV"
fi
SEQ1F1B_PYTHON="$SEQ1F1B_VENV/bin/python"

stamp="$SEQ1F1B_VENV/.seq1f1b-setup"
want="$(cat "$SEQ1F1B_ROOT/setup.py" "$SEQ1F1B_ROOT/scripts/setup.sh" | sha256sum | cut -c1-16) $torch_spec"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    pip_install() { "$SEQ1F1B_PYTHON" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
        | grep -v "^WARNING: Location" || true; }
    if ! "$SEQ1F1B_PYTHON" -c "import torch" 2>/dev/null; then
        echo "[setup] installing $torch_spec (first, so megatron-core does not pull another build)"
        pip_install "$torch_spec"
    fi
    echo "[setup] installing megatron-core and megatron-seq1f1b (editable) with test and plot extras"
    pip_install -e "$SEQ1F1B_ROOT[test,plot]"
    "$SEQ1F1B_PYTHON" -W ignore -c "import torch, megatron.core, megatron_seq1f1b" \
        || { echo "[setup] installation failed" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
export SEQ1F1B_ROOT SEQ1F1B_VENV SEQ1F1B_PYTHON
