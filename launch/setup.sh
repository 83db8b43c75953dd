#!/usr/bin/env bash
# All setup on a fresh machine: the CPU build of torch, then faircast-ds (editable) with its test
# and job extras. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# Pinned here, for this machine: a range would pull a multi-GB CUDA build. The library itself
# only asks for a range (setup.py).
"$PY" -m pip install -q --disable-pip-version-check "torch==${FAIRCAST_TORCH_VERSION:-2.13.0}"
"$PY" -m pip install -q --disable-pip-version-check -e ".[test,job]"
