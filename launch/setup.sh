#!/usr/bin/env bash
# All setup on a fresh machine: the CPU build of torch, faircast-ds (editable) with its test and job
# extras, then each optional component's step in launch/setup.d/ (in name order). Idempotent: a
# second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PY
# Pinned here, for this machine: a range would pull a multi-GB CUDA build. The library itself
# only asks for a range (setup.py).
"$PY" -m pip install -q --disable-pip-version-check "torch==${FAIRCAST_TORCH_VERSION:-2.13.0}"
# DeepSpeed too: setup.py allows deepspeed>=0.16.0,<0.20, this machine runs the newest tested one
# (the other tested releases sit beside it: launch/setup.d/20-deepspeed-releases.sh).
"$PY" -m pip install -q --disable-pip-version-check -e ".[test,job]" "deepspeed==${FAIRCAST_DEEPSPEED_VERSION:-0.19.8}"
for step in launch/setup.d/*.sh; do
  [ -e "$step" ] || continue
  bash "$step"
done
