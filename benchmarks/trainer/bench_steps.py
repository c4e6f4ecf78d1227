"""Our trainer's seconds per step and generated tokens/s on the quickstart setting (the match of bench_trl.py).

Runs `python -m megatron_cpo.trainer --config examples/tiny/grpo_arith.yaml` for `--steps` steps (no validation
inside the run's steps, no checkpoints) and summarises its metrics JSONL: `timing/step_s` (generation, scoring,
training and the weight push; engine start excluded, and the validation the run makes after its last step),
`timing/generated_tokens` and the phase times. The first `--warmup` steps are left out of the means.

    python -m megatron_cpo.data.synthetic --out DIR --keep-levels 1 2
    python benchmarks/trainer/bench_steps.py --data DIR --steps 12
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="directory with train.parquet and test.parquet")
    parser.add_argument("--config", default="examples/tiny/grpo_arith.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/trainer/steps_results.json")
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides")
    args = parser.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="bench_steps_"))
    data = Path(args.data).resolve()
    command = [sys.executable, "-m", "megatron_cpo.trainer", "--config", args.config,
               f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
               f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
               f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl]",
               "actor_rollout_ref.rollout.ray_address=local", *args.overrides]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    load_before = os.getloadavg()[0]
    subprocess.run(command, cwd=ROOT, env=environment, check=True)
    load_after = os.getloadavg()[0]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((row for row in rows if "timing/step_s" in row), key=lambda row: row["step"])[args.warmup:]

    def mean(key: str) -> float:
        return statistics.fmean(row[key] for row in steps)

    # the run validates after its last step (test_freq=-1 too): that step's validation is not training time
    step_s = [row["timing/step_s"] - row.get("timing/val_s", 0.0) for row in steps]
    result = {
        "command": " ".join(command[1:]), "load_1min_before_after": [load_before, load_after],
        "measured_steps": len(steps), "step_s_mean": statistics.fmean(step_s),
        "step_s_median": statistics.median(step_s),
        "tokens_per_s_mean": statistics.fmean(row["timing/generated_tokens"] / s for row, s in zip(steps, step_s)),
        "generated_tokens_mean": mean("timing/generated_tokens"),
        "phases_s_mean": {key: mean(key) for key in ("timing/gen_s", "timing/update_actor_s", "timing/weight_sync_s",
                                                     "timing/score_s") if all(key in row for row in steps)},
        "step_s_all": step_s,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "step_s_all"}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
