"""Off-policy correction against the behaviour policy: importance weights and rejection masks (verl's
`algorithm.rollout_correction`).

The tokens a batch trains on were sampled by the rollout engine, under the weights it held then: an older policy
version with asynchronous training (`async_training.max_staleness` > 0), and a slightly different implementation of
the same weights always (kernels, precision). With `r_t = pi_old(y_t) / pi_rollout(y_t)` (the trainer's old
log-probs against the engine's), the PPO loss is corrected as in AReaL's decoupled objective and verl's "decoupled
mode": clip on pi / pi_old as usual, times an importance weight on pi_old / pi_rollout.

- Importance sampling (`rollout_is`): `token` weights each token by min(r_t, C); `sequence` weights every token of a
  response by min(prod_t r_t, C) (C = `rollout_is_threshold`). Token level is today's TIS.
- Rejection (`rollout_rs`): tokens (`token`), whole responses by the product of their ratios (`sequence`) or by its
  geometric mean (`geometric`) whose ratio leaves the band [lower, upper] drop out of the policy-gradient term
  (upper = `rollout_rs_threshold`, default the IS threshold; lower = `rollout_rs_threshold_lower`, default 1/upper).
  verl's names of the same bands are accepted: `token_k1`, `seq_sum_k1`, `seq_mean_k1`. verl's divergence bounds
  drop what a KL estimate of `log r` puts above `rollout_rs_threshold`: `k2` = (log r)^2 / 2, `k3` = r - 1 - log r,
  per token (`token_k2`, `token_k3`) or over a response's tokens summed, averaged or at their maximum (`seq_sum_*`,
  `seq_mean_*`, `seq_max_*`). One criterion per run (verl's comma-separated lists are refused).
- Veto (`rollout_token_veto_threshold`): a response with any token ratio below it is dropped whole.

Ratios are formed in log space and bounded to exp(+-20) before exponentiating (verl's safety bound). Weights are
detached: they change the measure, not the objective. Rejected tokens leave the policy-gradient term only (entropy
and KL terms keep them); as with the entropy mask in losses.py, the trainer's loss is still normalised by the batch's
token count, so a rejected fraction f scales the step by 1 - f, where verl divides by the kept tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_cpo.algorithms.config import IS_LEVELS, RS_LEVELS, RolloutCorrectionConfig
from megatron_cpo.algorithms.kl import LOG_RATIO_CLAMP
from megatron_cpo.algorithms.masked import masked_mean, masked_sum


@dataclass
class RolloutCorrection:
    """`weights`: detached importance weights [N, T] (1 on padding and where IS is off); `keep`: bool [N, T], the
    valid tokens that rejection and veto leave in the policy-gradient term; `metrics` under `rollout_corr/`."""
    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, float]


def _level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per-token log-ratios at `level`, broadcast to [N, T]: the token's own, the response's sum (`sequence`) or
    its mean (`geometric`); bounded to +-20."""
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, mask, -1)[:, None].expand_as(log_ratio)
    elif level == "geometric":
        log_ratio = masked_mean(log_ratio, mask, -1)[:, None].expand_as(log_ratio)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def divergence(log_ratio: torch.Tensor, valid: torch.Tensor, option: str) -> torch.Tensor:
    """verl's divergence statistic `option` (config.DIVERGENCE_RS) of each token, broadcast to [N, T]: k2 or k3 of
    the log-ratio (bounded to +-20), the token's own or its response's sum, mean or maximum (0 for an empty one)."""
    aggregate, estimator = option.rsplit("_", 1)
    bounded = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    per_token = 0.5 * bounded.square() if estimator == "k2" else torch.exp(bounded) - 1.0 - bounded
    if aggregate == "token":
        return per_token
    if aggregate == "seq_sum":
        per_response = masked_sum(per_token, valid, -1)
    elif aggregate == "seq_mean":
        per_response = masked_mean(per_token, valid, -1)
    else:
        per_response = torch.where(valid, per_token, float("-inf")).max(-1).values.clamp(min=0.0)
    return per_response[:, None].expand_as(per_token)


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor, threshold: float) -> float:
    """verl's ESS of importance weights, a fraction in (0, 1]: 1 / E[(w / E[w])^2] over the valid tokens, with the
    weights first clamped to [1/C, C].

    It is E[w]^2 / E[w^2], at most 1 by Cauchy-Schwarz; in float32 equal weights gave 1.0000001, so it is computed
    in float64 and the last rounding is clamped to 1 (it can never exceed its bound)."""
    clamped = weights.double().clamp(min=1.0 / threshold, max=threshold)
    normalized = clamped / (masked_mean(clamped, mask) + 1e-8)
    return min(float(1.0 / masked_mean(normalized.square(), mask)), 1.0)


@torch.no_grad()
def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                       config: RolloutCorrectionConfig) -> RolloutCorrection:
    """Importance weights and the rejection/veto mask of one batch ([N, T] inputs; `mask` the response mask), and
    their metrics: the ratio's mean and max (at the IS level, before truncation), the weights' effective sample
    size, and the fraction of tokens and of responses rejected."""
    valid = mask.bool()
    raw = torch.where(valid, old_log_probs - rollout_log_probs, 0.0).float()
    threshold = config.rollout_is_threshold
    level = config.rollout_is if config.rollout_is in IS_LEVELS else "token"
    ratio = torch.exp(_level_log_ratio(raw, valid, level))
    weights = torch.ones_like(ratio)
    if config.rollout_is in IS_LEVELS:
        weights = torch.where(valid, ratio.clamp(max=threshold), weights)
    keep = valid.clone()
    if config.rollout_rs in RS_LEVELS:
        upper, lower = config.rs_band
        rs_ratio = torch.exp(_level_log_ratio(raw, valid, config.rollout_rs))
        keep &= (rs_ratio >= lower) & (rs_ratio <= upper)
    elif config.rollout_rs is not None:
        keep &= divergence(raw, valid, config.rollout_rs) <= config.rollout_rs_threshold
    rs_dropped = valid & ~keep
    vetoed = torch.zeros(len(raw), dtype=torch.bool)
    if config.rollout_token_veto_threshold is not None:
        below = valid & (raw < torch.log(torch.tensor(config.rollout_token_veto_threshold)))
        vetoed = below.any(-1)
        keep &= ~vetoed[:, None]
    responses = valid.any(-1)
    count = max(int(responses.sum()), 1)
    metrics = {
        "rollout_corr/rollout_is_mean": float(masked_mean(ratio, valid)),
        "rollout_corr/rollout_is_max": float(ratio[valid].max()) if bool(valid.any()) else 1.0,
        "rollout_corr/rollout_is_eff_sample_size": effective_sample_size(ratio, valid, threshold),
        "rollout_corr/rollout_rs_masked_fraction": float(masked_mean(rs_dropped.float(), valid)),
        "rollout_corr/rollout_rs_seq_masked_fraction": float((rs_dropped.any(-1) & responses).sum()) / count,
        "rollout_corr/rollout_is_veto_fraction": float((vetoed & responses).sum()) / count,
        "rollout_corr/masked_fraction": float(masked_mean((valid & ~keep).float(), valid)),
    }
    return RolloutCorrection(weights, keep, metrics)
