"""DAPO filter-groups, RAGEN filters, filter loss scaling, early stopping and overlong handling, hand-computed."""
import math

import pytest
import torch

from megatron_cpo.algorithms.filters import (
    EarlyStopConfig,
    EarlyStopMonitor,
    RagenFilterConfig,
    filter_groups,
    filter_loss_scale,
    in_group_reward_std,
    ragen_filter,
    scale_advantages,
    select_filter_metric,
)
from megatron_cpo.algorithms.overlong import overlong_filter_mask, overlong_reward_penalty


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


def test_select_filter_metric():
    fields = {"acc": torch.tensor([1, 0]), "token_level_scores": torch.tensor([[0.0, 1.0], [0.0, -1.0]])}
    torch.testing.assert_close(select_filter_metric(fields, "token_level_scores"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(select_filter_metric(fields, "acc"), torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"metric='seq_reward'.*\['acc', 'token_level_scores'\]"):
        select_filter_metric(fields, "seq_reward")


# group stds (unbiased): g0 [1,0,1,0] -> sqrt(1/3) = 0.577; g1 constant -> 0; g2 [1,0,0,0] -> 0.5; g3 [2,0,0,0] -> 1
RAGEN_REWARDS = torch.tensor([1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 2, 0, 0, 0.0])
RAGEN_GROUP = torch.arange(4).repeat_interleave(4)


def _kept_groups(config):
    keep = ragen_filter(RAGEN_REWARDS, RAGEN_GROUP, config).keep
    return [g for g in range(4) if bool(keep[4 * g])]


@pytest.mark.parametrize("config,kept", [
    (RagenFilterConfig("top_k", 2), [0, 3]),
    (RagenFilterConfig("top_k", 2, filter_type="smallest"), [1, 2]),
    (RagenFilterConfig("top_k", 2, filter_type="smallest", include_zero=False), [0, 2]),
    (RagenFilterConfig("min_p", 0.5), [0, 2, 3]),
    # softmax of the stds: g3 0.380, g0 0.249, g2 0.231, g1 0.140
    (RagenFilterConfig("top_p", 0.3), [3]),
    (RagenFilterConfig("top_p", 0.5), [0, 3]),
    (RagenFilterConfig("top_p", 0.7), [0, 2, 3]),
    (RagenFilterConfig("top_p", 1.0), [0, 1, 2, 3]),
    (RagenFilterConfig("top_k", 1, group_score="mean"), [1]),  # means 0.5, 1, 0.25, 0.5
])
def test_ragen_strategies_hand_computed(config, kept):
    assert _kept_groups(config) == kept


def test_ragen_metrics_and_empty_candidates():
    result = ragen_filter(RAGEN_REWARDS, RAGEN_GROUP, RagenFilterConfig("top_k", 1))
    assert result.metrics["kept"] == 1 and result.metrics["kept_ratio"] == 0.25
    assert result.metrics["mean_std"] == pytest.approx((math.sqrt(1 / 3) + 0 + 0.5 + 1) / 4)
    nothing = ragen_filter(torch.ones(4), torch.tensor([0, 0, 1, 1]), RagenFilterConfig(include_zero=False))
    assert not nothing.keep.any() and nothing.metrics["filter_rate"] == 1.0


def test_ragen_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="integer rollout_filter_value >= 1"):
        RagenFilterConfig("top_k", 0.5)
    with pytest.raises(ValueError, match="rollout_filter_strategy='top_q'"):
        RagenFilterConfig("top_q", 0.5)
    with pytest.raises(ValueError, match="top_p needs"):
        RagenFilterConfig("top_p", 1.5)


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


def test_overlong_filter_mask():
    mask = torch.tensor([[1, 1], [1, 0]])
    assert overlong_filter_mask(mask, torch.tensor([False, True])).tolist() == [[1, 1], [0, 0]]
    with pytest.raises(ValueError, match="truncated has shape"):
        overlong_filter_mask(mask, torch.tensor([True]))
