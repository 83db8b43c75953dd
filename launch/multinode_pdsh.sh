#!/usr/bin/env bash
# A multi-node job from one command: DeepSpeed's default pdsh launcher ssh-es into every host of
# HOSTFILE and starts that node's ranks. Needs pdsh and passwordless ssh to every host.
#   HOSTFILE=configs/hostfile.example MASTER_ADDR=10.0.0.1 bash launch/multinode_pdsh.sh train.py ARGS...
# MASTER_ADDR: an address of the first host that every node can reach (DeepSpeed otherwise asks
# the first host over ssh with `hostname -I` and takes the first address, which may be the wrong
# network). RANKS_PER_NODE caps the ranks per node below the hostfile's slots.
# Only PYTHON*, UCX*, MLFLOW*, MV2* (and NCCL* on GPUs) variables travel to the other nodes; put
# anything else (DS_ACCELERATOR=cpu, GLOO_SOCKET_IFNAME=...) in DS_ENV_FILE, one KEY=VALUE per line,
# no comments (e.g. configs/deepspeed_env.cpu).
set -euo pipefail
: "${HOSTFILE:?set HOSTFILE, e.g. configs/hostfile.example}"
args=(--hostfile "$HOSTFILE" --master_port "${MASTER_PORT:-29500}")
[[ -n "${MASTER_ADDR:-}" ]] && args+=(--master_addr "$MASTER_ADDR")
[[ -n "${RANKS_PER_NODE:-}" ]] && args+=(--num_gpus "$RANKS_PER_NODE")
[[ "${SSH_CHECK:-1}" == 0 ]] && args+=(--no_ssh_check)
export DEEPSPEED_TIMEOUT="${DEEPSPEED_TIMEOUT:-10}"
exec deepspeed "${args[@]}" "$@"
