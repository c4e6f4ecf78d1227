"""DAPO filter-groups, RAGEN filters, filter loss scaling, early stopping and overlong handling, hand-computed."""
import math

import pytest
import torch

from megatron_cpo.algorithms.early_stop import EarlyStopConfig, EarlyStopMonitor
from megatron_cpo.algorithms.filters import (
    RolloutFilterConfig,
    filter_groups,
    filter_loss_scale,
    in_group_reward_std,
    ragen_filter,
    scale_advantages,
)
from megatron_cpo.algorithms.overlong import overlong_reward_penalty


def test_filter_groups_hand_computed():
    acc = torch.tensor([1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3])
    result = filter_groups(acc, group)
    assert result.keep.tolist() == [False] * 4 + [True] * 4 + [False] * 3 + [True]  # varied group and singleton
    assert result.metrics["kept"] == 2 and result.metrics["filtered"] == 2
    assert result.metrics["filter_rate"] == 0.5
    assert result.metrics["mean_std"] == pytest.approx((0 + 0.5 + 0 + 0) / 4)  # population std (np.std)


def test_filter_groups_is_exact_on_constant_groups():
    # 0.1 three times has a float mean that differs from 0.1; the group is still constant
    result = filter_groups(torch.tensor([0.1, 0.1, 0.1, 0.3, 0.7]), torch.tensor([0, 0, 0, 1, 1]))
    assert result.keep.tolist() == [False, False, False, True, True]


# group stds (unbiased): g0 [1,0,1,0] -> sqrt(1/3) = 0.577; g1 constant -> 0; g2 [1,0,0,0] -> 0.5; g3 [2,0,0,0] -> 1
RAGEN_REWARDS = torch.tensor([1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 2, 0, 0, 0.0])
RAGEN_GROUP = torch.arange(4).repeat_interleave(4)


def _kept_groups(config):
    keep = ragen_filter(RAGEN_REWARDS, RAGEN_GROUP, config).keep
    return [g for g in range(4) if bool(keep[4 * g])]


@pytest.mark.parametrize("config,kept", [
    (RolloutFilterConfig("top_k", 2), [0, 3]),
    (RolloutFilterConfig("top_k", 2, rollout_filter_type="smallest"), [1, 2]),
    (RolloutFilterConfig("top_k", 2, rollout_filter_type="smallest", rollout_filter_include_zero=False), [0, 2]),
    # top_k as a fraction of the 4 groups: int(0.5 * 4) = 2; int(0.3 * 4) = 1; int(0.1 * 4) = 0 -> at least 1
    (RolloutFilterConfig("top_k", 0.5), [0, 3]),
    (RolloutFilterConfig("top_k", 0.3), [3]),
    (RolloutFilterConfig("top_k", 0.1), [3]),
    (RolloutFilterConfig("min_p", 0.5), [0, 2, 3]),
    # softmax of the stds: g3 0.380, g0 0.249, g2 0.231, g1 0.140
    (RolloutFilterConfig("top_p", 0.3, rollout_filter_top_p_prob_mode="softmax"), [3]),
    (RolloutFilterConfig("top_p", 0.5, rollout_filter_top_p_prob_mode="softmax"), [0, 3]),
    (RolloutFilterConfig("top_p", 0.7, rollout_filter_top_p_prob_mode="softmax"), [0, 2, 3]),
    (RolloutFilterConfig("top_p", 1.0, rollout_filter_top_p_prob_mode="softmax"), [0, 1, 2, 3]),
    # linear (RAGEN's default): stds sum to 2.0774; keep best-first until value * 2.0774 - 0.01 is reached.
    # 0.3 -> 0.613: g3 (1.0) reaches it; 0.5 -> 1.029: g3 + g0 = 1.577; 0.9 -> 1.860: g3 + g0 + g2 = 2.077
    (RolloutFilterConfig("top_p", 0.3), [3]),
    (RolloutFilterConfig("top_p", 0.5), [0, 3]),
    (RolloutFilterConfig("top_p", 0.9), [0, 2, 3]),
    (RolloutFilterConfig("top_p", 1.0), [0, 1, 2, 3]),
    # smallest, ascending: g1's 0 stops the walk at once, the sum is never reached: nothing (as RAGEN); without
    # zero groups: g2 0.5 + g0 0.577 = 1.077 >= 0.5 * 2.0774 - 0.01
    (RolloutFilterConfig("top_p", 0.5, rollout_filter_type="smallest"), []),
    (RolloutFilterConfig("top_p", 0.5, rollout_filter_type="smallest", rollout_filter_include_zero=False), [0, 2]),
    (RolloutFilterConfig("top_k", 1, rollout_filter_metric="reward_mean"), [1]),  # means 0.5, 1, 0.25, 0.5
    (RolloutFilterConfig("top_k", 1, rollout_filter_metric="reward_sum"), [1]),  # sums 2, 4, 1, 2
    # ties: group order
    (RolloutFilterConfig("top_k", 2, rollout_filter_metric="reward_sum", rollout_filter_type="smallest"), [0, 2]),
])
def test_ragen_strategies_hand_computed(config, kept):
    assert _kept_groups(config) == kept


