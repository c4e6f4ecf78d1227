"""Non-finite values stop before the weights: the scorer applies `reward.non_finite` to the scores every source
refused; the actor's optimizer step is skipped on every rank when some rank's loss or the gradient norm is not
finite (fp32 and bf16, real Megatron over gloo at DP=2), and the skips in a row are counted; a checkpoint is never
written from non-finite weights."""
import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from megatron_cpo.config import build_config
from megatron_cpo.data.dataset import PromptRecord
from megatron_cpo.rewards import ARITH_DATA_SOURCE
from megatron_cpo.rewards.non_finite import NonFiniteRewardError
from megatron_cpo.rollout.types import EpisodeInfo, RolloutSample
from megatron_cpo.trainer.driver.grading import ResponseScorer
from megatron_cpo.trainer.run.checkpointing import first_non_finite
from tests.multiprocess import run_processes

TINY_MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"
FUNCTION = "tests.trainer.graders:non_finite_for_some"


def test_the_scorer_stops_a_training_batch_on_a_non_finite_score_or_trains_it_as_zero():
    """"0" grades NaN, "1" +inf, "2" 1.0 (tests/trainer/graders.py); an episode brings its environment's refusals."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    messages = [{"role": "user", "content": "2+2?"}]
    record = PromptRecord(uid="5-0", index=5, messages=messages, prompt_ids=tokenizer.apply_chat_template(
        messages, add_generation_prompt=True), data_source=ARITH_DATA_SOURCE, ground_truth="4")
    answers = [tokenizer.encode(text, add_special_tokens=False) for text in ("0", "1", "2")]
    episode = EpisodeInfo(agent="game", turns=1, observations=0, turn_rewards=[0.0], final_score=0.0,
                          final_answer="2", stop_reason="done", non_finite_rewards=["environment 'game' gave nan"])
    groups = [(record, answers), (record, [RolloutSample(answers[2], [-1.0], "stop", False, [1], episode=episode)])]
    first = f"the custom reward function {FUNCTION} gave nan for row 5 (data_source '{ARITH_DATA_SOURCE}')"

    for policy in ("error", "zero"):
        config = build_config({}, ["reward.num_workers=1", f"reward.custom_reward_function={FUNCTION}",
                                   f"reward.non_finite={policy}"])
        scorer = ResponseScorer(config.reward, tokenizer)
        try:
            if policy == "error":
                with pytest.raises(NonFiniteRewardError) as error:
                    scorer.score_groups(groups)
                assert str(error.value).startswith(f"{first} (and 2 more non-finite score(s) in this batch): ")
                validation = Counter()  # validation never trains: it zeroes and counts whatever the policy
                [(scores, _, _), _] = scorer.score_groups(groups, validation, training=False)
                assert scores.tolist() == [0.0, 0.0, 1.0]
                assert scorer.counted_metrics(validation, "val") == {"val/non_finite": 3.0}
            else:
                [(scores, acc, _), (episode_scores, _, _)] = scorer.score_groups(groups)
                assert scores.tolist() == [0.0, 0.0, 1.0] and acc.tolist() == [0.0, 0.0, 1.0]
                assert episode_scores.tolist() == [0.0]
                assert scorer.counted_metrics() == {"reward/non_finite": 3.0}
                assert scorer.counted_metrics() == {"reward/non_finite": 0.0}  # counted once, then logged
        finally:
            scorer.close()


def test_the_skip_limit_is_at_least_one():
    from megatron_cpo.config_checks import ConfigError

    assert build_config({}, []).actor_rollout_ref.actor.max_consecutive_skipped_updates == 3
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.max_consecutive_skipped_updates=0 must be >= 1"):
        build_config({}, ["actor_rollout_ref.actor.max_consecutive_skipped_updates=0"])


def test_the_first_non_finite_entry_of_a_state_is_named_by_its_path():
    state = {"model": {"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])},
             "optimizer": [{"torch": {"state": {0: {"exp_avg": torch.tensor([float("nan")]), "step": torch.tensor(3)}}},
                            "main_params": []}], "extra": None}
    assert first_non_finite(state, "actor") == "actor/model/b"
    del state["model"]["b"]
    assert first_non_finite(state, "actor") == "actor/optimizer/0/torch/state/0/exp_avg"
    state["optimizer"][0]["torch"]["state"][0]["exp_avg"] = torch.zeros(1, dtype=torch.bfloat16)
    assert first_non_finite(state, "actor") is None


def _batch(scores):
    from megatron_cpo.trainer.batch.step_batch import StepBatch

    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 100, (int(torch.randint(2, 10, (1,), generator=generator)),),
                               generator=generator).tolist() for _ in range(8)]
    return StepBatch([[1, 5, 6, 7, 8]] * 4 + [[1, 9, 10, 11]] * 4, responses, [[-4.0] * len(r) for r in responses],
                     scores, scores > 0, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.zeros(8, dtype=torch.bool), 1.0)


def _guarded_updates(model_dir: str, dtype: str, checkpoint_dir: str) -> dict:
    """Updates at DP=2 of one actor: clean, then one whose loss is NaN on rank 1 only (its advantages), clean, then
    three whose batch has a NaN score (every rank); then a checkpoint, and one refused for a NaN weight on rank 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.run.checkpointing import CheckpointError, CheckpointManager
    from megatron_cpo.trainer.workers.offload import actor_tensors
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy
    from megatron_cpo.trainer.workers.update_guard import FiniteProbe

    config = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3", f"actor_rollout_ref.actor.megatron.params_dtype={dtype}"])
    platform.init_distributed(1, 1, seed=1)
    actor, _ = policies_for(config, pad_token_id=0, total_updates=10)
    settings, rank = policy_update_config(config), dist.get_rank()

    def update(scores, poison_rank=None):
        batch = _batch(torch.tensor(scores))
        probe = FiniteProbe()  # the step's, as Trainer.step passes it through steps 3-5
        log_probs = compute_log_probs(batch, actor, None, settings, pad_token_id=0, probe=probe)
        advantages, _ = compute_advantages(batch, log_probs, settings, probe)
        if rank == poison_rank:  # what the update trains on (the shaping's last step), NaN on every response token
            shaped = advantages.shaped
            poisoned = torch.where(log_probs.mask.bool(), torch.full_like(shaped.advantages, float("nan")),
                                   shaped.advantages)
            advantages = dataclasses.replace(advantages, shaped=dataclasses.replace(
                shaped, steps=(*shaped.steps[:-1], poisoned)))
        metrics = update_policy(actor, batch, log_probs, advantages, settings, probe).metrics
        return metrics["actor/update_skipped"], actor.guard.consecutive, list(actor.guard.first_stages)

    def snapshot():
        tensors = actor_tensors(actor.model, None, actor.optimizer)
        return [t.detach().clone() for t in tensors["params"] + tensors["optimizer"]]

    def unchanged(before):
        return all(torch.equal(a, b) for a, b in zip(before, snapshot()))

    clean = [1.0, 0, 0, 1, 0, 1, 1, 1]
    results = {"first": update(clean)}
    before = snapshot()
    results["rank_1_nan_loss"] = update(clean, poison_rank=1)
    results["rank_1_nan_loss_unchanged"] = unchanged(before)
    results["clean_again"] = update(clean)
    results["clean_again_unchanged"] = unchanged(before)
    before = snapshot()
    results["nan_scores"] = [update([float("nan"), *clean[1:]]) for _ in range(3)]
    results["nan_scores_unchanged"] = unchanged(before)
    results["exhausted"], results["message"] = actor.guard.exhausted, actor.guard.abort_message(7)

    checkpoints = CheckpointManager(Path(checkpoint_dir) / dtype, actor, None)
    results["saved"] = checkpoints.save(1).name
    if rank == 1:
        next(actor.model.parameters()).data.view(-1)[0] = float("nan")
    try:
        checkpoints.save(2)
        results["refused"] = None
    except CheckpointError as err:
        results["refused"] = str(err)
    results["written"] = sorted(path.name for path in (Path(checkpoint_dir) / dtype).iterdir())
    parallel_state.destroy_model_parallel()
    return results


