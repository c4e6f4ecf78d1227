"""PPO's clipped value loss (algorithms/value_loss.py) against verl's `compute_value_loss` and the critic's batch
metrics against verl's `compute_data_metrics`, on random batches with empty responses, for every `loss_agg_mode` the
critic accepts: the loss, its gradient with respect to the values, `vf_clipfrac` and `vpred_mean`; and the shares of
a mini-batch split into micro-batches (with the global counts) sum to the loss of the whole.

The oracle is written from verl's definitions (verl/trainer/ppo/core_algos.py, volcengine/verl): `vpredclipped =
clip(vpreds, values - c, values + c)`, `0.5 * agg_loss(max((vpreds - R)^2, (vpredclipped - R)^2))`, `vf_clipfrac =
masked_mean(clipped error > unclipped error)`, with verl's `agg_loss` over the non-empty responses
(`seq-mean-token-sum-norm` divides the token sums by the response count and the generation length, as verl's newer
`agg_loss` does); `token-sum` is this project's own mode (the plain masked sum).
"""
import pytest
import torch

from megatron_cpo.algorithms.config import LOSS_AGGREGATION_MODES
from megatron_cpo.algorithms.value_loss import value_loss, value_metrics

SEEDS = range(6)
CLIP_RANGES = (0.05, 0.5)


def verl_agg_loss(loss, mask, mode):
    """verl's `agg_loss` of one micro-batch (empty responses do not count as sequences)."""
    seq_mask = (mask.sum(-1) > 0).to(loss.dtype)
    seq_sums = (loss * mask).sum(-1)
    if mode == "token-mean":
        return seq_sums.sum() / mask.sum()
    if mode == "token-sum":
        return seq_sums.sum()
    if mode == "seq-mean-token-sum":
        return (seq_sums * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        return (seq_sums / (mask.sum(-1) + 1e-8) * seq_mask).sum() / seq_mask.sum()
    assert mode == "seq-mean-token-sum-norm"
    return (seq_sums / mask.shape[-1] * seq_mask).sum() / seq_mask.sum()


def verl_value_loss(vpreds, returns, old_values, mask, cliprange_value, mode):
    """verl's `compute_value_loss` and the mean new value (`critic/vpred_mean`)."""
    vpredclipped = torch.max(torch.min(vpreds, old_values + cliprange_value), old_values - cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpredclipped - returns) ** 2
    loss = 0.5 * verl_agg_loss(torch.max(unclipped, clipped), mask, mode)
    clipfrac = (torch.gt(clipped, unclipped).to(mask.dtype) * mask).sum() / mask.sum()
    vpred_mean = (vpreds.detach() * mask).sum() / mask.sum()
    return loss, clipfrac, vpred_mean


def random_batch(seed: int, rows: int = 6, width: int = 8):
    """New values, old values near them (part of them more than a clip range away), returns, and a response mask
    with one empty response."""
    gen = torch.Generator().manual_seed(seed)
    old_values = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    values = old_values + 0.3 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    returns = old_values + torch.randn(rows, width, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[int(torch.randint(0, rows, (1,), generator=gen))] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    return values, old_values, returns, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cliprange_value", CLIP_RANGES)
@pytest.mark.parametrize("mode", LOSS_AGGREGATION_MODES)
def test_value_loss_equals_verl_in_loss_gradient_and_metrics(seed, cliprange_value, mode):
    values, old_values, returns, mask = random_batch(seed)
    ours = values.clone().requires_grad_()
    loss, metrics = value_loss(ours, old_values, returns, mask, cliprange_value, mode)
    loss.backward()
    theirs = values.clone().requires_grad_()
    expected, clipfrac, vpred_mean = verl_value_loss(theirs, returns, old_values, mask, cliprange_value, mode)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-9)
    valid = mask.bool()
    torch.testing.assert_close(ours.grad[valid], theirs.grad[valid], rtol=1e-6, atol=1e-9)
    assert not ours.grad[~valid].any()
    assert float(metrics["vf_loss"]) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert float(metrics["vf_clipfrac"]) == pytest.approx(float(clipfrac), abs=1e-9)
    assert float(metrics["vpred_mean"]) == pytest.approx(float(vpred_mean), abs=1e-9)


def test_the_random_batches_clip_part_of_the_tokens():
    """Both branches of the max are taken (else the equality above would not test the clipping)."""
    for cliprange_value in CLIP_RANGES:
        values, old_values, returns, mask = random_batch(0)
        _, metrics = value_loss(values, old_values, returns, mask, cliprange_value, "token-mean")
        assert 0 < float(metrics["vf_clipfrac"]) < 1, cliprange_value


@pytest.mark.parametrize("mode", LOSS_AGGREGATION_MODES)
def test_micro_batch_shares_sum_to_the_mini_batch_loss(mode):
    """With the mini-batch's token and response counts, the micro-batches' losses and metrics are shares that add up
    to the whole mini-batch's, however it is split (the critic's update relies on it over micro-batches and DP)."""
    values, old_values, returns, mask = random_batch(1)
    whole, whole_metrics = value_loss(values, old_values, returns, mask, 0.2, mode)
    tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    shares = [value_loss(values[rows], old_values[rows], returns[rows], mask[rows], 0.2, mode, tokens, seqs)
              for rows in (slice(0, 1), slice(1, 4), slice(4, 6))]
    torch.testing.assert_close(sum(loss for loss, _ in shares), whole, rtol=1e-12, atol=1e-12)
    for key in ("vf_loss", "vf_clipfrac", "vpred_mean"):
        torch.testing.assert_close(sum(metrics[key] for _, metrics in shares), whole_metrics[key], rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_value_metrics_equal_verl(seed):
    """verl's `critic/values/*`, `critic/returns/*` over the response tokens and `critic/vf_explained_var` =
    1 - Var(R - V) / (Var(R) + 1e-5) with unbiased variances."""
    values, _, returns, mask = random_batch(seed)
    metrics = value_metrics(values, returns, mask)
    valid = mask.bool()
    kept_values, kept_returns = values[valid], returns[valid]
    expected = {"critic/values/mean": kept_values.mean(), "critic/values/max": kept_values.max(),
                "critic/values/min": kept_values.min(), "critic/returns/mean": kept_returns.mean(),
                "critic/returns/max": kept_returns.max(), "critic/returns/min": kept_returns.min(),
                "critic/vf_explained_var": 1.0 - torch.var(kept_returns - kept_values) / (torch.var(kept_returns)
                                                                                          + 1e-5)}
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-9, abs=1e-12), key


def test_explained_variance_is_one_for_perfect_values_and_near_zero_for_the_mean():
    _, _, returns, mask = random_batch(2)
    assert value_metrics(returns, returns, mask)["critic/vf_explained_var"] == pytest.approx(1.0)
    constant = torch.full_like(returns, float(returns[mask.bool()].mean()))
    assert value_metrics(constant, returns, mask)["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-4)