def test_ragen_length_score():
    lengths = torch.tensor([10, 20, 30, 40, 5, 5, 5, 5, 100, 0, 0, 0, 1, 1, 1, 1.0])  # group means 25, 5, 25, 1
    keep = ragen_filter(RAGEN_REWARDS, RAGEN_GROUP, RolloutFilterConfig("top_k", 2, rollout_filter_metric="length"),
                        lengths=lengths).keep
    assert [g for g in range(4) if bool(keep[4 * g])] == [0, 2]
    with pytest.raises(ValueError, match="needs the response lengths"):
        ragen_filter(RAGEN_REWARDS, RAGEN_GROUP, RolloutFilterConfig("top_k", 2, rollout_filter_metric="length"))


@pytest.mark.parametrize("mode", ["linear", "softmax"])
def test_top_p_one_keeps_every_group_issue_repro(mode):
    # a very peaked softmax (20 vs 0): the tail's mass rounds away in float32, yet value 1.0 keeps all
    rewards, group = torch.tensor([20.0, 20.0, 0.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    config = RolloutFilterConfig("top_p", 1.0, rollout_filter_metric="reward_mean", rollout_filter_top_p_prob_mode=mode)
    assert ragen_filter(rewards, group, config).keep.all()


def test_min_p_smallest_keeps_scores_up_to_min_over_value_issue_repro():
    # group means 0.2, 0.3, 0.5; min / value = 0.4: groups 0 and 1
    rewards, group = torch.tensor([0.2, 0.2, 0.3, 0.3, 0.5, 0.5]), torch.tensor([0, 0, 1, 1, 2, 2])
    config = RolloutFilterConfig("min_p", 0.5, "smallest", rollout_filter_metric="reward_mean")
    keep = ragen_filter(rewards, group, config).keep
    assert keep.tolist() == [True, True, True, True, False, False]


@pytest.mark.parametrize("filter_type,kept", [("largest", [1]), ("smallest", [0])])
def test_min_p_with_only_negative_scores_keeps_the_best(filter_type, kept):
    # means -1, -0.5, -2. largest: value * best = -0.25 lies above every score; smallest: best / value = -4 lies
    # below every score; RAGEN would keep nothing, we keep the best group (docs/filters.md).
    rewards, group = torch.tensor([-1.0, -1.0, -0.5, -0.5, -2.0, -2.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    config = RolloutFilterConfig("min_p", 0.5, filter_type, rollout_filter_metric="reward_mean")
    keep = ragen_filter(rewards, group, config).keep
    expected = [1] if filter_type == "largest" else [2]
    assert [g for g in range(3) if bool(keep[2 * g])] == expected and kept


def test_constant_group_std_is_exactly_zero_issue_repro():
    # float32 [0.9, 0.9, 0.9] has a rounding std of 7e-8; it must count as 0: dropped with
    # rollout_filter_include_zero=false, and tied with the other constant group under top_k (ties go to the earlier
    # group), never ahead of it.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.9, 0.9])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    top_k_without_zero = RolloutFilterConfig("top_k", 1, rollout_filter_include_zero=False)
    top_p_without_zero = RolloutFilterConfig("top_p", 1.0, rollout_filter_include_zero=False)
    assert not ragen_filter(rewards, group, top_k_without_zero).keep.any()
    assert not ragen_filter(rewards, group, top_p_without_zero).keep.any()
    keep = ragen_filter(rewards, group, RolloutFilterConfig("top_k", 1)).keep
    assert keep.tolist() == [True, True, True, False, False, False]
    varied = torch.tensor([0.9, 0.9, 0.9, 0.0, 1.0, 0.0])
    keep = ragen_filter(varied, group, top_p_without_zero).keep
    assert keep.tolist() == [False, False, False, True, True, True]


def test_ragen_metrics_and_empty_candidates():
    result = ragen_filter(RAGEN_REWARDS, RAGEN_GROUP, RolloutFilterConfig("top_k", 1))
    assert result.metrics["kept"] == 1 and result.metrics["kept_ratio"] == 0.25
    assert result.metrics["mean_std"] == pytest.approx((math.sqrt(1 / 3) + 0 + 0.5 + 1) / 4)
    without_zero = RolloutFilterConfig("top_p", 0.9, rollout_filter_include_zero=False)
    nothing = ragen_filter(torch.ones(4), torch.tensor([0, 0, 1, 1]), without_zero)
    assert not nothing.keep.any() and nothing.metrics["filter_rate"] == 1.0


def test_ragen_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="rollout_filter_value=2.5 must be a whole number >= 1 for top_k"):
        RolloutFilterConfig("top_k", 2.5)
    with pytest.raises(ValueError, match="rollout_filter_strategy='top_q'"):
        RolloutFilterConfig("top_q", 0.5)
    with pytest.raises(ValueError, match="rollout_filter_value=1.5 must be in \\(0, 1\\] for top_p"):
        RolloutFilterConfig("top_p", 1.5)
    with pytest.raises(ValueError, match="rollout_filter_top_p_prob_mode='nucleus'"):
        RolloutFilterConfig("top_p", 0.5, rollout_filter_top_p_prob_mode="nucleus")


def test_filter_loss_scaling():
    assert filter_loss_scale(0.25, "none") == 1.0
    assert filter_loss_scale(0.25, "linear") == 0.25
    assert filter_loss_scale(0.25, "sqrt") == 0.5
    torch.testing.assert_close(scale_advantages(torch.tensor([[2.0, -4.0]]), 0.25, "sqrt"), torch.tensor([[1.0, -2.0]]))
    with pytest.raises(ValueError, match="filter_loss_scaling='square'"):
        filter_loss_scale(0.5, "square")


def test_in_group_reward_std():
    assert in_group_reward_std(RAGEN_REWARDS, RAGEN_GROUP) == pytest.approx((math.sqrt(1 / 3) + 0.5 + 1) / 4)


def test_early_stop_monitor():
    monitor = EarlyStopMonitor(EarlyStopConfig(baseline_steps=3, window=2, ratio=0.1))
    assert not monitor.observe(1.0, successful=True)
    assert not monitor.observe(0.8, successful=True)
    assert not monitor.observe(0.05, successful=False)  # a retry: in the window, not in the baseline
    assert monitor.baseline is None
    assert not monitor.observe(0.6, successful=True)  # baseline (1 + 0.8 + 0.6) / 3 = 0.8; window 0.05, 0.6
    assert monitor.baseline == pytest.approx(0.8)
    saved = monitor.state_dict()
    assert not monitor.observe(0.07, successful=False)  # window 0.6, 0.07
    assert monitor.observe(0.05, successful=True)  # window 0.07, 0.05: both below 0.08
    restored = EarlyStopMonitor(EarlyStopConfig(baseline_steps=3, window=2, ratio=0.1))
    restored.load_state_dict(saved)
    assert restored.baseline == pytest.approx(0.8)
    assert not restored.observe(0.07, successful=False) and restored.observe(0.05, successful=True)
    with pytest.raises(ValueError, match="window=0"):
        EarlyStopConfig(window=0)


def test_overlong_reward_penalty():
    penalty = overlong_reward_penalty(torch.tensor([10, 15, 16, 20]), max_response_length=20, buffer_len=5,
                                      penalty_factor=1.0)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.2, -1.0]))
    with pytest.raises(ValueError, match="overlong_buffer.len=0"):
        overlong_reward_penalty(torch.tensor([1]), 20, 0, 1.0)
