"""The policy-loss modes under verl's names (`actor_rollout_ref.actor.policy_loss.loss_mode`), one small class each,
registered in `POLICY_LOSS_MODES`.

A mode turns the per-token log-probs (current and old), advantages and response mask [N, T] into per-token
policy-gradient losses (0 on padding) and its metrics; losses.py weights them (TIS, off-policy correction), masks
them (entropy mask, rejection) and aggregates them with `loss_agg_mode`, or with the aggregation a mode's objective
fixes. That aggregation and the clip ranges a mode takes are data of the config (loss_config.py
`POLICY_LOSS_MODE_RULES`, `LOSS_MODE_CHECKS`), so a config that asks for something a mode does not define is refused
when it loads. Formulas and when to use each: docs/algorithms.md. Each equals verl's `core_algos` loss of the same
name, metrics included (tests/algorithms/test_policy_losses_vs_verl.py).

Padding may hold anything (NaN included): every mode zeroes the log-ratio and the advantage there before the
arithmetic, so neither the loss nor its gradient can pick a NaN up from a padded position.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from megatron_cpo.algorithms.kl import LOG_RATIO_CLAMP
from megatron_cpo.algorithms.loss_config import PolicyLossConfig
from megatron_cpo.algorithms.masked import masked_mean, masked_select_zero

GSPO_LOG_RATIO_MAX = 10.0  # verl's bound on GSPO's combined log-ratio


def _token_mean(values: torch.Tensor, valid: torch.Tensor) -> float:
    return float(masked_mean(values.detach().float(), valid))


def _valid_inputs(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                  valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-ratio, advantages) with padding set to 0."""
    return torch.where(valid, log_probs - old_log_probs, 0.0), torch.where(valid, advantages, 0.0)


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


