#!/usr/bin/env bash
# Multi-node training without SLURM: run this once on every trainer node, with the same MASTER_ADDR/MASTER_PORT.
#
#   # the rollout cluster first: Ray head on one node, Ray workers on the rollout nodes
#   ray start --head --port=6379 --num-gpus=0                       # on node 0
#   ray start --address=NODE0:6379                                   # on every rollout node
#   # then the trainer, on every trainer node (NODE_RANK 0..NNODES-1):
#   RAY_ADDRESS=NODE0:6379 MASTER_ADDR=NODE0 NNODES=2 NODE_RANK=0 \
#       bash examples/torchrun/train_multinode.sh --config examples/qwen2.5-math-7b/cpo.yaml
#
# Trainer rank 0 joins the Ray cluster through RAY_ADDRESS and places the vLLM engines there. Node ranks are given
# explicitly (static rendezvous at MASTER_ADDR:MASTER_PORT), so a node that starts late is waited for, not renumbered.
# Environment: MASTER_ADDR, NNODES, NODE_RANK (required); MASTER_PORT (29500), NPROC_PER_NODE (GPUs on this node,
# else 8), TRAIN_ENTRY (what torchrun runs; default "-m megatron_cpo.trainer"), TORCH_ELASTIC_SHUTDOWN_TIMEOUT (540).
# Arguments go to the entry. To preempt, send SIGTERM to torchrun on every node: the ranks checkpoint and stop.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}" "${NNODES:?set NNODES to the number of trainer nodes}"
: "${NODE_RANK:?set NODE_RANK to the index of this node in [0, NNODES)}"
if (( NODE_RANK < 0 || NODE_RANK >= NNODES )); then
    echo "error: NODE_RANK=$NODE_RANK must be in [0, NNODES=$NNODES)" >&2
    exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    default_nproc=$(nvidia-smi --list-gpus | wc -l)
else
    default_nproc=8
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-$default_nproc}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# On SIGTERM torchrun forwards it to the ranks (which finish the step and checkpoint) and SIGKILLs them after this many
# seconds (torch's default, 30, is too short for a step plus a checkpoint).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-540}
if [[ -n ${NCCL_SOCKET_IFNAME:-} ]]; then export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}; fi
read -r -a entry <<< "${TRAIN_ENTRY:-"-m megatron_cpo.trainer"}"
exec torchrun --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
    --master-addr="$MASTER_ADDR" --master-port="${MASTER_PORT:-29500}" "${entry[@]}" "$@"
