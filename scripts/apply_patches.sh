#!/usr/bin/env bash
# Apply (or check, or revert) the Seq1F1B patches to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR            apply (idempotent)
#   scripts/apply_patches.sh MEGATRON_LM_DIR --check    report only, change nothing
#   scripts/apply_patches.sh MEGATRON_LM_DIR --revert   revert the applied patches
#   ... --force-version TAG       use TAG's patches, whatever version the checkout reports
#
# A thin wrapper: the applier is megatron_seq1f1b/megatron_lm/patch.py (standard library
# only), run from this clone, whose patches are in
# megatron_seq1f1b/megatron_lm/patches/megatron-lm/<tag>/. Where the package is installed
# (pip), the same program is `python -m megatron_seq1f1b.patch` and the
# `seq1f1b-patch` command. Options, messages and exit statuses: see that module
# (0 done or already in the requested state; 1 patches do not apply or version
# unsupported; 2 usage; 3 --check found the checkout partly patched).
#
# Python: $SEQ1F1B_PYTHON, else this clone's .venv, else python3 / python
# (3.8 or newer; nothing beyond the standard library is imported).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

python=""
for candidate in "${SEQ1F1B_PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 8))' 2>/dev/null; then
        python="$candidate"; break
    fi
done
if [ -z "$python" ]; then
    echo "$(basename "$0"): no Python 3.8 or newer found (set SEQ1F1B_PYTHON)" >&2
    exit 1
fi

# This clone's package (and its patches) come first, whatever else is installed; messages
# name the script as it was called (what to type again).
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" SEQ1F1B_PATCH_PROG="$0" \
    exec "$python" -m megatron_seq1f1b.megatron_lm.patch "$@"
