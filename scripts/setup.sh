#!/usr/bin/env bash
# Create or reuse a virtual environment with torch, Megatron-Core and this package.
#
#   source scripts/setup.sh      # sets SEQ1F1B_PYTHON to the environment's python
#
# Environment:
#   SEQ1F1B_VENV   where the environment lives (default: .venv in the repository)
#   SEQ1F1B_TORCH  the torch requirement (default torch==2.13.0)
#   SEQ1F1B_MCORE  the Megatron-Core version (default: the newest supported, below)
#
# Quick when nothing changed: a stamp file records what was installed; a
# different SEQ1F1B_MCORE installs that version over the old one.
# torch is installed first and pinned so that pip does not pull a multi-GB
# CUDA build as a dependency of megatron-core; an environment that already
# has torch keeps it (e.g. a CUDA build on a GPU machine).
# megatron-core 0.17 and later declare Requires-Python >=3.12 but publish
# cp311 wheels that work: on an older interpreter they are installed with
# --ignore-requires-python (megatron-core alone; its dependencies resolve
# normally), and the script says so. 0.19 imports triton, which it does not
# declare: it is installed when the import asks for it.
set -euo pipefail

SEQ1F1B_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SEQ1F1B_VENV="${SEQ1F1B_VENV:-$SEQ1F1B_ROOT/.venv}"
SEQ1F1B_MCORE_NEWEST=0.19.2   # keep in step with setup.py's megatron-core range
torch_spec="${SEQ1F1B_TORCH:-torch==2.13.0}"
mcore_version="${SEQ1F1B_MCORE:-$SEQ1F1B_MCORE_NEWEST}"

if [ ! -x "$SEQ1F1B_VENV/bin/python" ]; then
    echo "[setup] creating $SEQ1F1B_VENV"
    "${PYTHON:-python3}" -m venv "$SEQ1F1B_VENV"
fi
SEQ1F1B_PYTHON="$SEQ1F1B_VENV/bin/python"

stamp="$SEQ1F1B_VENV/.seq1f1b-setup"
want="$(cat "$SEQ1F1B_ROOT/setup.py" "$SEQ1F1B_ROOT/scripts/setup.sh" | sha256sum | cut -c1-16) $torch_spec megatron-core==$mcore_version"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    pip_install() { "$SEQ1F1B_PYTHON" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
        | grep -v "^WARNING: Location" || true; }
    if ! "$SEQ1F1B_PYTHON" -c "import torch" 2>/dev/null; then
        echo "[setup] installing $torch_spec (first, so megatron-core does not pull another build)"
        pip_install "$torch_spec"
    fi

    installed="$("$SEQ1F1B_PYTHON" -c "import importlib.metadata as m; print(m.version('megatron-core'))" 2>/dev/null || true)"
    if [ "$installed" != "$mcore_version" ]; then
        # The release's Requires-Python, read from the index without installing anything.
        requires="$("$SEQ1F1B_PYTHON" -m pip download --disable-pip-version-check -q --no-deps \
            --ignore-requires-python -d "$SEQ1F1B_VENV/.seq1f1b-wheels" "megatron-core==$mcore_version" \
            >/dev/null 2>&1 && "$SEQ1F1B_PYTHON" - "$SEQ1F1B_VENV/.seq1f1b-wheels" "$mcore_version" <<'EOF'
import sys, zipfile, pathlib
from email.parser import Parser
wheel = next(pathlib.Path(sys.argv[1]).glob(f"megatron_core-{sys.argv[2]}-*.whl"))
with zipfile.ZipFile(wheel) as zf:
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    print(Parser().parsestr(zf.read(name).decode()).get("Requires-Python") or "")
EOF
)" || { echo "[setup] no megatron-core==$mcore_version wheel for this Python" \
            "($("$SEQ1F1B_PYTHON" -c 'import platform; print(platform.python_version())')) on the" \
            "package index; 0.17 and later publish cp311 and newer only: on Python 3.10 use" \
            "SEQ1F1B_MCORE=0.16.1 (docs/supported.md)" >&2; exit 1; }
        ignore=()
        if [ -n "$requires" ] && ! "$SEQ1F1B_PYTHON" - "$requires" <<'EOF'
import sys, platform
from pip._vendor.packaging.specifiers import SpecifierSet  # pip is in every venv
sys.exit(0 if platform.python_version() in SpecifierSet(sys.argv[1]) else 1)
EOF
        then
            ignore=(--ignore-requires-python)
            echo "[setup] megatron-core $mcore_version asks for Python $requires; this is" \
                "$("$SEQ1F1B_PYTHON" -c 'import platform; print(platform.python_version())'):" \
                "installing its wheel with --ignore-requires-python"
        fi
        echo "[setup] installing megatron-core==$mcore_version"
        pip_install --no-deps "${ignore[@]}" "$SEQ1F1B_VENV/.seq1f1b-wheels/megatron_core-$mcore_version-"*.whl
    fi
    rm -rf "$SEQ1F1B_VENV/.seq1f1b-wheels"

    echo "[setup] installing megatron-seq1f1b (editable) with test and plot extras"
    pip_install -e "$SEQ1F1B_ROOT[test,plot]"
    import_error="$("$SEQ1F1B_PYTHON" -c "import megatron.core.pipeline_parallel" 2>&1 || true)"
    if [[ "$import_error" == *"No module named 'triton'"* ]]; then
        echo "[setup] megatron-core $mcore_version imports triton: installing it"
        pip_install triton
    fi
    "$SEQ1F1B_PYTHON" -W ignore -c "import torch, megatron.core.pipeline_parallel, megatron_seq1f1b" \
        || { echo "[setup] installation failed" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
export SEQ1F1B_ROOT SEQ1F1B_VENV SEQ1F1B_PYTHON
