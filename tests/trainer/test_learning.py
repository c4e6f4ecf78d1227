"""The GRPO example config learns: on the tiny warm-started model it raises held-out accuracy by 10+ points.

A real run of `examples/tiny/grpo_arith.yaml` (real vLLM CPU engine, real Megatron on gloo, real grading pool),
shortened to 20 steps, with every scale path on (token-budget micro-batches, padding-free packing, log-probs fused
with the lm-head, activation recompute). Those paths are checked equal to the padded one within 1e-5 on one batch
(test_scale_paths.py), and every other end-to-end run of the suite trains on the padded path; this shows that nothing
is lost over a whole run of batches of every shape. Measured on the padded path: 52.5% -> 73.75% at step 20
(benchmarks/trainer/README.md); the assertion leaves room for a different machine's float reductions. The run is in
this process, on the session's engine of the warm-started model (`warm_engine`, shared with the multi-turn runs): the
trainer as a `python -m megatron_cpo.trainer` process is what the run-recovery, SLURM and two-rank tests start.
"""
from pathlib import Path

import pytest

from megatron_cpo.config import load_config
from megatron_cpo.data.synthetic import write_arith_parquet
from megatron_cpo.trainer.assemble import run_training
from tests.trainer.test_e2e import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("restore_environment")

SCALE_PATHS = ("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1600",
               "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu=1600",
               "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.use_fused_kernels=true",
               "actor_rollout_ref.model.enable_gradient_checkpointing=true")


def test_grpo_quickstart_on_the_scale_paths_raises_held_out_accuracy(tmp_path, warm_engine):
    data = write_arith_parquet(tmp_path / "arith", keep_levels=[1, 2])
    config = load_config(str(REPO / "examples/tiny/grpo_arith.yaml"), [
        f"data.train_files={data['train']}", f"data.val_files={data['test']}",
        f"actor_rollout_ref.model.path={REPO / 'examples/tiny/model'}",
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.resume=disable",
        "trainer.total_training_steps=20", "trainer.test_freq=20", "trainer.logger=[jsonl]", *SCALE_PATHS])
    run_training(config, warm_engine)
    accuracy = {step: row["val/acc"] for step, row in read_metrics(tmp_path / "run").items() if "val/acc" in row}
    assert sorted(accuracy) == [0, 20]
    assert accuracy[20] - accuracy[0] >= 0.10, f"held-out accuracy {accuracy[0]:.3f} -> {accuracy[20]:.3f}"
