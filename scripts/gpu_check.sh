#!/usr/bin/env bash
# The GPU check: kernel correctness on CUDA against float64, the kernel benchmark grid (vs cuBLAS, plain torch and
# Liger), the Megatron actor (log-prob pass + one update, tokens/s, MFU, peak memory, next to plan_memory.py), and
# the actor's colocated offload round trip (params, grads, optimizer state to pinned host memory and back, bit-identical),
# in one command that finishes within GPU_CHECK_BUDGET_S (default 530 s: under 9 minutes) on a bare GPU machine.
# Wheels it needs (megatron-core, liger-kernel) are installed offline from .whl/ beside the code (docs/gpu_check.md).
#
#   bash scripts/gpu_check.sh [--out DIR] [--layers N] [--parts a,b]   # on the GPU machine
#   bash scripts/gpu_check.sh --cpu-smoke [--out DIR]                   # the same pieces at tiny shapes on CPU
#
# Exit status: 0 all parts ran and passed; 1 a part failed (a kernel off its float64 tolerance, a crash, a part
# killed at its budget); 2 skipped: no CUDA GPU visible (one line on stderr, nothing measured); 3 the offline wheel
# install failed; 124 the global time guard stopped the run (results so far are in DIR).
set -uo pipefail
START=$(date +%s)
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
BUDGET=${GPU_CHECK_BUDGET_S:-530}
SMOKE=0
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) SMOKE=1; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

if [ "$SMOKE" = 0 ]; then
  REASON=$("$PYTHON" -c 'import torch; print("" if torch.cuda.is_available() else "no CUDA GPU visible to torch")' \
    2>/dev/null) || REASON="torch does not import"
  if [ -n "$REASON" ]; then
    echo "gpu_check: skipped: $REASON ($PYTHON); nothing measured. Run it on the GPU machine (or --cpu-smoke for the CPU pieces)." >&2
    exit 2
  fi
fi

"$PYTHON" -m benchmarks.gpu.wheels --wheel-dir "$WHEELS" || exit 3
SEARCH="$PWD"  # this checkout's megatron_cpo and benchmarks, then the wheels installed offline
[ -d "$WHEELS/site" ] && SEARCH="$SEARCH:$(cd "$WHEELS/site" && pwd)"
export PYTHONPATH="$SEARCH${PYTHONPATH:+:$PYTHONPATH}"

ELAPSED=$(( $(date +%s) - START ))
REMAINING=$(( BUDGET - ELAPSED ))
if [ "$REMAINING" -lt 60 ]; then
  echo "gpu_check: only ${REMAINING} s of the ${BUDGET} s budget left after setup; raise GPU_CHECK_BUDGET_S" >&2
  exit 1
fi
if [ "$SMOKE" = 1 ]; then
  export TRITON_INTERPRET=1
  exec timeout -k 5 "$REMAINING" "$PYTHON" -m benchmarks.gpu.run_check --tiny --device cpu \
    --budget-s $(( REMAINING - 10 )) ${ARGS[@]+"${ARGS[@]}"}
fi
exec timeout -k 5 "$REMAINING" "$PYTHON" -m benchmarks.gpu.run_check --device cuda --budget-s $(( REMAINING - 10 )) \
  ${ARGS[@]+"${ARGS[@]}"}
