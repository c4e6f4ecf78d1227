"""A whole GRPO run of a tiny Qwen3-MoE at EP=2 on two trainer ranks (each holds two of the four experts) with a
real vLLM engine, routing replay R2 on, three steps.

Every step's engine log-probs must equal the trainer's old log-probs to float32 noise (`mismatch/log_probs_diff_max`):
the engine generated with the weights of the previous step's push (experts gathered over EP, the CPU MoE layers
re-prepacked after every reload), and the trainer scored the same tokens at EP=2. The run logs its routing metrics,
and the update's routing is the recorded one at every step. (The dense Qwen3 run shares the push test's engine:
tests/rollout/test_family_sync.py.)
"""
import json
import os

import pytest

from tests.multiprocess import run_processes

pytestmark = pytest.mark.engine  # rank 0 starts the engine (conftest cannot see it through run_processes)

STEPS = 3


def train_at_ep2(rank, world_size, model_dir, data, run_dir):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.assemble import run_training

    return run_training(build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data['train']}",
        f"data.val_files={data['test']}", "data.train_batch_size=2", "data.max_prompt_length=384",
        "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.ray_address=local",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        "actor_rollout_ref.actor.router_replay.mode=R2", "trainer.val_before_train=false",
        "reward.num_workers=1", "reward.custom_reward_function=tests.trainer.graders:even_first_character",
        f"trainer.total_training_steps={STEPS}", f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl]"]))


def test_qwen3_moe_at_ep2_trains_with_the_engine_in_step(arith_data, tmp_path):
    from megatron_cpo.models.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "qwen3_moe", family="qwen3_moe", seed=0)
    results = run_processes(train_at_ep2, 2, str(model_dir), arith_data, str(tmp_path / "run"), timeout=1200)
    assert "val/acc" in results[0] and results[1] == {}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    mismatch = [row["mismatch/log_probs_diff_max"] for row in rows]
    assert all(diff < 1e-4 for diff in mismatch), mismatch  # float32 noise, every step
    for row in rows:
        assert row["actor/grad_norm"] > 0
        assert row["moe/topk_changed_fraction"] == 0  # R2: the update routed as the old-log-prob pass
        assert row["moe/expert_load_max_over_mean"] >= 1 and row["moe/router_entropy"] > 0
        assert {"moe/expert_load_max_over_mean/layer_1", "moe/expert_load_max_over_mean/layer_3"} <= set(row)
    # the last step's checkpoint holds the actor as a Hugging Face model, every expert gathered from both ranks
    from safetensors import safe_open

    exported = tmp_path / "run" / "checkpoints" / f"step_{STEPS:06d}" / "huggingface"
    names = [name for file in exported.glob("*.safetensors") for name in safe_open(file, "pt").keys()]
    assert sum(".mlp.experts." in name for name in names) == 2 * 4 * 3  # 2 MoE layers x 4 experts x 3 matrices