class PolicyLossMode(ABC):
    """A policy-loss mode: `losses` gives the per-token losses and metrics, `weighted` applies importance weights.
    What the mode defines (its aggregation, clip ranges) is loss_config.POLICY_LOSS_MODE_RULES, checked when a config
    loads."""

    @abstractmethod
    def losses(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, config: PolicyLossConfig, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-token losses [N, T] (0 on padding) and metrics; `generator` draws a mode's random choices."""

    def weighted(self, losses: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The losses times detached importance weights [N, T] (TIS, the off-policy correction)."""
        return losses * weights


class Vanilla(PolicyLossMode):
    """PPO's clipped surrogate with clip-higher and dual-clip (`clipped_policy_loss`)."""

    def losses(self, log_probs, old_log_probs, advantages, mask, config, generator=None):
        return clipped_policy_loss(log_probs, old_log_probs, advantages, mask, config.clip_ratio_low,
                                   config.clip_ratio_high, config.clip_ratio_c)


class GSPO(PolicyLossMode):
    """GSPO (Zheng et al., 2025): one importance ratio per sequence, the geometric mean of its token ratios, clipped
    (typically to [1 - 3e-4, 1 + 4e-4]); each token carries it with its own gradient (`s_i * pi_t / sg(pi_t)`)."""

    def losses(self, log_probs, old_log_probs, advantages, mask, config, generator=None):
        valid = mask.bool()
        log_ratio, advantages = _valid_inputs(log_probs, old_log_probs, advantages, valid)
        seq_log_ratio = log_ratio.sum(-1) / valid.sum(-1).clamp(min=1)
        combined = torch.where(valid, log_probs - log_probs.detach(), 0.0) + seq_log_ratio.detach()[:, None]
        ratio = torch.exp(combined.clamp(max=GSPO_LOG_RATIO_MAX))
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
        metrics = {"pg_clipfrac": _token_mean(clipped > unclipped, valid), "ppo_kl": _token_mean(-log_ratio, valid),
                   "pg_clipfrac_lower": 0.0}
        return torch.maximum(unclipped, clipped), metrics


class SAPO(PolicyLossMode):
    """SAPO (Gao et al., 2025): a smooth sigmoid gate `4 / tau * sigmoid(tau (r - 1))` in place of the hard clip,
    with `tau_pos` for positive and `tau_neg` for other advantages."""

    def losses(self, log_probs, old_log_probs, advantages, mask, config, generator=None):
        valid = mask.bool()
        log_ratio, advantages = _valid_inputs(log_probs, old_log_probs, advantages, valid)
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # verl's bound, its ppo_kl included
        ratio = torch.exp(log_ratio)
        tau = torch.where(advantages > 0, config.tau_pos, config.tau_neg).to(ratio.dtype)
        gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        return -gates * advantages, {"pg_clipfrac": 0.0, "ppo_kl": _token_mean(-log_ratio, valid),
                                     "pg_clipfrac_lower": 0.0}


class CISPO(PolicyLossMode):
    """CISPO (MiniMax, 2025): REINFORCE on `log pi` weighted by the clipped, detached ratio, so clipped tokens still
    get a gradient (`clip_ratio_low` >= 1 leaves the ratio unbounded below)."""

    def losses(self, log_probs, old_log_probs, advantages, mask, config, generator=None):
        valid = mask.bool()
        log_ratio, advantages = _valid_inputs(log_probs, old_log_probs, advantages, valid)
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # verl's bound, its ppo_kl included
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high).detach()
        losses = -clipped * advantages * torch.where(valid, log_probs, 0.0)
        return losses, {"pg_clipfrac": _token_mean(ratio != clipped, valid), "ppo_kl": _token_mean(-log_ratio, valid),
                        "pg_clipfrac_lower": 0.0}


class GeometricMean(PolicyLossMode):
    """GMPO (Zhao et al., 2025): the geometric mean of the token ratios, each clipped in log space to
    [-clip_ratio_low, clip_ratio_high] on the side its advantage's sign pushes, times the sequence's mean advantage;
    one loss per sequence (spread over its tokens, so the sequence mean aggregates it)."""

    def losses(self, log_probs, old_log_probs, advantages, mask, config, generator=None):
        valid = mask.bool()
        log_ratio, advantages = _valid_inputs(log_probs, old_log_probs, advantages, valid)
        sign = torch.sign(advantages)
        bounded = log_ratio.clamp(-config.clip_ratio_low, config.clip_ratio_high)
        kept = sign * torch.minimum(sign * log_ratio, sign * bounded)
        lengths = valid.sum(-1).clamp(min=1)
        ratio = torch.exp(masked_select_zero(kept, valid).sum(-1) / lengths)
        seq_advantage = advantages.sum(-1) / lengths
        clipped = log_ratio != bounded
        metrics = {"pg_clipfrac": _token_mean(clipped & (advantages > 0), valid),
                   "pg_clipfrac_lower": _token_mean(clipped & (advantages < 0), valid),
                   "ppo_kl": _token_mean(-log_ratio, valid)}
        return (-seq_advantage * ratio)[:, None].expand_as(log_ratio), metrics

    def weighted(self, losses, weights, mask):
        """verl's sequence weight for GMPO: the geometric mean of the token weights."""
        valid = mask.bool()
        log_weights = torch.where(valid, torch.log(weights + 1e-10), 0.0)
        return losses * torch.exp(log_weights.sum(-1) / valid.sum(-1).clamp(min=1))[:, None]


class GPG(PolicyLossMode):
    """GPG (Chu et al., 2025): plain policy gradient `-A log pi`, no ratio and no clip (pair it with the gpg
    estimator)."""

    def losses(self, log_probs, old_log_probs, advantages, mask, config, generator=None):
        valid = mask.bool()
        log_ratio, advantages = _valid_inputs(log_probs, old_log_probs, advantages, valid)
        return -torch.where(valid, log_probs, 0.0) * advantages, {"ppo_kl": _token_mean(-log_ratio, valid)}


def _covariance(advantages: torch.Tensor, log_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each valid token's contribution `(A - mean A) (log pi - mean log pi)` to their covariance over the batch."""
    return (advantages - masked_mean(advantages, valid)) * (log_probs.detach() - masked_mean(log_probs.detach(), valid))


class ClipCov(PolicyLossMode):
    """Clip-Cov (Cui et al., 2025): PPO's clip, plus a random `clip_cov_ratio` of the tokens whose covariance between
    advantage and log-prob lies in (clip_cov_lb, clip_cov_ub) get no gradient, which keeps entropy from
    collapsing."""

    def losses(self, log_probs, old_log_probs, advantages, mask, config, generator=None):
        valid = mask.bool()
        log_ratio, advantages = _valid_inputs(log_probs, old_log_probs, advantages, valid)
        ratio = torch.exp(log_ratio)
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
        covariance = _covariance(advantages, log_probs, valid)
        loss = config.policy_loss
        candidates = valid & ~(clipped > unclipped) & (covariance > loss.clip_cov_lb) & (covariance < loss.clip_cov_ub)
        positions = torch.nonzero(candidates)
        count = max(int(loss.clip_cov_ratio * int(valid.sum())), 1)
        chosen = positions[torch.randperm(len(positions), generator=generator)[:count]]
        keep = torch.ones_like(valid)
        keep[chosen[:, 0], chosen[:, 1]] = False
        metrics = {"pg_clipfrac": _token_mean(~keep, valid), "ppo_kl": _token_mean(-log_ratio, valid)}
        return torch.where(keep, torch.maximum(unclipped, clipped), 0.0), metrics


class KLCov(PolicyLossMode):
    """KL-Cov (Cui et al., 2025): the unclipped surrogate, plus `ppo_kl_coef * |log r|` on the `kl_cov_ratio` of the
    tokens with the largest covariance between advantage and log-prob."""

    def losses(self, log_probs, old_log_probs, advantages, mask, config, generator=None):
        valid = mask.bool()
        log_ratio, advantages = _valid_inputs(log_probs, old_log_probs, advantages, valid)
        losses = -advantages * torch.exp(log_ratio)
        flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        if len(flat_valid):
            covariance = _covariance(advantages, log_probs, valid).reshape(-1)[flat_valid]
            count = max(1, int(len(flat_valid) * config.policy_loss.kl_cov_ratio))
            chosen = flat_valid[torch.topk(covariance, count, largest=True).indices]
            penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
            penalised[chosen] = True
            penalty = config.policy_loss.ppo_kl_coef * log_ratio.abs()
            losses = losses + torch.where(penalised.reshape(valid.shape), penalty, 0.0)
        return losses, {"ppo_kl": _token_mean(log_ratio.abs(), valid)}


POLICY_LOSS_MODES: dict[str, PolicyLossMode] = {
    "vanilla": Vanilla(),
    "gspo": GSPO(),
    "sapo": SAPO(),
    "cispo": CISPO(),
    "geo_mean": GeometricMean(),
    "gpg": GPG(),
    "clip_cov": ClipCov(),
    "kl_cov": KLCov(),
}
"""`policy_loss.loss_mode` -> the mode, keyed by loss_config.POLICY_LOSS_MODE_RULES (adding a mode: one class above, one
row here and one there)."""
