#!/usr/bin/env bash
# The multi-turn learning result of README.md: GRPO on two-try arithmetic episodes (examples/tiny/arith_retry.yaml)
# with the tiny warm-started model, then its curves. Extra arguments are dotted overrides of the run.
#   bash benchmarks/multi_turn/run_arith_retry.sh                      # writes runs/multi_turn_arith_retry/
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/multi_turn_arith_retry}
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" -m megatron_cpo.data.synthetic --out "$OUT/data" --keep-levels 1 2
"$PYTHON" -m megatron_cpo.trainer --config examples/tiny/arith_retry.yaml \
    data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/test.parquet" \
    trainer.default_local_dir="$OUT/run" trainer.resume=disable actor_rollout_ref.rollout.ray_address=local "$@"
"$PYTHON" tools/plot_metrics.py "$OUT/run/metrics.jsonl" --labels "GRPO, arith_retry" \
    --out "${CURVES:-benchmarks/multi_turn/curves_arith_retry.png}"
