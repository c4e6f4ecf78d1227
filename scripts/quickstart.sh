#!/usr/bin/env bash
# Quickstart: set up the project's virtual environment, then run the main job on the embedded default (CPU).
# The main job: CPO training of the shipped tiny warm-started model (examples/tiny/model) on the synthetic arithmetic
# task with a vLLM rollout engine, printing held-out greedy accuracy (val/acc) before the first and after the last
# step. Then a short tour of the conversion tools: the tiny Qwen2 model converted to a Megatron torch_dist checkpoint
# at TP=2 (two gloo processes under torchrun), loaded back, scored and greedily continued.
# Usage: bash scripts/quickstart.sh [cpo|grpo|dapo]   (outputs under runs/quickstart; MEGATRON_CPO_RUN_DIR overrides)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup_env.sh cpu
venv="${MEGATRON_CPO_VENV:-.venv}"
py="$venv/bin/python"
run_dir="${MEGATRON_CPO_RUN_DIR:-runs/quickstart}"
setup_done=$(date +%s)
algorithm="${1:-cpo}"

echo "== synthetic arithmetic data -> $run_dir/arith"
"$py" -m megatron_cpo.data.synthetic --out "$run_dir/arith" --keep-levels 1 2
if [ ! -f examples/tiny/model/config.json ]; then
  echo "== warm-starting the tiny model -> examples/tiny/model (once)"
  "$py" tools/make_tiny_model.py --out examples/tiny/model --warm-start
fi

echo "== $algorithm training on CPU (examples/tiny/${algorithm}_arith.yaml) -> $run_dir/$algorithm"
"$venv/bin/megatron-cpo" train --config "examples/tiny/${algorithm}_arith.yaml" \
  data.train_files="$run_dir/arith/train.parquet" data.val_files="$run_dir/arith/test.parquet" \
  trainer.default_local_dir="$run_dir/$algorithm" trainer.resume=disable
"$py" - "$run_dir/$algorithm/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
acc = [(row["step"], row["val/acc"]) for row in rows if "val/acc" in row]
print(f"held-out accuracy: {acc[0][1]:.3f} before training (step {acc[0][0]}), {acc[-1][1]:.3f} after step {acc[-1][0]}")
PY
train_done=$(date +%s)

echo "== tiny model -> $run_dir/tiny-hf"
"$py" -c "import sys; from megatron_cpo.models.tiny import write_tiny_model; print(write_tiny_model(sys.argv[1]))" \
  "$run_dir/tiny-hf"

echo "== HF -> Megatron torch_dist at TP=2 (torchrun, 2 processes) -> $run_dir/tiny-mcore"
"$venv/bin/torchrun" --nproc-per-node 2 tools/convert_hf_to_mcore.py \
  --hf "$run_dir/tiny-hf" --out "$run_dir/tiny-mcore" --tp 2 --force

echo "== forward pass and greedy generation from the Megatron checkpoint (loaded at TP=1)"
"$venv/bin/megatron-cpo" generate --mcore "$run_dir/tiny-mcore" --hf-config "$run_dir/tiny-hf" \
  --prompt "What is 12 + 30?" --max-new-tokens 16

end=$(date +%s)
echo "quickstart done: environment $((setup_done - start)) s, training $((train_done - setup_done)) s, total $((end - start)) s"
