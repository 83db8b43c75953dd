#!/usr/bin/env bash
# The reward effect inside TRL's own loop (docs/integrations.md): the recipe of examples/trl_grpo/ on SmolLM2-135M-Instruct,
# round-to-nearest and dither, seeds 0 and 1, 100 steps each at lr 1e-5, 2 CPU ranks, TRL's colocated vLLM engine
# and its importance-sampling correction as TRL ships it. Each run is a user's run: its own DeepSpeed JSON (the
# recipe's, with the mode changed) named by its own Accelerate config, both written into the run's folder. Runs
# checkpoint every 10 steps and resume from the newest checkpoint: running this script again (after a crash, a
# kill or a session's end) continues each unfinished run; a finished one (its done.json) is skipped. OUT is ignored
# by git and does not outlive its checkout: after each finished run the rows of every run go to KEPT
# (examples/trl_grpo/summarize.py: the rows, runs.json, the table and the plot), and a run KEPT records as
# finished is not run again. Commit KEPT after each finished run.
#   nice -n 19 bash launch/trl_seeds.sh [OUT]     # OUT defaults to runs/trl (ignored by git)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/trl}"
kept="${KEPT:-docs/trl_runs}"
retries="${RETRIES:-5}"
steps="${STEPS:-100}"
seeds="${SEEDS:-0 1}"
modes="${MODES:-nearest dither}"
mkdir -p "$out"
echo 1000 > /proc/self/oom_score_adj 2>/dev/null || true
for seed in $seeds; do
  for mode in $modes; do
    run="$out/$mode-seed$seed"
    [ -e "$run/done.json" ] && continue
    "${PYTHON:-python3}" -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get(sys.argv[2], {}).get('finished') else 1)" \
      "$kept/runs.json" "$mode-seed$seed" 2>/dev/null && continue
    mkdir -p "$run"
    "${PYTHON:-python3}" - "$run" "$mode" <<'PY' || exit 1
import json, sys
from pathlib import Path
run, mode = Path(sys.argv[1]).resolve(), sys.argv[2]
recipe = Path("examples/trl_grpo")
ds = json.loads((recipe / "ds_zero3_fair_cast.json").read_text())
ds["fair_cast"]["mode"] = mode
(run / "ds_config.json").write_text(json.dumps(ds, indent=2) + "\n")
text = (recipe / "accelerate_2ranks.yaml").read_text()
old = "deepspeed_config_file: examples/trl_grpo/ds_zero3_fair_cast.json"
assert old in text, "the recipe's Accelerate config no longer names its DeepSpeed JSON as expected"
(run / "accelerate.yaml").write_text(text.replace(old, f"deepspeed_config_file: {run / 'ds_config.json'}"))
PY
    for attempt in $(seq 1 "$retries"); do
      if accelerate launch --main_process_port "${MASTER_PORT:-29680}" --config_file "$run/accelerate.yaml" \
          examples/trl_grpo/grpo_addition.py --seed "$seed" --steps "$steps" --lr 1e-5 --output "$run" \
          --save-every 10 --resume >> "$run.log" 2>&1; then
        "${PYTHON:-python3}" -c "import json,sys; json.dump({'steps': int(sys.argv[2])}, open(sys.argv[1], 'w'))" \
          "$run/done.json" "$steps"
        echo "$(date -u +%FT%TZ) $mode-seed$seed finished" >> "$out/runs.log"
        "${PYTHON:-python3}" examples/trl_grpo/summarize.py "$out" "$kept" >> "$out/runs.log" 2>&1 || exit 1
        break
      fi
      echo "$(date -u +%FT%TZ) $mode-seed$seed stopped (attempt $attempt); resuming from its checkpoint" >> "$out/runs.log"
      sleep "${PAUSE:-30}"
    done
  done
done
