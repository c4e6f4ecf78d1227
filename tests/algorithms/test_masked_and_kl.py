"""NaN-safe masked reductions (issue 12 item 3) and the straight-through "+" KL estimators reachable from the config
(item 4), with hand-derived values."""
import math

import pytest
import torch

from megatron_cpo.algorithms.advantages import grpo_advantages
from megatron_cpo.algorithms.config import known_kl_kinds
from megatron_cpo.algorithms.kl import kl_in_reward, kl_penalty
from megatron_cpo.algorithms.losses import PolicyLossConfig, aggregate_loss, policy_loss
from megatron_cpo.algorithms.masked import masked_mean, masked_sum
from megatron_cpo.algorithms.mismatch import TISConfig, rollout_mismatch_metrics, truncated_importance_weights
from megatron_cpo.config import ConfigError, build_config
from megatron_cpo.kernels import hint_mi_signals

NAN, INF = float("nan"), float("inf")


def test_masked_sum_and_mean_ignore_nan_on_padding_issue_repro():
    values, mask = torch.tensor([[1.0, 2.0, NAN]]), torch.tensor([[1, 1, 0]])
    assert float(masked_sum(values, mask)) == 3.0
    assert float(masked_mean(values, mask)) == 1.5
    torch.testing.assert_close(masked_mean(values, mask, -1), torch.tensor([1.5]))
    # an empty row averages to 0, not NaN
    torch.testing.assert_close(masked_mean(torch.tensor([[NAN, INF]]), torch.zeros(1, 2), -1), torch.tensor([0.0]))


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 1.5),                # (1 + 2) / 2 tokens
    ("token-sum", 3.0),
    ("seq-mean-token-sum", 3.0),        # one sequence
    ("seq-mean-token-mean", 1.5),
    ("seq-mean-token-sum-norm", 1.0),   # 3 / (1 seq * T=3)
])
def test_every_aggregation_ignores_nan_on_padding_issue_repro(mode, expected):
    values, mask = torch.tensor([[1.0, 2.0, NAN]]), torch.tensor([[1, 1, 0]])
    assert float(aggregate_loss(values, mask, mode)) == pytest.approx(expected)
    assert float(aggregate_loss(torch.tensor([[1.0, 2.0, INF]]), mask, mode)) == pytest.approx(expected)


def test_policy_loss_and_its_gradient_ignore_nan_on_padding():
    # Padding holds NaN in the advantage, the old and the reference log-probs. ratio 1 on the two real tokens with
    # A = 1 and -1: pg losses -1 and +1, token-mean 0; k1 KL = lp - ref = 0.5 on both tokens.
    log_probs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, NAN]])
    ref = torch.tensor([[-1.5, -1.5, NAN]])
    advantages = torch.tensor([[1.0, -1.0, NAN]])
    mask = torch.tensor([[1, 1, 0]])
    config = PolicyLossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1")
    loss, metrics = policy_loss(log_probs, old, advantages, mask, config, ref_log_probs=ref,
                                rollout_log_probs=torch.tensor([[-1.0, -1.0, NAN]]))
    assert float(loss.detach()) == pytest.approx(0.0 + 0.1 * 0.5)
    assert metrics["kl_loss"] == pytest.approx(0.5) and metrics["mismatch/k3_kl"] == pytest.approx(0.0)
    loss.backward()
    # d/dlp of mean(-A * ratio) = -A / 2 at ratio 1; k1's gradient is 1 / 2 per token, times 0.1; padding gets 0
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.5 + 0.05, 0.5 + 0.05, 0.0]]))


def test_tis_kl_in_reward_and_advantages_ignore_nan_on_padding():
    old, rollout = torch.tensor([[math.log(0.5), NAN]]), torch.tensor([[math.log(0.25), NAN]])
    mask = torch.tensor([[1, 0]])
    weights, metrics = truncated_importance_weights(old, rollout, mask, TISConfig("sequence", 5.0))
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0]]))  # ratio 0.5 / 0.25 on the real token only
    assert metrics["tis/weight_mean"] == pytest.approx(2.0)
    assert rollout_mismatch_metrics(old, rollout, mask)["mismatch/probs_diff_mean"] == pytest.approx(0.25)
    rewards, kl_metrics = kl_in_reward(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.2, NAN]]),
                                       torch.tensor([[0.0, NAN]]), mask, "k1", 0.5)
    torch.testing.assert_close(rewards, torch.tensor([[0.9, 0.0]]))  # 1 - 0.5 * 0.2; padding untouched
    assert kl_metrics["actor/reward_kl_penalty"] == pytest.approx(0.2)
    adv = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([[1, 0], [1, 1]]))
    assert bool(torch.isfinite(adv).all()) and float(adv[0, 1]) == 0.0


