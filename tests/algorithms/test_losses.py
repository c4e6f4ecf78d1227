"""Policy loss, aggregation, KL estimators, entropy mask, mismatch metrics and TIS on hand-computed cases."""
import math

import pytest
import torch

from megatron_cpo.algorithms.kl import kl_in_reward
from megatron_cpo.algorithms.loss_config import PolicyLossConfig, TISConfig
from megatron_cpo.algorithms.losses import (
    aggregate_loss,
    entropy_mask,
    kl_penalty,
    policy_loss,
    rollout_mismatch_metrics,
    truncated_importance_weights,
)
from megatron_cpo.algorithms.policy_losses import clipped_policy_loss

LN2 = math.log(2.0)


def _policy_batch():
    # response 0: ratios 1.5, 0.5, 1.1, 5.0 with A = 1, -1, -1, -1; response 1: ratio 1 on 2 tokens, 2 padding tokens
    # whose huge ratio must not count.
    ratios = torch.tensor([[1.5, 0.5, 1.1, 5.0], [1.0, 1.0, 50.0, 50.0]])
    old = torch.full((2, 4), -1.0)
    advantages = torch.tensor([[1.0, -1.0, -1.0, -1.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    return old + torch.log(ratios), old, advantages, mask


def test_clipped_policy_loss_hand_computed():
    log_probs, old, advantages, mask = _policy_batch()
    losses, m = clipped_policy_loss(log_probs, old, advantages, mask, 0.2, 0.28, 3.0)
    # t0: clip-higher caps 1.5 at 1.28; t1: 0.5 raised to 0.8; t2: inside; t3: 5.0 bounded by dual-clip at 3
    torch.testing.assert_close(losses[0], torch.tensor([-1.28, 0.8, 1.1, 3.0]))
    torch.testing.assert_close(losses[1, :2], torch.tensor([-1.0, -1.0]))
    assert m["pg_clipfrac"] == pytest.approx(2 / 6)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 6)
    assert m["ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(1.1) + math.log(5.0)) / 6)
    assert m["clip_ratio/low_mean"] == pytest.approx(0.125) and m["clip_ratio/low_min"] == 0.0
    assert m["clip_ratio/high_mean"] == pytest.approx(0.125) and m["clip_ratio/high_max"] == pytest.approx(0.25)
    assert m["clip_ratio/region_mean"] == pytest.approx(0.25)
    loss, metrics = policy_loss(log_probs, old, advantages, mask, PolicyLossConfig(clip_ratio_high=0.28))
    assert float(loss) == pytest.approx((-1.28 + 0.8 + 1.1 + 3.0 - 2.0) / 6)
    assert metrics["pg_loss"] == pytest.approx(float(loss))


def test_policy_loss_gradient_is_zero_where_clipped():
    log_probs, old, advantages, mask = _policy_batch()
    log_probs = log_probs.clone().requires_grad_(True)
    loss, _ = policy_loss(log_probs, old, advantages, mask, PolicyLossConfig(clip_ratio_high=0.28))
    loss.backward()
    grad = log_probs.grad
    assert grad[0, 0] == 0 and grad[0, 1] == 0 and grad[0, 3] == 0  # clipped / dual-clipped tokens
    assert grad[0, 2] == pytest.approx(1.1 / 6)  # d/dlp of (-A * ratio) / 6 with A = -1
    assert torch.all(grad[1, 2:] == 0)


AGG_VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
AGG_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("mode,local,with_global", [
    ("token-mean", 2.5, 10 / 8),
    ("token-sum", 10.0, 10.0),
    ("seq-mean-token-sum", 5.0, 10 / 4),
    ("seq-mean-token-mean", 3.0, 6 / 4),
    ("seq-mean-token-sum-norm", 10 / 6, 10 / 12),
])
def test_aggregation_hand_computed(mode, local, with_global):
    assert float(aggregate_loss(AGG_VALUES, AGG_MASK, mode)) == pytest.approx(local)
    assert float(aggregate_loss(AGG_VALUES, AGG_MASK, mode, global_tokens=8, global_seqs=4)) == pytest.approx(
        with_global)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_aggregation_shares_sum_to_the_whole_batch(mode):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(8, 6, generator=gen)
    mask = (torch.rand(8, 6, generator=gen) > 0.3).long()
    mask[3] = 0  # an empty response counts as no sequence
    whole = aggregate_loss(values, mask, mode)
    tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    shares = [aggregate_loss(values[i:i + 3], mask[i:i + 3], mode, global_tokens=tokens, global_seqs=seqs,
                             norm_length=6) for i in (0, 3, 6)]
    torch.testing.assert_close(sum(shares), whole)


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    expected = {"k1": LN2, "kl": LN2, "abs": LN2, "k2": 0.5 * LN2 ** 2, "mse": 0.5 * LN2 ** 2,
                "k3": 0.5 + LN2 - 1.0, "low_var_kl": 0.5 + LN2 - 1.0}
    for kind, value in expected.items():
        assert float(kl_penalty(lp, ref, kind)) == pytest.approx(value, rel=1e-5), kind
    assert float(kl_penalty(lp, -lp, "abs")) == pytest.approx(2 * LN2)
    # k3 clamps: log-ratio -50 -> -20, exp(-20) + 20 - 1 ~ 19 -> 10
    assert float(kl_penalty(torch.tensor([0.0]), torch.tensor([-50.0]), "k3")) == 10.0
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*low_var_kl"):
        kl_penalty(lp, ref, "k4")


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl+", "abs+"])
def test_straight_through_kl_has_the_k2_gradient(kind):
    lp = torch.tensor([-0.3, -1.2, -2.0], requires_grad=True)
    ref = torch.tensor([-0.5, -1.0, -2.5])
    value = kl_penalty(lp, ref, kind)
    torch.testing.assert_close(value.detach(), kl_penalty(lp.detach(), ref, kind[:-1]))
    value.sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref).detach())


def test_kl_in_reward():
    scores = torch.tensor([[0.0, 0.0, 1.0]])
    lp = torch.tensor([[0.1, 0.2, 0.3]])
    rewards, metrics = kl_in_reward(scores, lp, torch.zeros(1, 3), torch.ones(1, 3), "k1", 0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.2)


def test_entropy_mask_keeps_the_top_quantile():
    entropy = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    keep, threshold = entropy_mask(entropy, mask, 0.4)
    # quantile 0.6 of [0.1 .. 0.5]: position 2.4 -> 0.3 + 0.4 * 0.1 = 0.34
    assert threshold == pytest.approx(0.34)
    assert threshold == pytest.approx(float(torch.quantile(torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]), 0.6)))
    assert keep.tolist() == [[False, False, False, True], [True, False, False, False]]
    keep_all, _ = entropy_mask(entropy, mask, 1.0)
    assert torch.equal(keep_all, mask.bool())
    with pytest.raises(ValueError, match="top_entropy_quantile=0"):
        entropy_mask(entropy, mask, 0.0)


