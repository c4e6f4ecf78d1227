"""Non-finite scores are refused where they enter the reward manager: the grading pool's (built-in graders, custom
graders, the custom reward function) and the remote reward model's (a real reference server on loopback). Each is
scored 0 and described: the function or URL, the row's index and data source, the value."""
import math

import pytest
import torch

from megatron_cpo.config_checks import ConfigError
from megatron_cpo.rewards import RemoteRewardConfig, RewardConfig, RewardManager, RewardServer
from megatron_cpo.rewards.non_finite import refusal_message, screen_scores


def test_screening_replaces_every_non_finite_score_by_zero_and_describes_it():
    scores = torch.tensor([1.0, float("nan"), -0.5, float("inf"), float("-inf")])
    clean, refused = screen_scores(scores, lambda index, value: f"#{index}={value}")
    assert clean.tolist() == [1.0, 0.0, -0.5, 0.0, 0.0]
    assert refused == {1: "#1=nan", 3: "#3=inf", 4: "#4=-inf"}
    finite = torch.tensor([0.0, 2.0])
    assert screen_scores(finite, lambda *_: "unused") == (finite, {})
    message = refusal_message(["the grader g gave nan for row 3 (data_source 's')", "second"])
    assert message.startswith("the grader g gave nan for row 3 (data_source 's') (and 1 more non-finite score(s)")
    assert "reward.non_finite=zero" in message and "\n" not in message


def test_the_setting_takes_error_or_zero():
    assert RewardConfig().non_finite == "error" and RewardConfig(non_finite="zero").non_finite == "zero"
    with pytest.raises(ConfigError, match="reward.non_finite='skip' is not supported"):
        RewardConfig(non_finite="skip")


def test_graders_that_return_nan_or_inf_are_named_with_the_row():
    """(The custom reward function's wording: tests/trainer/test_non_finite.py.)"""
    graders = {"tests/nan": "tests.rewards.hostile_graders:nan_score",
               "tests/inf": "tests.rewards.hostile_graders:inf_score",
               "tests/exact": "tests.rewards.hostile_graders:exact_match"}
    with RewardManager(RewardConfig(num_workers=1, custom_graders=graders)) as manager:
        result = manager.score(["tests/exact", "tests/nan", "tests/inf", "math500"], ["a", "x", "x", "\\boxed{2}"],
                               ["a", "x", "x", "2"], rows=[7, 8, 9, 10])
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert result.non_finite == {
        1: "the custom grader tests.rewards.hostile_graders:nan_score gave nan for row 8 (data_source 'tests/nan')",
        2: "the custom grader tests.rewards.hostile_graders:inf_score gave -inf for row 9 (data_source 'tests/inf')"}
    assert result.details[1]["non_finite"] == result.non_finite[1] and "non_finite" not in result.details[0]
    assert result.metrics["reward/non_finite"] == 2 and math.isfinite(result.metrics["reward/score_mean"])


def test_a_reward_model_answering_nan_or_infinity_is_refused_per_row_not_retried():
    """The model's score replaces the rule score here: a NaN rule score it replaces (row 7) is not trained, so not
    refused."""
    calls = []

    def scorer(items):
        calls.append(len(items))
        return [float("nan"), 0.5, float("inf"), 0.25][:len(items)]

    with RewardServer(scorer) as server:
        config = RewardConfig(num_workers=1, custom_graders={"tests/nan": "tests.rewards.hostile_graders:nan_score"},
                              remote=RemoteRewardConfig(enable=True, url=server.url, max_retries=2, backoff_s=0.0))
        with RewardManager(config) as manager:
            result = manager.score(["math500"] * 3 + ["tests/nan"], ["\\boxed{1}"] * 4, ["1"] * 4, rows=[4, 5, 6, 7])
    assert calls == [4]  # an answer with NaN is an answer: no retry
    assert result.scores.tolist() == [0.0, 0.5, 0.0, 0.25]
    assert result.non_finite == {0: f"the reward model at {server.url}/score gave nan for row 4 (data_source "
                                    "'math500')",
                                 2: f"the reward model at {server.url}/score gave inf for row 6 (data_source "
                                    "'math500')"}
    assert result.metrics["reward/remote/score_mean"] == pytest.approx(0.75 / 4)
    assert result.details[1]["rule_score"] == 1