def _both_dtypes(rank: int, world_size: int, model_dir: str, checkpoint_dir: str) -> dict:
    from megatron_cpo import platform

    results = {dtype: _guarded_updates(model_dir, dtype, checkpoint_dir) for dtype in ("float32", "bfloat16")}
    platform.destroy_distributed()
    return results


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank_in_fp32_and_bf16(tiny_model_dir, tmp_path):
    for rank, results in enumerate(run_processes(_both_dtypes, 2, str(tiny_model_dir), str(tmp_path))):
        for dtype, got in results.items():
            assert got["first"] == (0.0, 0, []), (rank, dtype)
            # rank 1's NaN loss: the step is skipped on both ranks (rank 0 learns it in the guard's all-reduce),
            # weights and Adam's state stay bit for bit
            assert got["rank_1_nan_loss"] == (1.0, 1, ["loss", "gradients"]), (rank, dtype)
            assert got["rank_1_nan_loss_unchanged"] and not got["clean_again_unchanged"], (rank, dtype)
            assert got["clean_again"] == (0.0, 0, []), (rank, dtype)
            stages = ["rewards", "advantages", "loss", "gradients"]
            assert got["nan_scores"] == [(1.0, 1, stages), (1.0, 2, stages), (1.0, 3, stages)], (rank, dtype)
            assert got["nan_scores_unchanged"] and got["exhausted"], (rank, dtype)
            assert got["message"].startswith(
                "3 actor updates in a row were skipped for non-finite values, the last at step 7: the first "
                "non-finite value appeared in the rewards (then in the advantages, loss, gradients)"), got["message"]
            assert "actor_rollout_ref.actor.max_consecutive_skipped_updates=3" in got["message"]
            assert got["saved"] == "step_000001" and got["written"] == ["latest", "step_000001"], (rank, dtype)
            assert got["refused"].startswith("not checkpointing step 2: actor/model/") and "on rank 1 is not " \
                "finite" in got["refused"] and got["refused"].endswith(
                f"the last good checkpoint is {tmp_path / dtype / 'step_000001'} (trainer.resume=auto resumes from "
                "the newest good checkpoint)"), got["refused"]
