"""Off-policy correction against the behaviour policy: importance weights and rejection masks (verl's
`algorithm.rollout_correction`), as in AReaL's decoupled objective: the PPO clip on pi / pi_old times a detached
weight on pi_old / pi_rollout. Ratios are bounded to exp(+-20) in log space (verl's bound); rejected tokens leave only
the policy-gradient term. The options and how they differ from verl: docs/async.md, "The off-policy correction".
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
