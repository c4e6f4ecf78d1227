"""Off-policy correction (algorithms/rollout_correction.py): hand-computed cases, verl's formulas on random inputs,
the config's `auto` rule, and the loss it feeds (algorithms/losses.py)."""
import math

import pytest
import torch

from megatron_cpo.algorithms.losses import PolicyLossConfig, policy_loss
from megatron_cpo.algorithms.mismatch import mismatch_by_staleness, rollout_mismatch_metrics
from megatron_cpo.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    effective_sample_size,
    rollout_correction,
)

LN2 = math.log(2.0)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def log_ratios(*rows):
    """Old log-probs whose ratios against zero rollout log-probs are the given values (padding NaN)."""
    width = MASK.shape[1]
    old = torch.full((len(rows), width), float("nan"))
    for i, row in enumerate(rows):
        old[i, : len(row)] = torch.log(torch.tensor(row, dtype=torch.float32))
    return old, torch.zeros(len(rows), width)


def test_token_is_truncates_each_ratio_and_reports_mean_max_ess():
    old, rollout = log_ratios([0.5, 4.0, 1.0], [2.0, 1.0])
    out = rollout_correction(old, rollout, MASK, RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    assert torch.allclose(out.weights, torch.tensor([[0.5, 2.0, 1.0, 1.0], [2.0, 1.0, 1.0, 1.0]]))
    assert out.keep.tolist() == MASK.bool().tolist()
    m = out.metrics
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((0.5 + 4 + 1 + 2 + 1) / 5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(4.0)
    clamped = torch.tensor([0.5, 2.0, 1.0, 2.0, 1.0])  # [1/C, C]
    normalized = clamped / clamped.mean()
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(float(1 / normalized.square().mean()),
                                                                         rel=1e-5)
    assert m["rollout_corr/masked_fraction"] == 0.0

@pytest.mark.parametrize("seed", range(20))
def test_ess_never_exceeds_one(seed):
    """Equal weights gave 1.0000001 in float32 (test_async_e2e failed on an AVX2 CPU): the ESS is at most 1 exactly,
    for equal weights of any value and for random ones, and 1 for equal weights."""
    gen = torch.Generator().manual_seed(seed)
    value = float(torch.empty(()).uniform_(0.3, 3.0, generator=gen))
    mask = (torch.rand(64, 97, generator=gen) < 0.9).int()
    equal = torch.full((64, 97), value)
    assert effective_sample_size(equal, mask, threshold=2.0) == pytest.approx(1.0, abs=1e-12)
    assert effective_sample_size(equal, mask, threshold=2.0) <= 1.0
    random = torch.exp(torch.randn(64, 97, generator=gen) * 1e-4)  # near 1: where rounding could push it over
    assert 0 < effective_sample_size(random, mask, threshold=2.0) <= 1.0


def test_sequence_is_weights_every_token_by_the_truncated_product():
    old, rollout = log_ratios([0.5, 3.0, 1.0], [1.5, 1.0])
    out = rollout_correction(old, rollout, MASK, RolloutCorrectionConfig(rollout_is="sequence",
                                                                         rollout_is_threshold=2.0))
    assert torch.allclose(out.weights, torch.tensor([[1.5, 1.5, 1.5, 1.0], [1.5, 1.5, 1.0, 1.0]]))
    out = rollout_correction(old, rollout, MASK, RolloutCorrectionConfig(rollout_is="sequence",
                                                                         rollout_is_threshold=1.2))
    assert torch.allclose(out.weights, torch.tensor([[1.2, 1.2, 1.2, 1.0], [1.2, 1.2, 1.0, 1.0]]))


@pytest.mark.parametrize("level, kept, seq_frac", [
    ("token", [[False, False, True, False], [True, True, False, False]], 0.5),
    ("sequence", [[True, True, True, False], [True, True, False, False]], 0.0),   # products 1.2 and 1.5
    ("geometric", [[True, True, True, False], [True, True, False, False]], 0.0),
])
def test_rejection_drops_tokens_or_responses_outside_the_band(level, kept, seq_frac):
    old, rollout = log_ratios([0.4, 3.0, 1.0], [1.5, 1.0])  # the band is [1/2, 2]
    config = RolloutCorrectionConfig(rollout_is=None, rollout_rs=level, rollout_rs_threshold=2.0)
    out = rollout_correction(old, rollout, MASK, config)
    assert out.keep.tolist() == kept
    assert (out.weights == 1).all()  # rejection alone does not weight
    dropped = 5 - sum(map(sum, kept))
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(dropped / 5)
    assert out.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(seq_frac)


def test_sequence_rejection_with_a_narrow_band_and_the_veto():
    old, rollout = log_ratios([0.5, 3.0, 1.0], [1.0, 1e-5])
    narrow = RolloutCorrectionConfig(rollout_is=None, rollout_rs="sequence", rollout_rs_threshold=1.4,
                                     rollout_rs_threshold_lower=0.5)
    assert rollout_correction(old, rollout, MASK, narrow).keep.tolist() == [[False] * 4, [False] * 4]
    veto = RolloutCorrectionConfig(rollout_is=None, rollout_token_veto_threshold=1e-4)
    out = rollout_correction(old, rollout, MASK, veto)
    assert out.keep.tolist() == [[True, True, True, False], [False] * 4]
    assert out.metrics["rollout_corr/rollout_is_veto_fraction"] == 0.5
    assert out.metrics["rollout_corr/masked_fraction"] == pytest.approx(2 / 5)


# --- verl's formulas (verl/trainer/ppo/rollout_corr_helper.py), written here row by row from reading them ---------


def verl_is_weights(old, rollout, mask, level, threshold):
    weights = torch.zeros_like(old)
    for i in range(old.shape[0]):
        valid = mask[i].bool()
        log_ratio = old[i] - rollout[i]
        if level == "token":
            row = torch.exp(log_ratio.clamp(-20, 20))
        else:
            row = torch.exp(log_ratio[valid].sum().clamp(-20, 20)).expand_as(log_ratio)
        weights[i] = torch.where(valid, row, 0.0).clamp(max=threshold)
    return weights


def verl_rs_mask(old, rollout, mask, level, upper, lower):
    keep = torch.zeros_like(old, dtype=torch.bool)
    for i in range(old.shape[0]):
        valid = mask[i].bool()
        log_ratio = old[i] - rollout[i]
        if level == "token":
            ratio = torch.exp(log_ratio.clamp(-20, 20))
        elif level == "sequence":
            ratio = torch.exp(log_ratio[valid].sum().clamp(-20, 20)).expand_as(log_ratio)
        else:
            ratio = torch.exp(log_ratio[valid].mean().clamp(-20, 20)).expand_as(log_ratio)
        keep[i] = valid & (ratio >= lower) & (ratio <= upper)
    return keep


def verl_ess(weights, mask, threshold):
    values = weights[mask.bool()].clamp(1 / threshold, threshold)
    normalized = values / (values.mean() + 1e-8)
    return float(1 / normalized.square().mean())


@pytest.mark.parametrize("seed", range(6))
def test_matches_verl_formulas_on_random_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    rows, width = 7, 9
    old = -torch.rand(rows, width, generator=generator) * 3
    rollout = old + torch.randn(rows, width, generator=generator) * 0.4
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    for level in ("token", "sequence"):
        threshold = 1.5 + seed / 3
        out = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rollout_is=level,
                                                                             rollout_is_threshold=threshold))
        expected = verl_is_weights(old, rollout, mask, level, threshold)
        assert torch.allclose(torch.where(mask.bool(), out.weights, 0.0), expected, rtol=1e-5)
        untruncated = verl_is_weights(old, rollout, mask, level, float("inf"))
        assert out.metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
            verl_ess(untruncated, mask, threshold), rel=1e-4)
    for level in ("token", "sequence", "geometric"):
        config = RolloutCorrectionConfig(rollout_is=None, rollout_rs=level, rollout_rs_threshold=1.3,
                                         rollout_rs_threshold_lower=0.8)
        out = rollout_correction(old, rollout, mask, config)
        assert out.keep.tolist() == verl_rs_mask(old, rollout, mask, level, 1.3, 0.8).tolist()


