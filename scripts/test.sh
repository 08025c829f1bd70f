#!/usr/bin/env bash
# Set up (if needed), then run the whole test suite on CPU. Arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$SEQ1F1B_ROOT"
exec "$SEQ1F1B_PYTHON" -m pytest "$@"   # no paths given: pytest.ini's testpaths (tests/)
