"""Clipped policy loss (PPO / GRPO / DAPO), loss aggregation, entropy bonus and entropy mask, KL loss, TIS.

- PPO clip (Schulman et al., 2017) with separate lower / upper ranges: DAPO's clip-higher (Yu et al., 2025) sets
  `clip_ratio_high` (e.g. 0.28) above `clip_ratio_low` (0.2). Dual-clip (Ye et al., 2020) bounds the loss of
  negative-advantage tokens by `clip_ratio_c * |A|`. The log-ratio is clamped to +-20 as in verl.
- Aggregation modes are verl's names plus `token-sum`. Given the global token / sequence counts of the whole batch
  (all micro-batches on all data-parallel ranks), each call returns this micro-batch's share: the shares SUM to the
  loss of the whole batch, so the result does not depend on how the batch is split. A trainer whose data-parallel
  reduction averages gradients multiplies by the DP size. `seq-mean-token-sum-norm` is Dr.GRPO's
  `sum_i sum_t loss / (num_seqs * L)` with L the constant generation budget (verl omits the 1/num_seqs).
- Entropy mask (ms-swift `top_entropy_quantile`, Wang et al., 2025 "Beyond the 80/20 rule"): only the tokens whose
  entropy is at or above the batch quantile `1 - q` take part in the policy-gradient term.
"""
from typing import Callable, Optional

import torch

from megatron_cpo.algorithms.config import PolicyLossConfig, RolloutCorrectionConfig
from megatron_cpo.algorithms.kl import LOG_RATIO_CLAMP, kl_penalty
from megatron_cpo.algorithms.masked import masked_sum
from megatron_cpo.algorithms.rollout_correction import rollout_correction
from megatron_cpo.algorithms.mismatch import (  # noqa: F401  (re-exported: the loss module's public surface)
    rollout_mismatch_metrics,
    truncated_importance_weights,
)


def _token_mean(values, mask, global_tokens, global_seqs, norm_length):
    return masked_sum(values, mask) / (global_tokens if global_tokens is not None else mask.sum().clamp(min=1))


def _token_sum(values, mask, global_tokens, global_seqs, norm_length):
    return masked_sum(values, mask)


def _seq_count(mask, global_seqs):
    return global_seqs if global_seqs is not None else (mask.sum(-1) > 0).sum().clamp(min=1)


def _seq_mean_token_sum(values, mask, global_tokens, global_seqs, norm_length):
    return masked_sum(values, mask) / _seq_count(mask, global_seqs)


