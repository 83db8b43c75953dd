#!/usr/bin/env bash
# One node of a multi-node job, started on that node by you or a scheduler (no ssh, no pdsh):
# run it on every node with the same HOSTFILE, MASTER_ADDR and MASTER_PORT and that node's NODE_RANK
# (its line in HOSTFILE, from 0).
#   HOSTFILE=configs/hostfile.example NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash launch/node.sh train.py ARGS...
# MASTER_ADDR: an address of node 0 that every node can reach. RANKS_PER_NODE caps the ranks per
# node below the hostfile's slots. On several networks, pin the one to use with GLOO_SOCKET_IFNAME
# (CPU/gloo) or NCCL_SOCKET_IFNAME (GPUs). DEEPSPEED_TIMEOUT (minutes) bounds the rendezvous and
# every collective for scripts that let deepspeed.initialize set up the process group.
set -euo pipefail
: "${HOSTFILE:?set HOSTFILE, e.g. configs/hostfile.example}"
: "${NODE_RANK:?set NODE_RANK (the line of this node in HOSTFILE, from 0)}"
: "${MASTER_ADDR:?set MASTER_ADDR (an address of node 0)}"
args=(--hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR"
      --master_port "${MASTER_PORT:-29500}")
[[ -n "${RANKS_PER_NODE:-}" ]] && args+=(--num_gpus "$RANKS_PER_NODE")
export DEEPSPEED_TIMEOUT="${DEEPSPEED_TIMEOUT:-10}"

deepspeed "${args[@]}" "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
rc=0
wait "$child" || rc=$?
while kill -0 "$child" 2>/dev/null; do  # a trapped signal ends `wait` early: wait for the real status
  rc=0
  wait "$child" || rc=$?
done
if [[ "$rc" != 0 ]]; then
  echo "[launch/node.sh] node $NODE_RANK ($(hostname)) FAILED: deepspeed exited with code $rc. The first error" \
       "above names the cause; a peer node that died shows as a gloo/NCCL 'Connection closed by peer'," \
       "one that stopped answering as a timeout (DEEPSPEED_TIMEOUT minutes, or the script's own" \
       "init_distributed timeout)." >&2
fi
exit "$rc"
