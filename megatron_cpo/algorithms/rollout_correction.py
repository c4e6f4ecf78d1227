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

from dataclasses import dataclass, replace
from typing import Optional

import torch

from megatron_cpo.algorithms.kl import LOG_RATIO_CLAMP
from megatron_cpo.algorithms.masked import masked_mean, masked_sum
from megatron_cpo.config_checks import check

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
VERL_RATIO_RS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}
DIVERGENCE_RS = ("token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                 "seq_max_k3")
AUTO = "auto"


def _off(value: Optional[str]) -> Optional[str]:
    """YAML's null and the spellings "none" / "null" all mean off."""
    return None if value is None or str(value).lower() in ("none", "null", "") else value


@dataclass
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction` (verl's names).

    rollout_is: `token`, `sequence`, null (off) or `auto` (the default): token level when the run trains on stale
        samples (`async_training.max_staleness` > 0) unless the actor's TIS (`tis_imp_ratio_cap`) already weights
        the loss, off otherwise.
    rollout_is_threshold: the truncation C of the importance weights (2.0 as the TIS authors recommend).
    rollout_rs: `token`, `sequence`, `geometric` (verl: `token_k1`, `seq_sum_k1`, `seq_mean_k1`) or null (off): which
        ratios must stay inside the band; or one of verl's divergence bounds (`token_k2` ... `seq_max_k3`).
    rollout_rs_threshold / rollout_rs_threshold_lower: the band's ends (null: the IS threshold, and its reciprocal);
        for a divergence bound, its upper end (required, e.g. 0.01 for k3).
    rollout_token_veto_threshold: drop a response with any token ratio below this (null: off; e.g. 1e-4).
    """
    rollout_is: Optional[str] = AUTO
    rollout_is_threshold: float = 2.0
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[float] = None
    rollout_rs_threshold_lower: Optional[float] = None
    rollout_token_veto_threshold: Optional[float] = None

    def __post_init__(self) -> None:
        prefix = "algorithm.rollout_correction."
        self.rollout_is, self.rollout_rs = _off(self.rollout_is), _off(self.rollout_rs)
        self.rollout_rs = VERL_RATIO_RS.get(self.rollout_rs, self.rollout_rs)
        check(self.rollout_is in (None, AUTO, *IS_LEVELS), f"{prefix}rollout_is={self.rollout_is!r} is unknown; choose "
              "token, sequence, auto (token when training on stale samples) or null (off)")
        check("," not in str(self.rollout_rs), f"{prefix}rollout_rs={self.rollout_rs!r}: combining rejection criteria "
              "(verl's comma-separated list) is not built; choose one")
        check(self.rollout_rs in (None, *RS_LEVELS, *DIVERGENCE_RS), f"{prefix}rollout_rs={self.rollout_rs!r} is "
              f"unknown; choose token, sequence, geometric (ratio bands), one of {', '.join(DIVERGENCE_RS)} "
              "(divergence bounds) or null (off)")
        if self.rollout_rs in DIVERGENCE_RS:
            check(self.rollout_rs_threshold is not None and self.rollout_rs_threshold > 0 and
                  self.rollout_rs_threshold_lower is None, f"{prefix}rollout_rs={self.rollout_rs} bounds a divergence "
                  f"from above: set {prefix}rollout_rs_threshold > 0 (e.g. 0.01) and leave rollout_rs_threshold_lower "
                  "null")
        check(self.rollout_is_threshold > 0, f"{prefix}rollout_is_threshold={self.rollout_is_threshold} must be > 0 "
              "(typical 1.5-5)")
        upper, lower = self.rs_band
        check(self.rollout_rs in DIVERGENCE_RS or (upper > 0 and 0 <= lower < upper),
              f"{prefix}rollout_rs_threshold_lower={lower} and rollout_rs_threshold={upper} must satisfy "
              "0 <= lower < upper (the band of ratios kept)")
        veto = self.rollout_token_veto_threshold
        check(veto is None or 0 < veto < 1, f"{prefix}rollout_token_veto_threshold={veto} must be in (0, 1), e.g. "
              "1e-4, or null")

    @property
    def rs_band(self) -> tuple[float, float]:
        """(upper, lower) ends of the rejection band."""
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return upper, lower

    @property
    def explicit_is(self) -> bool:
        """Whether the importance weights were switched on by name (not by `auto`)."""
        return self.rollout_is in IS_LEVELS

    def resolve(self, max_staleness: int, tis_on: bool) -> Optional["RolloutCorrectionConfig"]:
        """The correction a run applies (None: nothing to do): `auto` becomes token-level IS when the samples may
        be stale (`max_staleness` > 0) and the actor's TIS is off, and is off otherwise."""
        level = self.rollout_is
        if level == AUTO:
            level = "token" if max_staleness > 0 and not tis_on else None
        if level is None and self.rollout_rs is None and self.rollout_token_veto_threshold is None:
            return None
        return replace(self, rollout_is=level)


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
    """verl's divergence statistic `option` (DIVERGENCE_RS) of each token, broadcast to [N, T]: k2 or k3 of the
    log-ratio (bounded to +-20), the token's own or its response's sum, mean or maximum (0 for an empty one)."""
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
