#!/usr/bin/env bash
# The whole test suite, DeepSpeed launches included (CPU ranks over gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
