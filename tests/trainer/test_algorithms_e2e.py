"""verl's other algorithms train end to end on the session's engine and tiny model: RLOO advantages with GSPO's
sequence-level loss, ReMax, whose greedy baseline answers the same engine generates with the batch, and PPO, whose
Megatron critic (GAE) is checkpointed with the actor and resumed with it."""
import math

import pytest
import torch
from transformers import AutoTokenizer

from megatron_cpo.rollout import SamplingParams
from megatron_cpo.rollout.generators import GREEDY_SUFFIX, GreedyBaselineGenerator, SingleTurnGenerator
from megatron_cpo.trainer.assemble import run_training
from megatron_cpo.trainer.driver.lead import LeadDriver
from tests.rollout.servers import assert_engine_in_sync
from tests.trainer.graders import even_first_character
from tests.trainer.test_e2e import deterministic, read_metrics, send_sigterm_after_first_step

pytestmark = pytest.mark.usefixtures("restore_environment")


@pytest.mark.parametrize("name, overrides", [
    # two mini-batches: the second one's sequence ratios have moved off 1 +- 4e-4, so GSPO's clip acts
    ("rloo_gspo", ["algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                   "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                   "actor_rollout_ref.actor.clip_ratio_low=3e-4", "actor_rollout_ref.actor.clip_ratio_high=4e-4",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2"]),
    ("remax", ["algorithm.adv_estimator=remax"]),
])
def test_two_steps_train_with_the_engine_in_sync(name, overrides, make_config, rollout_manager, tmp_path):
    run_dir = tmp_path / name
    config = make_config("trainer.total_training_steps=2", "trainer.val_before_train=false",
                         "actor_rollout_ref.actor.optim.lr=3e-2", *overrides, f"trainer.default_local_dir={run_dir}")
    run_training(config, rollout_manager)
    metrics = read_metrics(run_dir)
    assert max(metrics) == 2 and (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert_engine_in_sync(metrics, range(1, 3))
    if name == "rloo_gspo":
        assert max(metrics[step]["actor/pg_clipfrac"] for step in (1, 2)) > 0
    else:
        assert all(0 <= metrics[step]["reward/greedy_baseline_mean"] <= 1 for step in (1, 2))


CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/values/mean",
                  "critic/returns/mean", "critic/vf_explained_var", "critic/grad_norm", "critic/lr",
                  "timing/update_critic_s")


def test_ppo_trains_its_critic_checkpoints_it_with_the_actor_and_resumes_both(make_config, rollout_manager,
                                                                              tmp_path):
    """PPO (GAE, lam 0.95, and a critic) for 3 steps straight logs verl's critic metrics, finite, and checkpoints the
    critic beside the actor (its shard and Adam state in the rank file, its Hugging Face export); the same run
    stopped by SIGTERM after step 2 and resumed logs the same metrics at every step, so the actor and the critic both
    came back at the step they were saved (a critic restored from another step, or a fresh one, gives other values,
    returns and value losses at step 3)."""
    straight_dir, preempted_dir = tmp_path / "straight", tmp_path / "preempted"
    overrides = ("algorithm.adv_estimator=gae", "algorithm.lam=0.95", "trainer.total_training_steps=3",
                 "trainer.val_before_train=false", "actor_rollout_ref.actor.optim.lr=3e-2", "critic.optim.lr=1e-2",
                 "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    run_training(make_config(*overrides, f"trainer.default_local_dir={straight_dir}"), rollout_manager)
    straight = read_metrics(straight_dir)
    assert max(straight) == 3
    assert_engine_in_sync(straight, range(1, 4))
    for step in (1, 2, 3):
        for key in CRITIC_METRICS:
            assert math.isfinite(straight[step][key]), (step, key)
        assert straight[step]["critic/lr"] > 0 and straight[step]["critic/update_skipped"] == 0
    assert straight[3]["critic/values/mean"] != straight[1]["critic/values/mean"]  # the critic learns
    checkpoint = straight_dir / "checkpoints" / "step_000003"
    state = torch.load(checkpoint / "rank_00000.pt", weights_only=False)
    assert state["step"] == 3 and state["critic"]["model"] and state["critic"]["optimizer"]
    assert (checkpoint / "critic_huggingface" / "config.json").is_file()

    preempted = make_config(*overrides, f"trainer.default_local_dir={preempted_dir}", "trainer.resume=auto")
    watcher = send_sigterm_after_first_step(preempted_dir)
    run_training(preempted, rollout_manager)
    watcher.join(timeout=5)
    assert max(step for step in read_metrics(preempted_dir) if step > 0) == 2, "SIGTERM should stop it at step 2"
    run_training(preempted, rollout_manager)
    resumed = read_metrics(preempted_dir)
    for step in (1, 2, 3):
        expected, got = deterministic(straight[step]), deterministic(resumed[step])
        assert expected.keys() == got.keys()
        for key in expected:
            assert got[key] == pytest.approx(expected[key], abs=1e-6), (step, key)


def test_the_greedy_baseline_is_the_engines_greedy_answer(rollout_manager):
    """Each group comes back with its prompt's greedy answer, the one a plain greedy request gets."""
    plain = SingleTurnGenerator(rollout_manager)
    generator = GreedyBaselineGenerator(plain)
    prompts = {"a": [1, 5, 6, 7, 8], "b": [1, 9, 10, 11]}
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7)

    class Record:
        def __init__(self, ids):
            self.prompt_ids = ids

    for request_id, ids in prompts.items():
        generator.submit(request_id, Record(ids), sampled)
    groups = {group.request_id: group for group in generator.completed(timeout=120)}
    assert sorted(groups) == ["a", "b"] and all(len(group.samples) == 3 for group in groups.values())
    for request_id, ids in prompts.items():
        plain.submit(request_id + GREEDY_SUFFIX, Record(ids), SamplingParams(n=1, temperature=0.0, max_tokens=8))
    greedy = {group.request_id.removesuffix(GREEDY_SUFFIX): group.samples[0] for group in plain.completed(timeout=120)}
    for request_id, group in groups.items():
        assert group.greedy_baseline.token_ids == greedy[request_id].token_ids


def test_remax_batches_carry_the_graded_greedy_answer_and_train_on_the_samples_only(make_config, rollout_manager,
                                                                                     tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    side = LeadDriver(make_config("algorithm.adv_estimator=remax"), tokenizer, rollout_manager)
    try:
        collected = side.controller.collect(step=1)
        batch = side.build_batch(collected)
        greedy = {}
        for group in collected.groups:  # the same prompts answered greedily by a plain request
            side.sampler.submit(f"check-{group.seq}", group.record, SamplingParams(
                n=1, temperature=0.0, max_tokens=12, stop_token_ids=(tokenizer.eos_token_id,)))
        for group in side.sampler.completed(timeout=120):
            greedy[group.request_id] = tokenizer.decode(group.samples[0].token_ids, skip_special_tokens=True)
    finally:
        side.close()
    assert len(collected.groups) == 4 and all(group.n == 2 for group in collected.groups)
    assert batch.scores.shape == (8,) and batch.reward_baselines.shape == (8,)
    for index, group in enumerate(collected.groups):
        expected = even_first_character(None, greedy[f"check-{group.seq}"], None)["score"]
        assert group.greedy_score == expected
        assert batch.reward_baselines[2 * index: 2 * index + 2].tolist() == [expected, expected]
    assert torch.equal(batch.scores, torch.cat([group.scores for group in collected.groups]))
