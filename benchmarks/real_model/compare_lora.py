"""Does LoRA match full fine-tuning? GRPO on SmolLM2-135M: full vs LoRA rank 32 vs rank 1 at an equal sample budget.

    mkdir -p runs/compare_lora
    nohup python benchmarks/real_model/compare_lora.py > runs/compare_lora/runner.log 2>&1 &  # all runs; again: resumes
    python benchmarks/real_model/compare_lora.py --list          # the commands only
    python benchmarks/real_model/compare_lora_report.py          # the tables

compare_cpo.py's machinery (its docstring has the details: one run at a time, seeds round-robin, each run resumable
from its checkpoint, finished runs read and not repeated, SIGTERM or `runs/compare_lora/PAUSE` to pause, `--code` for a
frozen copy of the code) over three arms: `grpo` (examples/smollm2-135m/grpo.yaml, full fine-tuning at lr 1e-5),
`lora_r32` and `lora_r1` (grpo_lora_r32.yaml, grpo_lora_r1.yaml: adapters on every linear layer, alpha 32, lr 1e-4;
the configs say how the rate was chosen); `lora_r32_lr3e-4` and `lora_r1_lr3e-4`, not run by default, are ranks 32
and 1 at 30x full's rate, after both fell behind at 10x (docs/lora.md). Same budget, validation and seeds as the CPO
comparison. Besides the trainer's metrics (held-out accuracy `val/acc`, `timing/update_actor_s`,
`timing/weight_sync_s` per step), each run's `step_cpu.jsonl` records the trainer process's peak resident memory
(`trainer_peak_rss_gib`) at every step.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_cpo import REPO, Comparison, main  # noqa: E402

LORA = Comparison("compare_lora", {"grpo": "grpo.yaml", "lora_r32": "grpo_lora_r32.yaml",
                                   "lora_r1": "grpo_lora_r1.yaml", "lora_r32_lr3e-4": "grpo_lora_r32.yaml",
                                   "lora_r1_lr3e-4": "grpo_lora_r1.yaml"},
                  REPO / "runs" / "compare_lora", default_arms=("grpo", "lora_r32", "lora_r1"),
                  overrides={arm: ("actor_rollout_ref.actor.optim.lr=3.0e-4",)
                             for arm in ("lora_r32_lr3e-4", "lora_r1_lr3e-4")})

if __name__ == "__main__":
    sys.exit(main(comparison=LORA, description=__doc__))
