#!/usr/bin/env bash
# Add NVIDIA Megatron-Bridge to the environment scripts/setup.sh makes (tests/test_bridge.py,
# docs/bridge.md). Quick when nothing changed (a stamp file records what was installed).
#
#   bash scripts/setup_bridge.sh           # or: source it, like scripts/setup.sh
#
# Environment: SEQ1F1B_BRIDGE (default megatron-bridge==0.6.2), and scripts/setup.sh's.
#
# Megatron-Bridge 0.6 declares Python >=3.12 and a large set of packages (Transformer Engine,
# flashinfer, diffusers, peft, datasets, wandb, mlflow, ...) that its conversion path and the
# tests never import. So it is installed without its dependencies (--no-deps, and
# --ignore-requires-python on an older interpreter), as scripts/setup.sh installs megatron-core,
# followed by exactly what that path imports: setup.py's "bridge" extra --
#   transformers (>=5.8,<=5.12.1, Bridge's own range): the HF model classes, configs and
#       checkpoint files AutoBridge reads and writes; brings huggingface_hub, tokenizers,
#       safetensors, regex, pyyaml and tqdm, which Bridge imports too;
#   omegaconf: Bridge's configuration utilities (imported by its model providers);
#   rich: Bridge's conversion progress bars.
# (einops, which Bridge imports too, is already in the test extra.)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
bridge_spec="${SEQ1F1B_BRIDGE:-megatron-bridge==0.6.2}"
bridge_stamp="$SEQ1F1B_VENV/.seq1f1b-bridge"
bridge_want="$(sha256sum "$SEQ1F1B_ROOT/setup.py" "$SEQ1F1B_ROOT/scripts/setup_bridge.sh" \
    | sha256sum | cut -c1-16) $bridge_spec"
if [ "$(cat "$bridge_stamp" 2>/dev/null)" != "$bridge_want" ]; then
    bridge_pip() { "$SEQ1F1B_PYTHON" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
        | grep -v "^WARNING: Location" | grep -v "^megatron-bridge .* requires" \
        | grep -v "^ERROR: pip's dependency resolver does not currently take into account" || true; }
    # (pip lists Bridge's declared dependencies it does not install: the point of --no-deps)
    ignore=()
    if ! "$SEQ1F1B_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
        ignore=(--ignore-requires-python)
        echo "[setup_bridge] $bridge_spec asks for Python >=3.12; this is" \
            "$("$SEQ1F1B_PYTHON" -c 'import platform; print(platform.python_version())'):" \
            "installing it with --ignore-requires-python"
    fi
    echo "[setup_bridge] installing $bridge_spec without its declared dependencies"
    bridge_pip --no-deps "${ignore[@]}" "$bridge_spec"
    echo "[setup_bridge] installing what its conversion path imports (setup.py's bridge extra)"
    bridge_pip -e "$SEQ1F1B_ROOT[test,plot,bridge]"
    "$SEQ1F1B_PYTHON" -W ignore -c "from megatron_seq1f1b.bridge import load_bridge; load_bridge()" \
        >/dev/null 2>&1 || { echo "[setup_bridge] Megatron-Bridge does not import" >&2; exit 1; }
    echo "$bridge_want" > "$bridge_stamp"
fi
