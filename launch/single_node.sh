#!/usr/bin/env bash
# One machine, NUM_RANKS ranks, DeepSpeed's local launcher (no hostfile, no ssh).
#   NUM_RANKS=2 bash launch/single_node.sh train.py --deepspeed_config configs/zero3_stochastic.json
# Every multi-node script here takes the same SCRIPT [ARGS...]; see launch/README.md.
set -euo pipefail
# Minutes before a collective that a peer never joins fails the job (DeepSpeed's default: 10).
export DEEPSPEED_TIMEOUT="${DEEPSPEED_TIMEOUT:-10}"
exec deepspeed --num_gpus "${NUM_RANKS:-1}" --master_port "${MASTER_PORT:-29500}" "$@"
