#!/usr/bin/env bash
# One rank of a SLURM job, torchrun-style: srun starts every rank itself (one task per rank) and
# this maps SLURM's variables to those torch.distributed and DeepSpeed read, then runs the script.
#   srun --nodes=2 --ntasks-per-node=8 --kill-on-bad-exit=1 bash launch/slurm_task.sh train.py ARGS...
# deepspeed.init_distributed() then finds RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set and uses them as is.
# MASTER_ADDR defaults to the first node of the allocation (its name must resolve on every node).
set -euo pipefail
: "${SLURM_PROCID:?run this under srun (SLURM_PROCID is not set)}"
export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID"
export CROSS_RANK="${SLURM_NODEID:-0}"  # the node's index, as DeepSpeed's own launcher sets it
if [[ -z "${MASTER_ADDR:-}" ]]; then
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
fi
export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"
export DEEPSPEED_TIMEOUT="${DEEPSPEED_TIMEOUT:-10}"
exec "${PYTHON:-python3}" -u "$@"
