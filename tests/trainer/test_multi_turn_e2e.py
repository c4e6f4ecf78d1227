"""Multi-turn training end to end on CPU: FrozenLake (3x3 boards, one move digit per turn) for 3 steps of up to 3
turns, real Megatron, a real vLLM engine (Ray mode, in the session's cluster) serving the quickstart's warm-started
model (a random model never ends a turn, so no episode would reach a second one), real grading pool. The loss is spied
on (the real function is called; the spy only records): every token whose loss mask is 0 (an observation) has zero
gradient, observation tokens sit between sampled ones, the engine's log-prob of an observation token is 0, and the
trainer's log-probs of the sampled tokens equal the engine's (alignment across turns). Then verl's tool agent with
the tool and interaction YAML of tests/fixtures/multi_turn trains a step on the same engine."""
import math
import os
import re
import signal
import threading
from pathlib import Path

import pytest
import torch

import megatron_cpo.trainer.driver.lead as lead_driver
import megatron_cpo.trainer.workers.policy_loss_step as loss_step_module
from megatron_cpo.config import load_config
from megatron_cpo.envs.frozen_lake import write_frozen_lake_parquet
from megatron_cpo.trainer.assemble import run_training
from tests.conditions import wait_until
from tests.envs.scripted import Counted, Misbehaving
from tests.trainer.test_async_resume import epoch_prompts, trained_prompts
from tests.trainer.test_e2e import read_metrics
from tests.trainer.test_run_recovery import EXAMPLE, TrainProcess, latest, logged_steps

pytestmark = pytest.mark.usefixtures("restore_environment")
WARM_MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"  # what the `warm_engine` serves


def test_frozen_lake_trains_three_steps_and_observation_tokens_carry_no_loss(make_config, warm_engine, tmp_path,
                                                                             monkeypatch):
    data = write_frozen_lake_parquet(tmp_path / "lake", num_train=12, num_test=4)
    calls = []
    real_loss = loss_step_module.policy_loss

    def recording_loss(log_probs, old_log_probs, advantages, mask, config, **kwargs):
        loss, metrics = real_loss(log_probs, old_log_probs, advantages, mask, config, **kwargs)
        inputs = [log_probs] + ([kwargs["entropy"]] if kwargs.get("entropy") is not None else [])
        grad = sum(g.abs() for g in torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
                   if g is not None)  # each token's share of the loss (policy, KL, TIS terms and the entropy bonus)
        calls.append({"mask": mask.detach().cpu(), "grad": grad.detach().cpu(), "old": old_log_probs.detach().cpu(),
                      "engine": kwargs["rollout_log_probs"].detach().cpu()})
        return loss, metrics

    monkeypatch.setattr(loss_step_module, "policy_loss", recording_loss)
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


def observation_texts(tokenizer, token_ids: list[int], mask: list[int]) -> list[str]:
    """The text of each run of observation tokens (loss mask 0) of an episode."""
    texts, run = [], []
    for token, sampled in [*zip(token_ids, mask), (None, 1)]:
        if not sampled:
            run.append(token)
        elif run:
            texts.append(tokenizer.decode(run))
            run = []
    return texts