def test_effective_sample_size_is_one_for_equal_weights():
    weights = torch.full((2, 3), 1.7)
    assert effective_sample_size(weights, torch.ones(2, 3), 2.0) == pytest.approx(1.0)


# --- the config ----------------------------------------------------------------------------------------------------


def test_auto_turns_token_is_on_for_stale_samples_only():
    auto = RolloutCorrectionConfig()
    assert auto.resolve(max_staleness=0, tis_on=False) is None
    assert auto.resolve(max_staleness=1, tis_on=False).rollout_is == "token"
    assert auto.resolve(max_staleness=2, tis_on=True) is None  # the actor's TIS already weights the loss
    off = RolloutCorrectionConfig(rollout_is="null")
    assert off.rollout_is is None and off.resolve(max_staleness=2, tis_on=False) is None
    rs_only = RolloutCorrectionConfig(rollout_is=None, rollout_rs="geometric")
    assert rs_only.resolve(0, False).rollout_rs == "geometric"


@pytest.mark.parametrize("kwargs, message", [
    ({"rollout_is": "tokens"}, "rollout_is='tokens'"),
    ({"rollout_rs": "seq"}, "rollout_rs='seq'"),
    ({"rollout_is_threshold": 0}, "rollout_is_threshold=0"),
    ({"rollout_rs_threshold": 1.5, "rollout_rs_threshold_lower": 2.0}, "lower < upper"),
    ({"rollout_token_veto_threshold": 2.0}, "rollout_token_veto_threshold=2.0"),
])
def test_bad_settings_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrectionConfig(**kwargs)


# --- in the loss ---------------------------------------------------------------------------------------------------


