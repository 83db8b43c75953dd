#!/usr/bin/env bash
# jemalloc, the allocator launch/test.sh preloads into the test suite's processes (docs/testing.md).
# Under glibc's malloc every buffer over 32 MiB (ZeRO-3's gathered parameters, AdamW's temporaries, the
# oracles' float64 work arrays) is a fresh mmap, page-faulted again each time it is made; jemalloc reuses
# freed extents. It changes where memory comes from, not what any kernel computes. From Debian's archive
# (libjemalloc2): a registry package, no binary fetched from elsewhere. Not a requirement of faircast-ds:
# where it cannot be installed (no apt, not root) the suite runs under glibc's malloc and says so.
# Idempotent: nothing is installed when the library is there.
set -uo pipefail
# the library's path as the loader knows it, empty if absent (awk reads the whole list: an early exit would
# SIGPIPE ldconfig, which pipefail turns into a failure)
installed() { ldconfig -p 2>/dev/null | awk '/libjemalloc\.so\.2 / && !found {print $NF; found = 1}'; }
if [ -n "$(installed)" ]; then
  echo "jemalloc: $(installed)"
  exit 0
fi
if ! command -v apt-get > /dev/null || [ "$(id -u)" != 0 ]; then
  echo "jemalloc: not installed (needs apt-get as root); launch/test.sh will run under glibc's malloc" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends libjemalloc2 > /dev/null 2>&1 \
  || { apt-get update -q > /dev/null 2>&1 && apt-get install -y -q --no-install-recommends libjemalloc2 > /dev/null; } \
  || { echo "jemalloc: apt-get install libjemalloc2 failed; launch/test.sh will run under glibc's malloc" >&2; exit 0; }
ldconfig
echo "jemalloc: $(installed)"