def test_agent_episodes_under_k1_keep_their_environment_and_each_token_its_weight_version(make_config, warm_engine,
                                                                                          tmp_path, monkeypatch):
    """Issue 36: episodes of up to 3 tries (`arith_retry` whose feedback names its environment and step,
    tests/envs/scripted.py) at async_training.max_staleness=1 (partial rollouts) for 4 steps, validated in the middle
    with episodes in flight. Every sampled token of a trained episode is at most 1 version behind the weights that
    train it; some episodes' turns ran under two versions (they spanned a push); each episode was stepped by one
    environment, step 1, 2, ... once each (never restarted, never stepped twice for a turn); every environment made
    is closed once."""
    from transformers import AutoTokenizer

    trained = []
    real_make_batch = lead_driver.make_step_batch

    def recording(groups, kept_ratio, hints=None, policy_version=None, *rest):
        trained.append((list(groups), policy_version))
        return real_make_batch(groups, kept_ratio, hints, policy_version, *rest)

    monkeypatch.setattr(lead_driver, "make_step_batch", recording)
    Counted.reset_counts()
    run_dir = tmp_path / "run"
    agent = "tests.envs.scripted:NumberedRetry"
    config = make_config(
        f"actor_rollout_ref.model.path={WARM_MODEL}", "data.max_prompt_length=256", "data.max_response_length=224",
        "data.val_max_samples=4",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.default_agent={agent}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=24", "async_training.max_staleness=1",
        "trainer.total_training_steps=4", "trainer.test_freq=2", "trainer.val_before_train=false",
        f"trainer.default_local_dir={run_dir}")
    run_training(config, warm_engine)
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [1, 2, 3, 4] and "val/multi_turn/turns_mean" in metrics[2]
    for row in metrics.values():
        assert 0 <= row["async/staleness_mean"] <= row["async/staleness_max"] <= 1
        assert 0 <= row["async/token_staleness_mean"] <= 1 and row["multi_turn/template_differs"] == 0
    tokenizer = AutoTokenizer.from_pretrained(WARM_MODEL)
    spanning = stepped = 0
    for groups, version in trained:
        for group in groups:
            for ids, mask, versions in zip(group.response_token_ids, group.loss_mask.tolist(),
                                           group.policy_versions.tolist()):
                assert all(version - v <= 1 for v, m in zip(versions, mask) if m)
                spanning += len({v for v, m in zip(versions, mask) if m}) > 1
                steps = [tuple(map(int, re.findall(r"Wrong \(env (\d+), step (\d+)\)", text)[0]))
                         for text in observation_texts(tokenizer, ids, mask)]
                assert len({env for env, _ in steps}) <= 1, steps  # one environment stepped the episode
                assert [step for _, step in steps] == list(range(1, len(steps) + 1)), steps  # each step once, in order
                stepped += len(steps) > 1
    assert stepped > 0 and spanning > 0, (stepped, spanning)  # third turns; episodes that spanned a push
    assert max(row["async/pushes_spanned_max"] for row in metrics.values()) >= 1
    wait_until(lambda: Counted.closed_once(), 30, "every environment closed once")


def test_environments_that_raise_block_or_flood_under_k1_stall_nothing_and_are_closed_once(make_config, warm_engine,
                                                                                           tmp_path):
    """Issue 36's bad input under asynchronous training (k = 1, in-flight weight updates): rows whose environment's
    first step raises, returns text instead of a StepResult, answers with a 200,000-character observation, blocks
    past multi_turn.call_timeout_s, or gives a NaN reward (tests/envs/scripted.py: Misbehaving) go on as under k = 0
    (error observations, the episode ended by observation_length or env_timeout, the NaN refused and trained as 0
    with reward.non_finite=zero). The blocked step is still blocked when the 3-step run returns: it held up neither
    the other episodes nor an update. No optimizer step saw a NaN, and every environment made is closed once (the
    blocked one once its step returns)."""
    Counted.reset_counts()
    Misbehaving.release, Misbehaving.blocking = threading.Event(), threading.Lock()
    run_dir = tmp_path / "run"
    config = make_config(
        f"actor_rollout_ref.model.path={WARM_MODEL}", "data.max_response_length=96", "data.shuffle=false",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.default_agent=tests.envs.scripted:Misbehaving",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=24",
        "actor_rollout_ref.rollout.multi_turn.call_timeout_s=2", "reward.non_finite=zero",
        "async_training.max_staleness=1", "async_training.in_flight_weight_updates=true",
        "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
        f"trainer.default_local_dir={run_dir}")
    try:
        run_training(config, warm_engine)
        assert Misbehaving.blocking.locked() and not Misbehaving.release.is_set()  # still blocked
    finally:
        Misbehaving.release.set()
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [1, 2, 3]
    totals = {key: sum(row[f"multi_turn/{key}"] for row in metrics.values())
              for key in ("env_errors", "env_timeouts", "stop/observation_length", "stop/env_timeout",
                          "non_finite_rewards")}
    assert totals["env_errors"] >= 2 and totals["env_timeouts"] >= 1 and totals["stop/env_timeout"] >= 1, totals
    assert totals["stop/observation_length"] >= 1 and totals["non_finite_rewards"] >= 1, totals
    for row in metrics.values():
        assert all(math.isfinite(row[key]) for key in row if key.startswith(("actor/", "advantages/", "reward")))
        assert row["async/staleness_max"] <= 1
    wait_until(lambda: Counted.closed_once(), 60, "every environment closed once")