def test_mismatch_metrics_hand_computed():
    trainer = torch.log(torch.tensor([[0.5, 0.5, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    m = rollout_mismatch_metrics(trainer, rollout, torch.tensor([[1, 1, 0]]))
    assert m["mismatch/probs_diff_mean"] == pytest.approx(0.125)
    assert m["mismatch/probs_diff_max"] == pytest.approx(0.25)
    assert m["mismatch/log_probs_diff_mean"] == pytest.approx(LN2 / 2)
    assert m["mismatch/log_probs_diff_max"] == pytest.approx(LN2)
    assert m["mismatch/k3_kl"] == pytest.approx((2.0 - LN2 - 1.0) / 2)


def test_tis_token_and_sequence_levels():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.1, 0.5, 0.01]]))
    mask = torch.tensor([[1, 1, 0]])
    weights, metrics = truncated_importance_weights(old, rollout, mask, TISConfig("token", 2.0))
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 1.0]]))
    assert metrics["tis/truncated_frac"] == pytest.approx(0.5)
    weights, _ = truncated_importance_weights(old, rollout, mask, TISConfig("token", 10.0))
    torch.testing.assert_close(weights, torch.tensor([[5.0, 1.0, 1.0]]))
    weights, _ = truncated_importance_weights(old, rollout, mask, TISConfig("sequence", 10.0))
    torch.testing.assert_close(weights, torch.tensor([[5.0, 5.0, 1.0]]))
    weights, _ = truncated_importance_weights(old, rollout, mask, TISConfig("sequence", 2.0))
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 1.0]]))
    with pytest.raises(ValueError, match="tis.level='seq'"):
        TISConfig("seq")


def test_total_loss_with_tis_entropy_and_kl():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    config = PolicyLossConfig(entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k1",
                              tis_imp_ratio_cap=2.0)
    loss, m = policy_loss(old, old, torch.ones(1, 2), torch.ones(1, 2), config,
                          entropy=torch.tensor([[1.0, 3.0]]), ref_log_probs=old - 0.5,
                          rollout_log_probs=torch.log(torch.tensor([[0.1, 0.5]])))
    # pg: ratio 1, A 1 -> -1 per token, TIS weights 2 and 1 -> -1.5; entropy mean 2; k1 = 0.5
    assert m["pg_loss"] == pytest.approx(-1.5) and m["entropy"] == pytest.approx(2.0)
    assert m["kl_loss"] == pytest.approx(0.5)
    assert float(loss) == pytest.approx(-1.5 - 0.1 * 2.0 + 0.2 * 0.5)


def test_entropy_mask_in_the_policy_loss():
    old = torch.zeros(1, 4)
    advantages = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    config = PolicyLossConfig(top_entropy_quantile=0.5)
    loss, m = policy_loss(old, old, advantages, torch.ones(1, 4), config, entropy=torch.tensor([[0.1, 0.9, 0.2, 0.8]]))
    assert float(loss) == pytest.approx(-(2.0 + 4.0) / 2)  # only the two high-entropy tokens
    assert m["entropy/threshold"] == pytest.approx(0.5)


def test_missing_inputs_and_bad_config_are_named():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="entropy_coeff"):
        policy_loss(x, x, x, torch.ones(1, 2), PolicyLossConfig(entropy_coeff=0.01))
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss(x, x, x, torch.ones(1, 2), PolicyLossConfig(use_kl_loss=True))
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss(x, x, x, torch.ones(1, 2), PolicyLossConfig(tis_imp_ratio_cap=2.0))
    with pytest.raises(ValueError, match="clip_ratio_c=1.0"):
        PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode='mean' is not supported"):
        PolicyLossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="global_tokens=0"):
        aggregate_loss(x, torch.ones(1, 2), "token-mean", global_tokens=0)
