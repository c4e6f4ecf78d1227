#!/usr/bin/env bash
# Runs on every trainer node (one srun task per node): torchrun with a c10d rendezvous at MASTER_ADDR:MASTER_PORT.
# Node 0 of the step hosts the rendezvous store. `exec` makes torchrun this task's process, so the SIGTERM srun
# forwards reaches torchrun, which passes it to every rank.
set -euo pipefail
: "${SLURM_NODEID:?run through srun}" "${MASTER_ADDR:?}" "${MASTER_PORT:?}" "${TRAINER_NODES:?}"
: "${TRAINER_GPUS_PER_NODE:?}" "${TRAIN_ENTRY:?}"
if [[ -n ${TRAINER_DEVICES:-} ]]; then export CUDA_VISIBLE_DEVICES=$TRAINER_DEVICES; fi
is_host=false
if [[ $SLURM_NODEID == 0 ]]; then is_host=true; fi
read -r -a entry <<< "$TRAIN_ENTRY"
exec torchrun --nnodes="$TRAINER_NODES" --nproc-per-node="$TRAINER_GPUS_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="${SLURM_JOB_ID:-local}" \
    --rdzv-conf="is_host=$is_host" --local-addr="${SLURMD_NODENAME:-$(hostname)}" \
    "${entry[@]}" "$@"
