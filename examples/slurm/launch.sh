#!/usr/bin/env bash
# One megatron-cpo job inside a SLURM allocation (called by the train_*.sbatch files; runs on the batch host).
#
#   Ray head on the first node, Ray workers on the rollout nodes (one `srun` step each), then the torchrun trainer on
#   the trainer nodes (one `srun` step, examples/slurm/trainer_node.sh per node). Trainer rank 0 joins the Ray cluster
#   through RAY_ADDRESS and places the vLLM engines on the rollout nodes' GPUs.
#
# Node split: the first TRAINER_NODES nodes train, the rest roll out. When TRAINER_NODES is the job's node count (the
#   default on one node) every node is shared: the trainer takes its first TRAINER_GPUS_PER_NODE GPUs, Ray the rest.
# Rendezvous and NCCL settings come from SLURM's variables: MASTER_ADDR is the first node, MASTER_PORT and the
#   rendezvous id derive from SLURM_JOB_ID (two jobs sharing a node do not collide).
# Preemption: SIGUSR1 (from `#SBATCH --signal=B:USR1@<seconds>`) or SIGTERM is forwarded to the trainer as SIGTERM
#   (srun -> torchrun -> every rank), which finishes its step and checkpoints; torchrun waits
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (540 here, torch's default is 30) before it SIGKILLs a rank. With REQUEUE=1
#   the job is then requeued and resumes (trainer.resume=auto). Every process this script starts is stopped by its
#   own pid, never by name; launch.log records each pid when it starts and when it is stopped.
#
# Environment: CONFIG (recipe YAML, required unless TRAIN_ENTRY is given), TRAINER_NODES, GPUS_PER_NODE,
#   TRAINER_GPUS_PER_NODE, LOG_ROOT, MASTER_PORT, RAY_PORT, RAY_START_ARGS (extra `ray start` flags for every
#   node), RAY_HEAD_ARGS (for the head only), REQUEUE, TRAIN_ENTRY (what torchrun runs; default
#   "-m megatron_cpo.trainer"), RAY_WAIT_S, RAY_JOIN_ATTEMPTS, TORCH_ELASTIC_SHUTDOWN_TIMEOUT. Extra arguments are
#   dotted config overrides.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

: "${SLURM_JOB_ID:?not inside a SLURM job: submit with sbatch, or see examples/torchrun/ for plain torchrun}"
: "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NUM_NODES=${#NODES[@]}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
TRAINER_NODES=${TRAINER_NODES:-$(( NUM_NODES == 1 ? 1 : NUM_NODES / 2 ))}
if (( TRAINER_NODES < 1 || TRAINER_NODES > NUM_NODES )); then
    echo "error: TRAINER_NODES=$TRAINER_NODES must be in [1, $NUM_NODES] (the job's node count)" >&2
    exit 2
fi
# Shared layout: every node trains and rolls out (the trainer takes the first GPUs, Ray the rest).
SHARED=$(( TRAINER_NODES == NUM_NODES ))
if (( SHARED )); then
    TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$(( GPUS_PER_NODE / 2 ))}
    if (( TRAINER_GPUS_PER_NODE < 1 || TRAINER_GPUS_PER_NODE >= GPUS_PER_NODE )); then
        echo "error: TRAINER_GPUS_PER_NODE=$TRAINER_GPUS_PER_NODE must leave rollout GPUs on a shared node;" \
             "set it in [1, $(( GPUS_PER_NODE - 1 ))] or lower TRAINER_NODES=$TRAINER_NODES" >&2
        exit 2
    fi
else
    TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$GPUS_PER_NODE}
fi
TRAIN_ENTRY=${TRAIN_ENTRY:-"-m megatron_cpo.trainer"}
if [[ $TRAIN_ENTRY == "-m megatron_cpo.trainer" ]]; then
    : "${CONFIG:?set CONFIG to a recipe YAML, e.g. CONFIG=examples/qwen2.5-math-7b/cpo.yaml}"
    TRAIN_ENTRY="$TRAIN_ENTRY --config $CONFIG"
fi

TRAINER_HOSTS=("${NODES[@]:0:TRAINER_NODES}")
HEAD_NODE=${NODES[0]}
if (( SHARED )); then RAY_WORKER_HOSTS=("${NODES[@]:1}"); else RAY_WORKER_HOSTS=("${NODES[@]:TRAINER_NODES}"); fi

