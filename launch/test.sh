#!/usr/bin/env bash
# The whole test suite, DeepSpeed launches included (CPU ranks over gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
# jemalloc into every process of the suite where launch/setup.d/70-jemalloc.sh installed it (docs/testing.md:
# glibc's malloc maps and page-faults each large buffer anew); the same bits, less time in the kernel
jemalloc="$(ldconfig -p 2>/dev/null | awk '/libjemalloc\.so\.2 / && !found {print $NF; found = 1}')"
if [ -n "$jemalloc" ]; then
  export LD_PRELOAD="$jemalloc${LD_PRELOAD:+:$LD_PRELOAD}"
  "${PYTHON:-python3}" -c "import sys; sys.exit('libjemalloc' not in open('/proc/self/maps').read())" \
    || { echo "launch/test.sh: LD_PRELOAD=$LD_PRELOAD did not load jemalloc into python" >&2; exit 1; }
  echo "launch/test.sh: allocator jemalloc ($jemalloc)" >&2
else
  echo "launch/test.sh: allocator glibc malloc (libjemalloc2 not installed: launch/setup.d/70-jemalloc.sh)" >&2
fi
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
