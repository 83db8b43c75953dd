#!/usr/bin/env bash
# The long runs of docs/pretrained.md (issue 34 item 3) on SmolLM2-135M-Instruct, one after another, each
# resuming from its own checkpoints: running this script again (or after a crash or a kill) continues where
# the runs stopped. Per-step CSVs: <out>/<name>/steps.csv.
#   nice -n 15 bash launch/smollm2_runs.sh [OUT]        # OUT defaults to runs/smollm2 (in the repository, ignored)
# On a shared machine the runs volunteer to be killed first when memory runs out (oom_score_adj 1000), and
# each job is retried (up to RETRIES times) from its newest checkpoint after such a kill.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/smollm2}"
retries="${RETRIES:-5}"
mkdir -p "$out"
echo 1000 > /proc/self/oom_score_adj 2>/dev/null || true
port="${MASTER_PORT:-29650}"
pause=60
source launch/smollm2_run.sh
# lr 1e-5: nearest and dither on seed 0 first, 100 steps each, rollouts from `vllm serve`
run lr1e-5-seed0 --lr 1e-5 --steps 100 --seed-list 0 --modes nearest,dither
# then lr 1e-6 (the paper's rate): nearest and dither on one seed, 50 steps, for the changed fraction
run lr1e-6-seed0 --lr 1e-6 --steps 50 --seed-list 0 --modes nearest,dither
# the second seed at lr 1e-5
run lr1e-5-seed1 --lr 1e-5 --steps 100 --seed-list 1 --modes nearest,dither
# the fp32 reference, on the same rollout random numbers (its own float32 `vllm serve` engine)
run lr1e-5-fp32 --lr 1e-5 --steps 100 --seed-list 0 --modes fp32
