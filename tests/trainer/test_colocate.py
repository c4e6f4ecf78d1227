"""`rollout.mode=colocate` end to end on CPU: the quickstart's DAPO config (shortened, filter off) trains with its
engine started on the trainer's node by `build_rollout_manager` (its own process tree, loopback, a random token,
no Ray), weights pushed over shared memory; after each run's last push the engine generates transformers' greedy
tokens for that step's exported weights, and a resumed run continues from the checkpoint on the same engine; the
quickstart's GRPO and CPO configs then train one step each on it."""
import json
from pathlib import Path

import psutil
import pytest

from megatron_cpo.trainer.loop import run_training
from tests.rollout.servers import greedy_matches_transformers

pytestmark = pytest.mark.usefixtures("restore_environment")
TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny"


def _config(arith_data, out_dir, steps, *extra, example="dapo_arith.yaml"):
    from megatron_cpo.config import load_config

    return load_config(TINY / example, [
        f"data.train_files={arith_data['train']}", f"data.val_files={arith_data['test']}", "data.train_batch_size=4",
        "data.max_response_length=12", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", f"actor_rollout_ref.model.path={TINY / 'model'}",
        "actor_rollout_ref.rollout.mode=colocate", "algorithm.filter_groups.enable=false", "reward.overlong_buffer.len=4", "trainer.test_freq=-1",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]", "trainer.save_freq=1",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out_dir}", "trainer.logger=[jsonl]",
        *extra])


def test_colocated_training_pushes_into_its_own_engine_and_resumes(arith_data, tmp_path, caplog):
    import ray

    from megatron_cpo.rollout.colocate import ColocatedRolloutManager
    from megatron_cpo.rollout.modes import build_rollout_manager

    out = tmp_path / "run"
    ray_was_running = ray.is_initialized()
    with caplog.at_level("INFO", logger="megatron_cpo.rollout.colocate"):
        manager = build_rollout_manager(_config(arith_data, out, 2))
    assert "vLLM sleep/wake does nothing here" in caplog.text
    assert isinstance(manager, ColocatedRolloutManager) and len(manager.engines) == 1
    assert manager.engines[0].startswith("http://127.0.0.1:") and manager.weight_transport == "shm"
    engine_pids = [p.pid for p in psutil.Process(manager._processes[0].pid).children(recursive=True)]
    try:
        first = run_training(_config(arith_data, out, 2), manager)
        assert first["rollout/engines_alive"] == 1.0
        greedy_matches_transformers(manager, out / "checkpoints" / "step_000002" / "huggingface")
        resumed = run_training(_config(arith_data, out, 3, "trainer.resume=auto"), manager)
        assert "val/acc" in resumed
        steps = sorted({json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()})
        assert steps == [0, 1, 2, 3]
        greedy_matches_transformers(manager, out / "checkpoints" / "step_000003" / "huggingface")
        for example in ("grpo_arith.yaml", "cpo_arith.yaml"):  # the quickstart's other two configs, one step each
            other = tmp_path / example.split(".")[0]
            metrics = run_training(_config(arith_data, other, 1, example=example), manager)
            assert metrics["rollout/engines_alive"] == 1.0 and "val/acc" in metrics
            greedy_matches_transformers(manager, other / "checkpoints" / "step_000001" / "huggingface")
    finally:
        manager.shutdown()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in engine_pids), "the colocated engine's processes outlive the manager"
    assert ray.is_initialized() == ray_was_running, "colocate mode must not start Ray"
