#!/usr/bin/env bash
# Quickstart: set up the project's virtual environment, then run the main job on the embedded default (CPU).
# The main job: CPO training of the shipped tiny warm-started model (examples/tiny/model) on the synthetic arithmetic
# task with a vLLM rollout engine, printing held-out greedy accuracy (val/acc) before the first and after the last
# step. The trained policy is kept (checkpoints/step_<last>/huggingface under the run directory); it is then converted
# to a Megatron torch_dist checkpoint at TP=2 (two gloo processes under torchrun) and back to Hugging Face, checked to
# be bit-identical, and asked a held-out question greedily, its answer printed beside the expected one.
# Usage: bash scripts/quickstart.sh [cpo|grpo|dapo]   (outputs under runs/quickstart; MEGATRON_CPO_RUN_DIR overrides)
#        bash scripts/quickstart.sh smollm2 [grpo|dapo|cpo]   the real model instead (scripts/quickstart_smollm2.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = smollm2 ]; then
  shift
  exec bash scripts/quickstart_smollm2.sh "$@"
fi
start=$(date +%s)
bash scripts/setup_env.sh cpu,tools
venv="${MEGATRON_CPO_VENV:-.venv}"
py="$venv/bin/python"
run_dir="${MEGATRON_CPO_RUN_DIR:-runs/quickstart}"
setup_done=$(date +%s)
algorithm="${1:-cpo}"
config="examples/tiny/${algorithm}_arith.yaml"

echo "== synthetic arithmetic data -> $run_dir/arith"
"$py" -c "import sys; from megatron_cpo.data.synthetic import main; main(sys.argv[1:])" \
  --out "$run_dir/arith" --keep-levels 1 2
if [ ! -f examples/tiny/model/config.json ]; then
  echo "== warm-starting the tiny model -> examples/tiny/model (once)"
  "$py" tools/make_tiny_model.py --out examples/tiny/model --warm-start
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
  data.train_files="$run_dir/arith/train.parquet" data.val_files="$run_dir/arith/test.parquet" \
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

# The first held-out question with three operands (the kind the README says RL improves on).
mapfile -t held_out < <("$py" - "$run_dir/arith/test.parquet" <<'PY'
import sys
import pyarrow.parquet as pq
row = next(r for r in pq.read_table(sys.argv[1]).to_pylist() if r["extra_info"]["level"] == 2)
system = next((m["content"] for m in row["prompt"] if m["role"] == "system"), "")
print(system, row["prompt"][-1]["content"], row["reward_model"]["ground_truth"], sep="\n")
PY
)
echo "== greedy answer of the round-tripped policy to a held-out question: ${held_out[1]}"
answer=$("$venv/bin/megatron-cpo" generate --hf "$run_dir/policy-hf" --system "${held_out[0]}" \
  --prompt "${held_out[1]}" --max-new-tokens 48)
echo "$answer"
"$py" - "${held_out[2]}" "$answer" <<'PY'
import ast, sys
from megatron_cpo.rewards import compute_score
expected, printed = sys.argv[1], sys.argv[2]
line = next(l for l in printed.splitlines() if l.startswith("generation ("))
text = ast.literal_eval(line.split(": ", 1)[1])
result = compute_score("megatron_cpo/arith", text, expected)
print(f"expected answer: {expected} | model's answer: {result.get('pred')} | "
      f"{'correct' if result['acc'] else 'wrong'}")
PY

end=$(date +%s)
echo "quickstart done: environment $((setup_done - start)) s, training $((train_done - setup_done)) s, conversion and" \
  "answer $((end - train_done)) s, total $((end - start)) s; trained policy: $policy"