def _seq_mean_token_mean(values, mask, global_tokens, global_seqs, norm_length):
    per_seq = masked_sum(values, mask, -1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / _seq_count(mask, global_seqs)


def _seq_mean_token_sum_norm(values, mask, global_tokens, global_seqs, norm_length):
    length = norm_length if norm_length is not None else mask.shape[-1]
    return masked_sum(values, mask) / (_seq_count(mask, global_seqs) * length)


LOSS_AGGREGATIONS: dict[str, Callable] = {  # keyed by config.LOSS_AGGREGATION_MODES
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def check_loss_agg_mode(mode: str) -> None:
    """Raise a clear error for an unknown aggregation mode."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {sorted(LOSS_AGGREGATIONS)}")


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_length: Optional[int] = None,
) -> torch.Tensor:
    """Reduce a per-token loss Tensor[N, T] to a scalar with `mode`.

    global_tokens / global_seqs: counts over the whole batch (all micro-batches, all DP ranks); with them the result
    is this micro-batch's additive share, without them the local loss. Sequences with no unmasked token do not count.
    norm_length: the constant L of `seq-mean-token-sum-norm` (default T, the padded response length).
    Padded positions are ignored whatever they hold (NaN / inf included; `masked.masked_sum`).
    """
    check_loss_agg_mode(mode)
    if global_tokens is not None and global_tokens <= 0:
        raise ValueError(f"global_tokens={global_tokens} must be > 0 (the unmasked tokens of the whole batch)")
    if global_seqs is not None and global_seqs <= 0:
        raise ValueError(f"global_seqs={global_seqs} must be > 0 (the non-empty responses of the whole batch)")
    mask = mask.to(values.dtype)
    return LOSS_AGGREGATIONS[mode](values, mask, global_tokens, global_seqs, norm_length)


def entropy_mask(
    entropy: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float
) -> tuple[torch.Tensor, float]:
    """Keep only tokens whose entropy is at or above the `1 - q` quantile of the batch's unmasked entropies.

    Returns the boolean keep mask (already AND-ed with `mask`) and the threshold (linear-interpolated quantile, as
    `torch.quantile`). q = 1 keeps every unmasked token.
    """
    if not 0.0 < top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile} must be in (0, 1]; 1.0 disables the mask")
    valid = mask.bool()
    values = entropy.detach()[valid].float().sort().values
    if top_entropy_quantile >= 1.0 or values.numel() == 0:
        return valid, float(values[0]) if values.numel() else 0.0
    position = (1.0 - top_entropy_quantile) * (values.numel() - 1)
    low = int(position)
    high = min(low + 1, values.numel() - 1)
    threshold = float(values[low] + (position - low) * (values[high] - values[low]))
    return valid & (entropy.detach() >= threshold), threshold


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token PPO loss with asymmetric clip and dual-clip, Tensor[N, T], and its clip statistics.

    Metrics: verl's `pg_clipfrac`, `pg_clipfrac_lower`, `ppo_kl` (token means) and ms-swift's per-response clip
    fractions `clip_ratio/{low_mean, low_min, high_mean, high_max, region_mean}` (low: ratio < 1 - low with A < 0;
    high: ratio > 1 + high with A > 0).
    """
    valid = mask.bool()
    # Padding may hold anything (NaN included): zero it before the arithmetic, so that neither the loss nor its
    # gradient (d loss / d ratio = -A) can pick a NaN up from a padded position.
    advantages = torch.where(valid, advantages, 0.0)
    log_ratio = torch.where(valid, log_probs - old_log_probs, 0.0)
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    neg_advantages = -advantages
    loss_unclipped = neg_advantages * ratio
    loss_clipped = neg_advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    dual_bound = neg_advantages * clip_ratio_c
    negative = advantages < 0
    losses = torch.where(negative, torch.minimum(dual_bound, loss_ppo), loss_ppo)
    with torch.no_grad():
        seq_tokens = valid.sum(-1)
        tokens = seq_tokens.sum().clamp(min=1)
        nonempty = seq_tokens > 0
        low = (ratio < 1.0 - clip_ratio_low) & negative & valid
        high = (ratio > 1.0 + clip_ratio_high) & (advantages > 0) & valid
        low_count, high_count = low.sum(-1), high.sum(-1)

        def per_seq(count: torch.Tensor) -> torch.Tensor:
            return (count / seq_tokens.clamp(min=1))[nonempty]

        # low and high never overlap (they need opposite advantage signs), so the region count is their sum
        low_seq, high_seq, region_seq = per_seq(low_count), per_seq(high_count), per_seq(low_count + high_count)
        any_seq = bool(nonempty.any())
        metrics = {
            "pg_clipfrac": float(((loss_clipped > loss_unclipped) & valid).sum() / tokens),
            "pg_clipfrac_lower": float(((loss_ppo > dual_bound) & negative & valid).sum() / tokens),
            "ppo_kl": float(-torch.where(valid, log_ratio, 0.0).sum() / tokens),
            "clip_ratio/low_mean": float(low_seq.mean()) if any_seq else 0.0,
            "clip_ratio/low_min": float(low_seq.min()) if any_seq else 0.0,
            "clip_ratio/high_mean": float(high_seq.mean()) if any_seq else 0.0,
            "clip_ratio/high_max": float(high_seq.max()) if any_seq else 0.0,
            "clip_ratio/region_mean": float(region_seq.mean()) if any_seq else 0.0,
        }
    return losses, metrics


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    entropy: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    correction: Optional[RolloutCorrectionConfig] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total actor loss `pg - entropy_coeff * entropy + kl_loss_coef * kl` for one micro-batch, and its metrics.

    All per-token inputs are Tensor[N, T]; `mask` is the response (loss) mask. See `aggregate_loss` for the global
    counts. `rollout_log_probs` (the engine's log-probs of the sampled tokens) adds mismatch metrics, and TIS when
    `config.tis` is set. `correction` (a resolved `algorithm.rollout_correction`, rollout_correction.py) weights the
    policy-gradient term by its importance weights and drops the tokens it rejects from it.
    """
    pg_losses, metrics = clipped_policy_loss(
        log_probs, old_log_probs, advantages, mask,
        config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c,
    )
    if rollout_log_probs is not None:
        metrics.update(rollout_mismatch_metrics(old_log_probs, rollout_log_probs, mask))
        if config.tis is not None:
            weights, tis_metrics = truncated_importance_weights(old_log_probs, rollout_log_probs, mask, config.tis)
            pg_losses = pg_losses * weights
            metrics.update(tis_metrics)
    elif config.tis is not None or correction is not None:
        raise ValueError("tis / rollout_correction is enabled but rollout_log_probs is None; pass the engine's "
                         "log-probs or switch the correction off")
    pg_mask = mask.bool()
    if correction is not None:
        corrected = rollout_correction(old_log_probs, rollout_log_probs, mask, correction)
        pg_losses = pg_losses * corrected.weights
        pg_mask = corrected.keep
        metrics.update(corrected.metrics)
    if config.top_entropy_quantile < 1.0:
        # The quantile is taken over this micro-batch; with token-mean and global counts, pass the kept-token count
        # as global_tokens to get ms-swift's mean over the kept tokens.
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy; pass entropy=")
        entropy_keep, threshold = entropy_mask(entropy, mask, config.top_entropy_quantile)
        pg_mask = pg_mask & entropy_keep
        metrics["entropy/threshold"] = threshold
    pg_loss = aggregate_loss(pg_losses, pg_mask, config.loss_agg_mode, global_tokens, global_seqs)
    loss = pg_loss
    metrics["pg_loss"] = float(pg_loss.detach())
    if entropy is not None:
        entropy_loss = aggregate_loss(entropy, mask, config.loss_agg_mode, global_tokens, global_seqs)
        metrics["entropy"] = float(entropy_loss.detach())
        loss = loss - config.entropy_coeff * entropy_loss
    elif config.entropy_coeff != 0.0:
        raise ValueError(f"entropy_coeff={config.entropy_coeff} needs the per-token entropy; pass entropy=")
    if config.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("use_kl_loss=True needs ref_log_probs from the reference model; pass ref_log_probs=")
        # ref_log_probs zeroed on padding like old_log_probs above (log_probs itself is finite there)
        kl = kl_penalty(log_probs, torch.where(mask.bool(), ref_log_probs, log_probs.detach()), config.kl_loss_type)
        kl_loss = aggregate_loss(kl, mask, config.loss_agg_mode, global_tokens, global_seqs)
        metrics["kl_loss"] = float(kl_loss.detach())
        loss = loss + config.kl_loss_coef * kl_loss
    return loss, metrics
