"""RewardManager: a real grading pool; graders that raise, hang and kill their worker; metrics; token rewards."""
import json

import pytest
import torch

from megatron_cpo.rewards import RewardConfig, RewardManager, token_level_rewards

HOSTILE = {
    "tests/sleeps": "tests.rewards.hostile_graders:sleeps",
    "tests/raises": "tests.rewards.hostile_graders:raises",
    "tests/kills": "tests.rewards.hostile_graders:kills_worker",
    "tests/exact": "tests.rewards.hostile_graders:exact_match",
    "tests/hogs": "tests.rewards.hostile_graders:hogs_memory",
}


@pytest.fixture(scope="module")
def manager():
    config = RewardConfig(num_workers=2, timeout_s=3.0, custom_graders=HOSTILE, worker_memory_limit_mb=1024,
                          grader_kwargs={"openai/gsm8k": {"wrong_score": -0.5},
                                         "apps": {"continuous": False, "limits": {"wall_timeout_s": 2.0}}})
    with RewardManager(config) as reward_manager:
        yield reward_manager


def test_batch_with_failing_graders_is_scored_and_counted(manager):
    sources = ["megatron_cpo/arith", "tests/sleeps", "tests/raises", "tests/kills", "tests/exact", "openai/gsm8k",
               "megatron_cpo/arith", "math500"]
    solutions = ["\\boxed{42}", "x", "x", "x", "yes", "#### 9", "\\boxed{41}", "\\boxed{\\frac{1}{2}}"]
    truths = ["42", "x", "x", "x", "yes", "8", "42", "0.5"]
    result = manager.score(sources, solutions, truths)
    statuses = [detail["status"] for detail in result.details]
    assert statuses == ["ok", "timeout", "error", "crashed", "ok", "ok", "ok", "ok"]
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, -0.5, -1.0, 1.0]
    assert result.acc.tolist() == [True, False, False, False, True, False, False, True]
    assert "RuntimeError: grader bug" in result.details[2]["reason"]
    assert "exceeded 3s" in result.details[1]["reason"] and "died" in result.details[3]["reason"]
    assert result.metrics["reward/timeouts"] == 1 and result.metrics["reward/errors"] == 2
    assert result.metrics["reward/source/megatron_cpo/arith/score_mean"] == 0.0
    assert result.metrics["reward/source/megatron_cpo/arith/score_std"] == 1.0
    assert result.metrics["reward/grader/compute_math_score/count"] == 3
    assert result.metrics["reward/source/tests/kills/errors"] == 1
    assert result.metrics["reward/worker_restarts"] >= 2
    again = manager.score(["tests/exact"] * 4, ["a", "b", "a", "a"], ["a"] * 4)
    assert again.scores.tolist() == [1.0, 0.0, 1.0, 1.0]


def test_code_samples_are_sandboxed_inside_pool_workers(manager):
    tests = json.dumps({"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]})
    solutions = ["```python\nprint(int(input()) * 2)\n```", "```python\nprint(open('/etc/shadow').read())\n```"]
    result = manager.score(["codecontests", "apps"], solutions, [tests, tests])
    assert result.scores.tolist() == [1.0, -1.0]
    assert result.details[1]["test_statuses"] == ["runtime_error"]


def test_memory_hungry_grader_fails_its_sample_only(manager):
    result = manager.score(["tests/hogs", "tests/exact"], ["x", "y"], ["x", "y"])
    assert result.details[0]["status"] == "error" and "MemoryError" in result.details[0]["reason"]
    assert result.scores.tolist() == [0.0, 1.0]


def test_failure_scores_follow_the_grader_convention(manager):
    result = manager.score(["math500"], [None], ["1"])
    assert result.details[0]["status"] == "ok" and result.scores.tolist() == [-1.0]


def test_unknown_source_and_length_mismatch_fail_before_grading(manager):
    with pytest.raises(ValueError, match="known sources"):
        manager.score(["nope"], ["x"], ["y"])
    with pytest.raises(ValueError, match="differ in length"):
        manager.score(["math500", "math500"], ["x"], ["y"])
    assert manager.score([], [], []).scores.shape == (0,)


def test_token_level_rewards_sit_on_the_last_valid_token():
    scores = torch.tensor([1.0, -1.0, 0.5])
    lengths = torch.tensor([3, 1, 5])
    rewards = token_level_rewards(scores, lengths, max_len=5)
    expected = torch.tensor([[0, 0, 1.0, 0, 0], [-1.0, 0, 0, 0, 0], [0, 0, 0, 0, 0.5]])
    assert torch.equal(rewards, expected)
    with pytest.raises(ValueError, match=r"response_lengths\[1\]=0"):
        token_level_rewards(scores, torch.tensor([3, 0, 5]), max_len=5)
    with pytest.raises(ValueError, match="outside"):
        token_level_rewards(scores, torch.tensor([3, 1, 6]), max_len=5)


@pytest.mark.parametrize("overrides, message", [
    ({"num_workers": 0}, "num_workers=0"),
    ({"timeout_s": 0}, "reward.timeout_s=0"),
    ({"custom_graders": {"s": "no_colon"}}, "must be 'pkg.module:function'"),
    ({"grader_kwargs": {"s": 0.5}}, "must be a mapping"),
    ({"worker_memory_limit_mb": 100}, "worker_memory_limit_mb=100"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig(**overrides)


def test_a_missing_grader_fails_before_the_pool_starts():
    with pytest.raises(ValueError, match=r"^reward.custom_graders\['s'\]=.*has no 'nope'"):
        RewardManager(RewardConfig(custom_graders={"s": "tests.rewards.hostile_graders:nope"}))