def test_policy_loss_weights_and_masks_the_policy_gradient_term():
    old, rollout = log_ratios([0.5, 4.0, 1.0], [2.0, 1.0])
    old = torch.nan_to_num(old)
    log_probs = old.clone().requires_grad_(True)
    advantages = torch.ones_like(old)
    config = PolicyLossConfig()
    plain, _ = policy_loss(log_probs, old, advantages, MASK, config, rollout_log_probs=rollout)
    corrected = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token", rollout_rs_threshold=3.0,
                                        rollout_rs_threshold_lower=0.9)
    loss, metrics = policy_loss(log_probs, old, advantages, MASK, config, rollout_log_probs=rollout,
                                correction=corrected, global_tokens=5.0)
    # ratio pi/pi_old = 1 everywhere, so each token's loss is -A * weight; rejected: 0.5 and 4.0; kept weights 1, 2, 1;
    # with the batch's token count (what the trainer passes) the rejected tokens still count in the normaliser,
    # without it the local mean is over the kept tokens
    assert float(plain.detach()) == pytest.approx(-1.0)
    assert float(loss.detach()) == pytest.approx(-(1.0 + 2.0 + 1.0) / 5)
    local, _ = policy_loss(log_probs, old, advantages, MASK, config, rollout_log_probs=rollout, correction=corrected)
    assert float(local.detach()) == pytest.approx(-(1.0 + 2.0 + 1.0) / 3)
    assert metrics["rollout_corr/masked_fraction"] == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="rollout_correction"):
        policy_loss(log_probs, old, advantages, MASK, config, correction=corrected)


def test_mismatch_by_staleness_splits_the_tokens():
    trainer = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rollout = torch.tensor([[0.0, -LN2, 0.0], [-LN2, 0.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    staleness = torch.tensor([[0, 1, 1], [1, 0, 0]])
    m = mismatch_by_staleness(trainer, rollout, mask, staleness)
    fresh = rollout_mismatch_metrics(trainer, rollout, mask * (staleness == 0))
    assert m["mismatch/staleness_0/k3_kl"] == fresh["mismatch/k3_kl"] == 0.0
    assert m["mismatch/staleness_1/log_probs_diff_mean"] == pytest.approx(2 * LN2 / 3)
    assert m["mismatch/staleness_0/token_frac"] == pytest.approx(2 / 5)
    assert m["mismatch/staleness_1/token_frac"] == pytest.approx(3 / 5)
    assert not any("staleness_2" in key for key in m)


def verl_statistic(log_ratio, mask, option):
    """The statistic verl's `compute_rollout_rejection_mask` bounds for one divergence option, per token
    (verl/trainer/ppo/rollout_corr_helper.py, volcengine/verl at b178a3cd, transcribed); it keeps a token where this
    is <= the threshold."""
    safe = torch.clamp(log_ratio, -20.0, 20.0)
    per_token = {"k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}[option[-2:]]
    if option.startswith("token"):
        return per_token
    if option.startswith("seq_sum"):
        per_response = (torch.where(mask.bool(), per_token, 0.0) * mask).sum(-1)
    elif option.startswith("seq_mean"):
        per_response = (torch.where(mask.bool(), per_token, 0.0) * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    else:
        top = per_token.masked_fill(~mask.bool(), float("-inf")).max(-1).values
        per_response = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    return per_response[:, None].expand_as(mask)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("option", ["token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3",
                                    "seq_max_k2", "seq_max_k3"])
def test_verls_divergence_rejections_equal_verl(seed, option):
    gen = torch.Generator().manual_seed(seed)
    rollout = -2 * torch.rand(6, 9, generator=gen, dtype=torch.float64)
    old = rollout + 0.3 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = (torch.arange(9)[None, :] < torch.tensor([9, 4, 0, 7, 1, 9])[:, None]).double()
    statistic = verl_statistic(old - rollout, mask, option)
    values = statistic[mask.bool()].unique()  # sorted; the threshold halfway between two of them, about the median
    threshold = float(values[len(values) // 2 - 1: len(values) // 2 + 1].mean())
    config = RolloutCorrectionConfig(rollout_is=None, rollout_rs=option, rollout_rs_threshold=threshold)
    out = rollout_correction(old, rollout, mask, config)
    assert out.keep.tolist() == ((statistic <= threshold) & mask.bool()).tolist()
    assert 0 < out.metrics["rollout_corr/rollout_rs_masked_fraction"] < 1


def test_verls_ratio_band_names_are_ours():
    for verl_name, ours in (("token_k1", "token"), ("seq_sum_k1", "sequence"), ("seq_mean_k1", "geometric")):
        assert RolloutCorrectionConfig(rollout_rs=verl_name).rollout_rs == ours


@pytest.mark.parametrize("settings, message", [
    (dict(rollout_rs="token_k3"), "rollout_rs=token_k3 bounds a divergence from above: set "
                                  "algorithm.rollout_correction.rollout_rs_threshold > 0"),
    (dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold=0.1), "combining rejection criteria"),
    (dict(rollout_rs="seq_max_k1"), "rollout_rs='seq_max_k1' is unknown"),
])
def test_divergence_rejection_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RolloutCorrectionConfig(**settings)
