#!/usr/bin/env bash
# The pre-registered eight-seed campaign of docs/pretrained/campaign/README.md on SmolLM2-135M-Instruct:
# first seeds 0 and 1's first 5 steps again (do they reproduce the committed rows?), then nearest and dither
# on seeds 2-7 (100 steps each, one folder per seed), then the fp32 reference on seed 2. Each run resumes
# from its own checkpoints: running this script again (after a crash, a kill or a session's end) continues.
#   nice -n 15 bash launch/smollm2_campaign.sh [OUT]     # OUT defaults to runs/campaign (ignored by git)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/campaign}"
retries="${RETRIES:-5}"
mkdir -p "$out"
echo 1000 > /proc/self/oom_score_adj 2>/dev/null || true
run() {  # name, then the job's flags
  local name="$1"; shift
  for attempt in $(seq 1 "$retries"); do
    if MASTER_PORT="${MASTER_PORT:-29660}" bash launch/main.sh --model smollm2-135m-instruct --task addition \
        --out "$out" --name "$name" --lr 1e-5 --steps 100 "$@" >> "$out/$name.log" 2>&1; then
      echo "$(date -u +%FT%TZ) $name finished" >> "$out/runs.log"
      return 0
    fi
    echo "$(date -u +%FT%TZ) $name stopped (attempt $attempt); resuming from its checkpoint" >> "$out/runs.log"
    sleep 30
  done
  return 1
}
# reproduction: the first 5 steps of seeds 0 and 1 (a session stops after 5 trained steps per mode run)
for seed in 0 1; do
  for mode in nearest dither; do
    [ -e "$out/repro-seed$seed-$mode/done" ] && continue
    run "repro-seed$seed-$mode" --seed-list "$seed" --modes "$mode" --session-steps 5 && \
      touch "$out/repro-seed$seed-$mode/done"
  done
done
for seed in 2 3 4 5 6 7; do
  run "lr1e-5-seed$seed" --seed-list "$seed" --modes nearest,dither
done
run lr1e-5-fp32-seed2 --seed-list 2 --modes fp32
