#!/usr/bin/env bash
# What each cast mode costs a delta weight sync on SmolLM2-135M-Instruct (issue 49 item 3, docs/modes.md):
# nearest, dither, stochastic and error feedback, 10 steps each at lr 1e-5 and at lr 1e-6, seed 0. Each row of
# <out>/<name>/steps.csv carries sync_bytes (the delta the export's encodings would send: change marks or
# indices plus the changed values) and sync_bytes_dense (the whole bf16 model). Resumable like the campaign:
#   nice -n 15 bash launch/smollm2_delta.sh [OUT]      # OUT defaults to runs/delta (ignored by git)
#   python3 -m faircast_jobs.delta_table OUT           # the table of docs/modes.md
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/delta}"
retries="${RETRIES:-5}"
mkdir -p "$out"
echo 1000 > /proc/self/oom_score_adj 2>/dev/null || true
port="${MASTER_PORT:-29680}"
pause=30
source launch/smollm2_run.sh
for lr in 1e-5 1e-6; do
  run "lr$lr" --lr "$lr" --steps 10 --seed-list 0 --modes nearest,dither,stochastic,error_feedback
done