@pytest.mark.slow
def test_a_run_killed_mid_episode_resumes_and_trains_every_prompt_once(small_run_overrides, warm_engine, tmp_path):
    """Issue 36, resume: a k = 1 multi-turn job (partial_rollout=false: turns in flight at a push finish first) is
    paused after step 2's metrics with its episodes mid-way (every environment step waits: tests/envs/scripted.py
    PausingRetry), then its whole process group is killed with SIGKILL once step 2's checkpoint is written. Resumed
    to step 4 (in-process, on this module's engine), the unfinished episodes are generated again from their start
    with new environments: the trained prompts are the epoch's first 16, in order, each once."""
    run_dir, job_dir = tmp_path / "run", tmp_path / "job"
    run = [*small_run_overrides, f"actor_rollout_ref.model.path={WARM_MODEL}", "data.max_response_length=64",
           "actor_rollout_ref.rollout.multi_turn.enable=true",
           "actor_rollout_ref.rollout.multi_turn.default_agent=tests.envs.scripted:PausingRetry",
           "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
           "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=24",
           "actor_rollout_ref.rollout.multi_turn.call_timeout_s=600", "async_training.max_staleness=1",
           "async_training.partial_rollout=false", "trainer.total_training_steps=4", "trainer.save_freq=2",
           "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.log_completions=8"]
    job = TrainProcess([*run, "actor_rollout_ref.rollout.ray_address=local"], job_dir,
                       {"PAUSE_DIR": str(job_dir), "PAUSE_RUN_DIR": str(run_dir), "PAUSE_AFTER_STEP": "2"})
    try:
        job.wait_for((job_dir / "paused").exists, "an episode's step paused after step 2", timeout=1200)
        job.wait_for(lambda: (run_dir / "checkpoints" / "latest").is_file() and latest(run_dir) == "step_000002",
                     "step 2's checkpoint")
        job.descendants()  # remembered, for kill_all below
        os.killpg(job.proc.pid, signal.SIGKILL)  # the whole process group, mid-episode
    finally:
        job.kill_all()  # and what left the group (Ray's processes start sessions of their own)
    assert max(logged_steps(run_dir)) in (2, 3) and latest(run_dir) == "step_000002"

    run_training(load_config(EXAMPLE, [*run, "trainer.resume=auto"]), warm_engine)
    assert logged_steps(run_dir) == [1, 2, 3, 4]
    steps = trained_prompts(run_dir)
    assert [len(prompts) for prompts in steps] == [4] * 4
    assert [p for prompts in steps for p in prompts] == epoch_prompts(load_config(EXAMPLE, run))[:16]


@pytest.mark.parametrize("staleness", [0, 1])
def test_an_environment_returning_nan_or_inf_stops_the_run_before_the_update(make_config, warm_engine, tmp_path,
                                                                             staleness):
    """Issue 39: an environment whose step rewards and final score are NaN / infinite (tests/envs/scripted.py)
    stops the run at step 1 with one line naming it and the row (`reward.non_finite=error`, the default): nothing
    trained, nothing checkpointed; the same under asynchronous training (issue 36)."""
    from megatron_cpo.trainer.run.errors import RunAbortedError

    run_dir = tmp_path / "run"
    config = make_config(
        f"actor_rollout_ref.model.path={WARM_MODEL}", "data.max_response_length=64",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.default_agent=tests.envs.scripted:NonFiniteRewards",
        "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=16", "trainer.total_training_steps=2",
        f"async_training.max_staleness={staleness}", "trainer.val_before_train=false",
        f"trainer.default_local_dir={run_dir}")
    with pytest.raises(RunAbortedError) as error:
        run_training(config, warm_engine)
    message = str(error.value)
    assert "\n" not in message and message.startswith(
        "step 1 stopped before its update: environment 'tests.envs.scripted:NonFiniteRewards' (NonFiniteRewards.")
    assert "(data_source 'megatron_cpo/arith')" in message and message.endswith("nothing was trained")
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