export MASTER_ADDR=${MASTER_ADDR:-$HEAD_NODE}
export MASTER_PORT=${MASTER_PORT:-$(( 20000 + SLURM_JOB_ID % 20000 ))}
RAY_PORT=${RAY_PORT:-$(( MASTER_PORT + 1 ))}
export RAY_ADDRESS="$HEAD_NODE:$RAY_PORT"
# Ray's token authentication with one token per job, handed to every srun step through the environment.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [[ $RAY_AUTH_MODE == token && -z ${RAY_AUTH_TOKEN:-} ]]; then
    RAY_AUTH_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
fi
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# torchrun SIGKILLs its ranks this many seconds after forwarding SIGTERM (default 30, too short for a step plus a
# checkpoint): 540 s fits inside the 600 s warning of `#SBATCH --signal=B:USR1@600`.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-540}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
if [[ -n ${NCCL_SOCKET_IFNAME:-} ]]; then export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}; fi
export TRAINER_NODES TRAINER_GPUS_PER_NODE TRAIN_ENTRY

LOG_DIR="${LOG_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/logs}/${SLURM_JOB_NAME:-megatron-cpo}-$SLURM_JOB_ID"
mkdir -p "$LOG_DIR"
export LOG_DIR

# One timestamped line to the batch output and the job's launch.log (appended to across requeues).
note() {
    echo "$(date -u +%FT%TZ) $*" | tee -a "$LOG_DIR/launch.log"
}

# A requeued job keeps its id, so its log folder: the previous attempt's preemption mark must not requeue this one.
if [[ -e $LOG_DIR/preempted ]]; then
    rm -f "$LOG_DIR/preempted"
    note "restart ${SLURM_RESTART_COUNT:-?} of job $SLURM_JOB_ID: cleared the previous attempt's preemption mark"
fi
note "job $SLURM_JOB_ID: nodes ${NODES[*]}; trainer ${TRAINER_HOSTS[*]} x $TRAINER_GPUS_PER_NODE GPUs;" \
     "ray workers ${RAY_WORKER_HOSTS[*]:-(none)}; shared layout $SHARED; rendezvous $MASTER_ADDR:$MASTER_PORT;" \
     "ray $RAY_ADDRESS; preemption grace ${TORCH_ELASTIC_SHUTDOWN_TIMEOUT}s; logs $LOG_DIR"

STARTED_PIDS=()
TRAINER_PID=""

