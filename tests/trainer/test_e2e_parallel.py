"""Whole training runs with two trainer processes under one rank-0 controller: PP=2, then DP=2 (the same two
processes and engine).

Rank 0 drives the engine and broadcasts the batch; with PP=2 both pipeline stages export their layers straight into
the engine; with DP=2 only the first replica exports (a second copy of the weights would be loaded twice).
The run must log the same first-step rollout metrics as the layout-independent controller would and finish with
held-out accuracy, i.e. the collective protocol (batch broadcast, log-prob broadcast, weight push from two senders,
checkpoint barrier) completes. The model has tied embeddings (with PP=2 the last stage keeps its own copy of the
embedding as the output layer, which is never sent) and trains at learning rate 3e-2: after every push the engine's
log-probs, of its samples and of the sync probe, equal the trainer's.
"""
import json
import os

from tests.multiprocess import free_port, run_processes
from tests.rollout.servers import assert_engine_in_sync


LAYOUTS = {"pp2": 2, "dp2": 1}  # layout: pipeline_model_parallel_size (the other factor of the 2 ranks is DP)


def train_both_layouts(rank, world_size, model_dir, data, run_dir, second_port):
    """A PP=2 run, then a DP=2 run, in the same two processes: rank 0 starts the engine once and both runs push
    their weights into it (a run always pushes before its first rollout). The second run's process group meets on
    its own port, so that a rank done with the first run cannot join the first run's store."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_cpo.config import build_config
    from megatron_cpo.rollout.modes import build_rollout_manager
    from megatron_cpo.trainer.components import engine_launch_config
    from megatron_cpo.trainer.loop import run_training

    configs = {layout: build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data['train']}",
        f"data.val_files={data['test']}", "data.train_batch_size=2", "data.max_prompt_length=384",
        "data.max_response_length=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=3e-2",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pipeline_size}",
        "actor_rollout_ref.rollout.ray_address=local",
        "reward.num_workers=1", "reward.custom_reward_function=tests.trainer.graders:even_first_character",
        "trainer.total_training_steps=2", "trainer.save_freq=2", f"trainer.default_local_dir={run_dir}/{layout}",
        "trainer.logger=[jsonl]"]) for layout, pipeline_size in LAYOUTS.items()}
    pp2 = configs["pp2"]
    manager = build_rollout_manager(pp2.actor_rollout_ref.rollout, engine_launch_config(pp2)) if rank == 0 else None
    results = {}
    try:
        for index, (layout, config) in enumerate(configs.items()):
            if index:
                os.environ["MASTER_PORT"] = str(second_port)
            results[layout] = run_training(config, manager)
    finally:
        if manager is not None:
            manager.shutdown()
    return results


def test_two_rank_training_runs(tiny_model, arith_data, tmp_path):
    """PP=2 and DP=2, one run each (one engine start for both)."""
    results = run_processes(train_both_layouts, 2, tiny_model, arith_data, str(tmp_path / "run"), free_port(),
                            timeout=1200)
    for layout in LAYOUTS:
        run_dir = tmp_path / "run" / layout
        assert "val/acc" in results[0][layout] and results[1][layout] == {}, layout
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [0, 1, 2], layout  # the last step's row carries the final validation
        assert_engine_in_sync({row["step"]: row for row in rows}, (1, 2))
        step_dir = run_dir / "checkpoints" / "step_000002"
        assert sorted(p.name for p in step_dir.iterdir()) == ["huggingface", "manifest.json", "rank_00000.pt",
                                                              "rank_00001.pt"]
        manifest = json.loads((step_dir / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and sorted(manifest["files"]) == ["rank_00000.pt", "rank_00001.pt"]
        assert_loads_as_the_tiny_model(step_dir / "huggingface", tiny_model)


def assert_loads_as_the_tiny_model(exported, original):
    """The checkpoint's Hugging Face export (both pipeline stages' layers, or one replica's) loads with every weight."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    reference = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    tokenizer = AutoTokenizer.from_pretrained(exported)
    ids = torch.tensor([tokenizer.encode("Compute 1+2.")])
    assert torch.isfinite(model(ids).logits).all()
