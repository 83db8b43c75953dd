#!/usr/bin/env bash
# Ray, for the OpenRLHF-style layout test (tests/system/test_ray.py, docs/integrations.md): DeepSpeed ranks
# and the vLLM engine as Ray actors, weight updates through vLLM's RayVLLMWeightSyncClient.
# - ray==2.55.0: the release OpenRLHF 0.11.2 pins (its requirement is ray[default]==2.55.0;
#   30-frameworks.sh installs OpenRLHF with --no-deps). The plain wheel, not [default]: the test
#   starts a local Ray with include_dashboard=False, so the dashboard's extras (aiohttp, grpcio,
#   prometheus, opencensus) are not needed. Ray's wheel is CPU-only (no CUDA packages among its
#   dependencies; every dependency but ray itself is already installed by the earlier steps).
# Idempotent: pip installs nothing when the pinned version is there.
set -euo pipefail
PY="${PY:-python3}"
"$PY" -m pip install -q --disable-pip-version-check "ray==2.55.0"
"$PY" -c "import ray; assert ray.__version__ == '2.55.0', ray.__version__; print('ray', ray.__version__)"