def test_cpo_signals_ignore_nan_on_padding():
    # ubar = mean H = 1.5, s = mean kl = ln 2
    lp = torch.tensor([[math.log(0.5), math.log(0.25), NAN]])
    lp_h = torch.tensor([[0.0, math.log(0.5), NAN]])
    entropy, mask = torch.tensor([[1.0, 2.0, INF]]), torch.tensor([[1, 1, 0]])
    out = hint_mi_signals(lp, lp_h, entropy, mask)
    torch.testing.assert_close(out.ubar, torch.tensor([1.5]))
    torch.testing.assert_close(out.s, torch.tensor([math.log(2.0)]))
    torch.testing.assert_close(out.u[:, :2], torch.tensor([[0.0, 1.0]]))


# lp = -0.3, ref = -0.5: k1 = 0.2, abs = 0.2, k2 = 0.02, k3 = exp(-0.2) + 0.2 - 1; k2's gradient is lp - ref = 0.2.
HAND = {"k1": 0.2, "kl": 0.2, "abs": 0.2, "k2": 0.02, "mse": 0.02, "k3": math.exp(-0.2) - 0.8,
        "low_var_kl": math.exp(-0.2) - 0.8}


@pytest.mark.parametrize("base", sorted(HAND))
def test_straight_through_kinds_value_and_gradient(base):
    lp = torch.tensor([-0.3], dtype=torch.float64, requires_grad=True)
    value = kl_penalty(lp, torch.tensor([-0.5], dtype=torch.float64), base + "+")
    assert float(value.detach()) == pytest.approx(HAND[base], rel=1e-12)
    value.backward()
    assert float(lp.grad) == pytest.approx(0.2, rel=1e-12)


@pytest.mark.parametrize("kind", known_kl_kinds())
def test_every_kl_kind_is_accepted_by_the_config(kind):
    config = build_config({"actor_rollout_ref": {"actor": {"kl_loss_type": kind, "use_kl_loss": True}}})
    assert config.actor_rollout_ref.actor.kl_loss_type == kind
    assert PolicyLossConfig(use_kl_loss=True, kl_loss_type=kind).kl_loss_type == kind


def test_plus_kinds_are_listed_and_unknown_kinds_rejected():
    assert {"k1+", "k3+", "low_var_kl+", "abs+", "kl+", "k2+", "mse+"} <= set(known_kl_kinds())
    with pytest.raises(ConfigError, match="kl_loss_type='k4\\+'.*'k3\\+'"):
        build_config({"actor_rollout_ref": {"actor": {"kl_loss_type": "k4+"}}})


def test_k3_plus_in_the_policy_loss_has_the_k2_gradient():
    # two tokens, A = 0 so only the KL term acts; token-mean over 2 tokens: d/dlp = coef * (lp - ref) / 2
    lp = torch.tensor([[-0.3, -1.0]], requires_grad=True)
    ref = torch.tensor([[-0.5, -0.4]])
    config = PolicyLossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k3+")
    loss, metrics = policy_loss(lp, lp.detach(), torch.zeros(1, 2), torch.ones(1, 2), config, ref_log_probs=ref)
    k3 = [math.exp(-0.2) - 0.8, math.exp(0.6) - 0.6 - 1.0]
    assert metrics["kl_loss"] == pytest.approx(sum(k3) / 2, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.1, -0.3]]))


def test_k3_is_never_negative_and_accurate_near_equal_log_probs():
    """k3 = exp(x) - x - 1 >= 0; written that way in float32 it came out negative on ~1% of tokens whose log-ratio x
    is within 5e-6 of 0 (mean -5.5e-10 against the true 4.2e-12), e.g. a policy scored against itself by two
    differently batched passes. Computed as expm1(x) - x (clamped at 0) it is >= 0 and within 1% of x^2 / 2."""
    generator = torch.Generator().manual_seed(0)
    log_probs = -3 * torch.rand(100_000, generator=generator)
    ref_log_probs = log_probs + (torch.rand(100_000, generator=generator) - 0.5) * 1e-5
    mask = torch.ones_like(log_probs)
    for kind in ("k3", "low_var_kl"):
        k3 = kl_penalty(log_probs, ref_log_probs, kind)
        assert bool((k3 >= 0).all()), kind
        exact = (ref_log_probs.double() - log_probs.double()).square() / 2  # k3 to second order, |x| <= 5e-6
        assert float(k3.double().mean()) == pytest.approx(float(exact.mean()), rel=1e-2)
    mismatch = rollout_mismatch_metrics(log_probs, ref_log_probs, mask)
    assert mismatch["mismatch/k3_kl"] >= 0
