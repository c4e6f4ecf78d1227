#!/usr/bin/env bash
# Quickstart: set up the project's virtual environment, then run the main job on the embedded default.
# Today's main job: write the tiny Qwen2 model (HF layout), convert it to a Megatron torch_dist checkpoint at TP=2
# (two gloo processes under torchrun), then load that checkpoint into Megatron-Core, run a forward pass over a chat
# prompt and greedily generate a few tokens.
# Usage: bash scripts/quickstart.sh            (outputs under runs/quickstart; MEGATRON_CPO_RUN_DIR overrides)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup_env.sh cpu
venv="${MEGATRON_CPO_VENV:-.venv}"
py="$venv/bin/python"
run_dir="${MEGATRON_CPO_RUN_DIR:-runs/quickstart}"
setup_done=$(date +%s)

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
echo "quickstart done: environment $((setup_done - start)) s, job $((end - setup_done)) s, total $((end - start)) s"
