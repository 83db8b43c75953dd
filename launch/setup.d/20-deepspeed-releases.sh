#!/usr/bin/env bash
# The DeepSpeed releases tests/deepspeed_tests/test_releases.py runs beside the default one (one per era of
# DeepSpeed's internals; the newest is the default install from setup.py's range, pinned in
# launch/setup.sh). Each is a pure-Python source package, installed with --no-deps into its own
# folder under a cache that survives between runs on the same machine, and put first on
# PYTHONPATH by the test; the installed default is never touched. A release already in the cache
# costs nothing (no network). DS_BUILD_OPS=0: no op is compiled at install; DeepSpeed JIT-builds
# what it needs at run time, into a TORCH_EXTENSIONS_DIR of its own per release (set by the test).
# FAIRCAST_DS_AUTOLOAD=0: DeepSpeed's setup.py imports deepspeed, which would load our engine hook.
#   FAIRCAST_DS_RELEASES="0.16.8 0.18.4 0.19.5"   other releases (same cache, same test)
#   FAIRCAST_DS_RELEASE_CACHE=DIR                  the cache (default ~/.cache/faircast-ds)
set -euo pipefail
PY="${PY:-python3}"
CACHE="${FAIRCAST_DS_RELEASE_CACHE:-$HOME/.cache/faircast-ds}"
RELEASES="${FAIRCAST_DS_RELEASES:-0.16.9 0.18.9}"
mkdir -p "$CACHE"
for version in $RELEASES; do
  target="$CACHE/deepspeed-$version"
  # complete installs only: the version file is the package's own, the marker is written last
  if [ -f "$target/.faircast-complete" ] && [ -f "$target/deepspeed/__init__.py" ]; then
    continue
  fi
  rm -rf "$target.partial"
  DS_BUILD_OPS=0 FAIRCAST_DS_AUTOLOAD=0 "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    --target "$target.partial" "deepspeed==$version"
  rm -rf "$target"
  mv "$target.partial" "$target"
  echo "$version" > "$target/.faircast-complete"
  echo "deepspeed $version -> $target"
done