# shellcheck disable=SC2329  # called by the EXIT trap
stop_started() {
    local pid
    for pid in "${STARTED_PIDS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            note "stopping pid $pid"
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for pid in "${STARTED_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}

# shellcheck disable=SC2329  # called by the USR1/TERM trap
on_preempt() {
    note "preemption signal: asking the trainer (pid $TRAINER_PID) to checkpoint"
    touch "$LOG_DIR/preempted"
    if [[ -z $TRAINER_PID ]]; then
        note "the trainer has not started: stopping the job"
        exit 143
    fi
    kill -TERM "$TRAINER_PID" 2>/dev/null || true
}

declare -A WORKER_PID=() WORKER_STARTS=()
HEAD_PID=""
HEAD_STARTS=0

# The Ray head on the first node as its own srun step; its log is appended to across restarts.
start_ray_head() {
    srun --overlap --nodes=1 --ntasks=1 --nodelist="$HEAD_NODE" \
        env ${RAY_DEVICES:+CUDA_VISIBLE_DEVICES=$RAY_DEVICES} \
        ray start --head --block --node-ip-address="$HEAD_NODE" --port="$RAY_PORT" --num-gpus="$HEAD_GPUS" \
        "${ray_extra[@]}" "${ray_head_extra[@]}" >>"$LOG_DIR/ray-head.log" 2>&1 &
    HEAD_PID=$!
    HEAD_STARTS=$(( HEAD_STARTS + 1 ))
    STARTED_PIDS+=("$HEAD_PID")
    note "started the ray head on $HEAD_NODE (pid $HEAD_PID)"
}

# One Ray worker on `host` as its own srun step; its log is appended to across restarts.
start_ray_worker() {
    local host=$1
    srun --overlap --nodes=1 --ntasks=1 --nodelist="$host" \
        env ${RAY_DEVICES:+CUDA_VISIBLE_DEVICES=$RAY_DEVICES} \
        ray start --block --address="$RAY_ADDRESS" --node-ip-address="$host" --num-gpus="$RAY_GPUS" \
        "${ray_extra[@]}" >>"$LOG_DIR/ray-worker-$host.log" 2>&1 &
    WORKER_PID[$host]=$!
    WORKER_STARTS[$host]=$(( ${WORKER_STARTS[$host]:-0} + 1 ))
    STARTED_PIDS+=("$!")
    note "started a ray worker on $host (pid $!)"
}

# Wait until the Ray cluster at RAY_ADDRESS has $1 alive nodes. A node that exits while starting (Ray waits only 30 s
# for its raylet to register, which a loaded node can miss) is started again, up to RAY_JOIN_ATTEMPTS times; the head
# is restarted only before any worker was started.
wait_for_ray_nodes() {
    local expected=$1 deadline=$(( SECONDS + ${RAY_WAIT_S:-300} )) host
    until [[ $(ray status --address="$RAY_ADDRESS" 2>/dev/null | grep -c " node_") -ge $expected ]]; do
        if ! kill -0 "$HEAD_PID" 2>/dev/null; then
            if (( HEAD_STARTS >= ${RAY_JOIN_ATTEMPTS:-3} || ${#WORKER_PID[@]} > 0 )); then
                echo "error: the Ray head exited while starting ($HEAD_STARTS attempt(s));" \
                     "see $LOG_DIR/ray-head.log" >&2
                exit 1
            fi
            note "ray head exited while starting; starting it again"
            start_ray_head
        fi
        for host in "${!WORKER_PID[@]}"; do
            if ! kill -0 "${WORKER_PID[$host]}" 2>/dev/null; then
                if (( WORKER_STARTS[$host] >= ${RAY_JOIN_ATTEMPTS:-3} )); then
                    echo "error: the Ray worker on $host failed to join ${WORKER_STARTS[$host]} times;" \
                         "see $LOG_DIR/ray-worker-$host.log" >&2
                    exit 1
                fi
                note "ray worker on $host exited while joining; starting it again"
                start_ray_worker "$host"
            fi
        done
        if (( SECONDS > deadline )); then
            echo "error: Ray cluster at $RAY_ADDRESS did not reach $expected node(s) within ${RAY_WAIT_S:-300}s;" \
                 "see $LOG_DIR/ray-*.log" >&2
            exit 1
        fi
        sleep 2
    done
}

trap stop_started EXIT
trap on_preempt USR1 TERM

# Ray: in the shared layout every node gives Ray its last GPUs; otherwise the head only coordinates and the rollout
# nodes give Ray all of theirs.
if (( SHARED )); then
    RAY_GPUS=$(( GPUS_PER_NODE - TRAINER_GPUS_PER_NODE ))
    RAY_DEVICES=$(seq -s, "$TRAINER_GPUS_PER_NODE" $(( GPUS_PER_NODE - 1 )))
    TRAINER_DEVICES=$(seq -s, 0 $(( TRAINER_GPUS_PER_NODE - 1 )))
    HEAD_GPUS=$RAY_GPUS
else
    RAY_GPUS=$GPUS_PER_NODE
    RAY_DEVICES=""
    TRAINER_DEVICES=""
    HEAD_GPUS=0
fi
export TRAINER_DEVICES
read -r -a ray_extra <<< "${RAY_START_ARGS:-}"
read -r -a ray_head_extra <<< "${RAY_HEAD_ARGS:-}"
start_ray_head
wait_for_ray_nodes 1

for host in "${RAY_WORKER_HOSTS[@]}"; do
    start_ray_worker "$host"
done

wait_for_ray_nodes $(( 1 + ${#RAY_WORKER_HOSTS[@]} ))
note "ray cluster up: $(( 1 + ${#RAY_WORKER_HOSTS[@]} )) node(s)"

trainer_nodelist=$(IFS=,; echo "${TRAINER_HOSTS[*]}")
srun --overlap --nodes="$TRAINER_NODES" --ntasks-per-node=1 --nodelist="$trainer_nodelist" \
    bash "$SCRIPT_DIR/trainer_node.sh" "$@" >>"$LOG_DIR/trainer.log" 2>&1 &
TRAINER_PID=$!
STARTED_PIDS+=("$TRAINER_PID")
note "started the trainer on ${TRAINER_HOSTS[*]} (pid $TRAINER_PID)"

status=0
while true; do
    wait "$TRAINER_PID" || status=$?
    if (( status > 128 )) && kill -0 "$TRAINER_PID" 2>/dev/null; then status=0; continue; fi
    break
done
if [[ -e $LOG_DIR/preempted ]]; then
    note "trainer exited with status $status after the preemption signal (torchrun reports the SIGTERM it forwarded" \
         "as a failure; trainer.log says which step was checkpointed)"
else
    note "trainer exited with status $status"
fi
if [[ -e $LOG_DIR/preempted && ${REQUEUE:-0} == 1 ]]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
