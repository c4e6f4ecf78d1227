"""Session-wide real components for the trainer tests: a tiny model (Llama with tied embeddings), the arithmetic
data, one vLLM engine serving it, and one serving the quickstart's warm-started model."""
import os
from pathlib import Path

import pytest

from megatron_cpo.config import build_config

WARM_MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"


@pytest.fixture
def restore_environment():
    """init_distributed records its one-process rendezvous in os.environ; give the next run a fresh one (test files
    that train in-process use it for every test: `pytestmark = pytest.mark.usefixtures("restore_environment")`)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_model(tied_llama_dir) -> str:
    """The trainer tests' model: the tiny Llama with tied embeddings (tests/conftest.py), as the path string configs
    take. Tied, so that a weight push that leaves the engine's output head behind shows in every run's
    `mismatch/*` metrics and sync check (issue 24)."""
    return str(tied_llama_dir)


@pytest.fixture(scope="session")
def arith_data(tmp_path_factory):
    from megatron_cpo.data.synthetic import ArithConfig, write_arith_parquet

    paths = write_arith_parquet(tmp_path_factory.mktemp("trainer_arith"), ArithConfig(num_train=64, num_test=8))
    return {split: str(path) for split, path in paths.items()}


@pytest.fixture(scope="session")
def rollout_manager(ray_cluster, tiny_model):
    """One real vLLM engine (Ray actor, in the session's private cluster) for every test of the session; runs reuse
    it and push their weights."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_cpo.rollout import EngineLaunchConfig, RolloutEngineConfig, RolloutManager

    manager = RolloutManager(EngineLaunchConfig(model_path=tiny_model, dtype="float32", max_model_len=512, seed=1,
                                                engines=RolloutEngineConfig(kv_cache_gib=1, ray_address="local")))
    yield manager
    manager.shutdown()


@pytest.fixture(scope="session")
def warm_engine(ray_cluster):
    """One engine of the quickstart's warm-started model (examples/tiny/model; the other engines serve random models):
    the learning run and the multi-turn runs, whose episodes need a model that ends its turns."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_cpo.rollout import EngineLaunchConfig, RolloutEngineConfig, RolloutManager

    manager = RolloutManager(EngineLaunchConfig(model_path=str(WARM_MODEL), dtype="float32", max_model_len=512, seed=1,
                                                engines=RolloutEngineConfig(kv_cache_gib=1, ray_address="local")))
    yield manager
    manager.shutdown()


@pytest.fixture
def small_run_overrides(tiny_model, arith_data, tmp_path):
    """Dotted overrides of a small run on the session's model and data (also passed to `megatron-cpo train`)."""
    return [f"actor_rollout_ref.model.path={tiny_model}", f"data.train_files={arith_data['train']}",
            f"data.val_files={arith_data['test']}", "data.train_batch_size=4", "data.max_prompt_length=384",
            "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-3",
            "reward.num_workers=1", "reward.custom_reward_function=tests.trainer.graders:even_first_character",
            f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]"]


@pytest.fixture
def make_config(small_run_overrides):
    """A small run config on the session's model and data; keyword overrides use dotted names."""
    def make(*overrides: str):
        return build_config({}, [*small_run_overrides, *overrides])
    return make
