#!/usr/bin/env bash
# The megatron-core releases tests/megatron_tests/test_megatron_releases.py runs beside the default install (0.16.1,
# pinned in launch/setup.sh): the oldest of the supported range, megatron-core>=0.12.0,<0.20, that
# installs on this Python (0.17.0 and later declare Requires-Python >=3.12 and ship cp312 wheels only,
# so on Python 3.11 the newest installable is 0.16.1, the default). Each is installed with --no-deps
# into its own folder under a cache that survives between runs on the same machine and put first on
# PYTHONPATH by the test; the installed default is never touched. A release already in the cache costs
# nothing (no network). The wheels carry one compiled helper (megatron/core/datasets), unused here.
#   FAIRCAST_MEGATRON_RELEASES="0.12.0 0.13.1 0.15.3"   other releases (same cache, same test)
#   FAIRCAST_DS_RELEASE_CACHE=DIR                        the cache (default ~/.cache/faircast-ds)
set -euo pipefail
PY="${PY:-python3}"
CACHE="${FAIRCAST_DS_RELEASE_CACHE:-$HOME/.cache/faircast-ds}"
RELEASES="${FAIRCAST_MEGATRON_RELEASES:-0.12.0}"
mkdir -p "$CACHE"
for version in $RELEASES; do
  target="$CACHE/megatron-core-$version"
  # complete installs only: the version file is the package's own, the marker is written last
  if [ -f "$target/.faircast-complete" ] && [ -f "$target/megatron/core/package_info.py" ]; then
    continue
  fi
  rm -rf "$target.partial"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$target.partial" "megatron-core==$version"
  rm -rf "$target"
  mv "$target.partial" "$target"
  echo "$version" > "$target/.faircast-complete"
  echo "megatron-core $version -> $target"
done
