#!/usr/bin/env bash
# The main job: 2 CPU ranks under the `deepspeed` runner, one ZeRO-3 run per cast mode.
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
exec deepspeed --num_gpus "${NUM_RANKS:-2}" --module faircast_ds.jobs.staleness "$@"
