"""Multi-turn training end to end on CPU: FrozenLake (3x3 boards, one move digit per turn) for 3 steps of up to 3
turns, real Megatron, a real vLLM engine (Ray mode, in the session's cluster) serving the quickstart's warm-started
model (a random model never ends a turn, so no episode would reach a second one), real grading pool. The loss is spied
on (the real function is called; the spy only records): every token whose loss mask is 0 (an observation) has zero
gradient, observation tokens sit between sampled ones, the engine's log-prob of an observation token is 0, and the
trainer's log-probs of the sampled tokens equal the engine's (alignment across turns). Then verl's tool agent with
the tool and interaction YAML of tests/fixtures/multi_turn trains a step on the same engine."""
import os
from pathlib import Path

import pytest
import torch

import megatron_cpo.trainer.workers.actor as actor_module
from megatron_cpo.envs.frozen_lake import write_frozen_lake_parquet
from megatron_cpo.trainer.loop import run_training
from tests.trainer.test_e2e import read_metrics

pytestmark = pytest.mark.usefixtures("restore_environment")
WARM_MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"


@pytest.fixture(scope="module")
def warm_engine(ray_cluster):
    """One engine of the warm-started model (the session's engines serve random models of other families)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_cpo.rollout import EngineLaunchConfig, RolloutEngineConfig, RolloutManager

    manager = RolloutManager(EngineLaunchConfig(model_path=str(WARM_MODEL), dtype="float32", max_model_len=512, seed=1,
                                                engines=RolloutEngineConfig(kv_cache_gib=1, ray_address="local")))
    yield manager
    manager.shutdown()


def test_frozen_lake_trains_three_steps_and_observation_tokens_carry_no_loss(make_config, warm_engine, tmp_path,
                                                                             monkeypatch):
    data = write_frozen_lake_parquet(tmp_path / "lake", num_train=12, num_test=4)
    calls = []
    real_loss = actor_module.policy_loss

    def recording_loss(log_probs, old_log_probs, advantages, mask, config, **kwargs):
        loss, metrics = real_loss(log_probs, old_log_probs, advantages, mask, config, **kwargs)
        inputs = [log_probs] + ([kwargs["entropy"]] if kwargs.get("entropy") is not None else [])
        grad = sum(g.abs() for g in torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
                   if g is not None)  # each token's share of the loss (policy, KL, TIS terms and the entropy bonus)
        calls.append({"mask": mask.detach().cpu(), "grad": grad.detach().cpu(), "old": old_log_probs.detach().cpu(),
                      "engine": kwargs["rollout_log_probs"].detach().cpu()})
        return loss, metrics

    monkeypatch.setattr(actor_module, "policy_loss", recording_loss)
    run_dir = tmp_path / "run"
    config = make_config(
        f"actor_rollout_ref.model.path={WARM_MODEL}", f"data.train_files={data['train']}",
        f"data.val_files={data['test']}", "reward.custom_reward_function=", "data.max_response_length=128",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=24", "trainer.total_training_steps=3",
        "actor_rollout_ref.actor.entropy_coeff=0.01",  # a gradient on every sampled token, whatever the rewards
        "trainer.val_before_train=false", "trainer.test_freq=3", f"trainer.default_local_dir={run_dir}")
    last = run_training(config, warm_engine)
    metrics = read_metrics(run_dir)
    assert sorted(step for step in metrics if step > 0) == [1, 2, 3]
    assert max(metrics[step]["multi_turn/turns_max"] for step in (1, 2, 3)) == 3
    assert all(metrics[step]["multi_turn/observation_tokens_mean"] > 0 for step in (1, 2, 3))
    assert sum(metrics[step]["multi_turn/stop/max_assistant_turns"] for step in (1, 2, 3)) > 0
    assert all(metrics[step]["multi_turn/template_differs"] == 0 for step in (1, 2, 3))  # ids = the template's view
    assert all(metrics[step]["mismatch/log_probs_diff_max"] < 1e-3 for step in (1, 2, 3))
    assert "val/acc" in last and "val/multi_turn/turns_mean" in last
    assert calls, "the policy loss was never called"
    observations_between_turns = 0
    for call in calls:
        mask, grad = call["mask"], call["grad"]
        assert (grad[mask == 0] == 0).all()  # no loss on observation (or padding) tokens
        assert (grad[mask == 1] != 0).any()
        assert (call["engine"][mask == 0] == 0).all()  # the engine's log-prob of an observation token is 0
        sampled = mask == 1
        assert (call["old"][sampled] - call["engine"][sampled]).abs().max() < 1e-3  # aligned across turns
        later_sampled = torch.cummax(mask.flip(1), 1).values.flip(1) > 0  # a sampled token follows
        observations_between_turns += int(((mask == 0) & later_sampled & (torch.cumsum(mask, 1) > 0)).sum())
    assert observations_between_turns > 0, "no episode had an observation between two sampled turns"


def test_verl_tool_agent_rows_with_the_fixtures_tool_and_interaction_yaml(make_config, warm_engine, tmp_path):
    """verl's GSM8K-with-tools rows (tests/fixtures/multi_turn, `agent_name: tool_agent`) run as episodes with the
    fixtures' tool YAML and verl-style interaction, loaded through verl's config keys: the model's answers (no tool
    call) get the interaction's feedback as the next user turn."""
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "multi_turn"
    rows = fixtures / "gsm8k_tool_agent.parquet"
    config = make_config(
        f"actor_rollout_ref.model.path={WARM_MODEL}", f"data.train_files={rows}", f"data.val_files={rows}",
        "data.train_batch_size=2", "data.val_max_samples=2", "data.max_response_length=96",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "reward.custom_reward_function=",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=32",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={fixtures / 'tool_config.yaml'}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={fixtures / 'interaction_config.yaml'}",
        "trainer.total_training_steps=1", "trainer.test_freq=-1", f"trainer.default_local_dir={tmp_path / 'run'}")
    metrics = run_training(config, warm_engine)
    assert metrics["multi_turn/turns_max"] == 2 and metrics["multi_turn/observations_mean"] > 0
    assert metrics["multi_turn/template_differs"] == 0 and metrics["val/multi_turn/turns_mean"] >= 1


def test_an_environment_returning_nan_or_inf_stops_the_run_before_the_update(make_config, warm_engine, tmp_path):
    """Issue 39: an environment whose step rewards and final score are NaN / infinite (tests/envs/scripted.py)
    stops the run at step 1 with one line naming it and the row (`reward.non_finite=error`, the default): nothing
    trained, nothing checkpointed."""
    from megatron_cpo.trainer.run.errors import RunAbortedError

    run_dir = tmp_path / "run"
    config = make_config(
        f"actor_rollout_ref.model.path={WARM_MODEL}", "data.max_response_length=64",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.default_agent=tests.envs.scripted:NonFiniteRewards",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=16", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", f"trainer.default_local_dir={run_dir}")
    with pytest.raises(RunAbortedError) as error:
        run_training(config, warm_engine)
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        "step 1 stopped before its update: environment 'tests.envs.scripted:NonFiniteRewards' (NonFiniteRewards.")
    assert "(data_source 'megatron_cpo/arith')" in message and message.endswith("nothing was trained")
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
