"""The shipped quickstart learns: GRPO on the tiny warm-started model raises held-out accuracy by 10+ points.

A real run of `python -m megatron_cpo.trainer` (real vLLM CPU engine, real Megatron on gloo, real grading pool) with
`examples/tiny/grpo_arith.yaml`, shortened to 20 steps. Measured: 52.5% -> 73.75% at step 20
(benchmarks/trainer/README.md); the assertion leaves room for a different machine's float reductions.
The same run with every scale path on (token-budget micro-batches, padding-free packing, log-probs fused with the
lm-head, activation recompute) must learn as well: those paths are checked equal to the padded one within 1e-5
(test_scale_paths.py), and this shows nothing is lost over a whole run.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_cpo.data.synthetic import write_arith_parquet

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engine  # a whole training run in a subprocess


SCALE_PATHS = ("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1600",
               "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu=1600",
               "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.use_fused_kernels=true",
               "actor_rollout_ref.model.enable_gradient_checkpointing=true")


@pytest.mark.parametrize("paths", [(), SCALE_PATHS], ids=["padded", "scale_paths"])
def test_grpo_quickstart_raises_held_out_accuracy(tmp_path, paths):
    data = write_arith_parquet(tmp_path / "arith", keep_levels=[1, 2])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "megatron_cpo.trainer", "--config", str(REPO / "examples/tiny/grpo_arith.yaml"),
               f"data.train_files={data['train']}", f"data.val_files={data['test']}",
               f"actor_rollout_ref.model.path={REPO / 'examples/tiny/model'}",
               f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.resume=disable",
               "trainer.total_training_steps=20", "trainer.test_freq=20", "trainer.logger=[jsonl]",
               "actor_rollout_ref.rollout.ray_address=local", *paths]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    accuracy = {row["step"]: row["val/acc"] for row in rows if "val/acc" in row}
    assert sorted(accuracy) == [0, 20]
    assert accuracy[20] - accuracy[0] >= 0.10, f"held-out accuracy {accuracy[0]:.3f} -> {accuracy[20]:.3f}"
