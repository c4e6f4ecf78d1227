"""The actor's loss: the policy-gradient term of the selected mode, loss aggregation, entropy bonus and entropy mask,
KL loss, TIS and the off-policy correction.

- The policy-gradient term is `policy_loss.loss_mode`'s (policy_losses.py): `vanilla` is PPO's clip (Schulman et al.,
  2017) with separate lower / upper ranges (DAPO's clip-higher, Yu et al., 2025, sets `clip_ratio_high` e.g. 0.28
  above `clip_ratio_low` 0.2) and dual-clip (Ye et al., 2020: the loss of negative-advantage tokens bounded by
  `clip_ratio_c * |A|`); GSPO, SAPO, CISPO, GMPO, GPG, Clip-Cov and KL-Cov are the others.
- Aggregation (`loss_agg_mode`, aggregation.py): verl's modes plus `token-sum`, as additive shares of the batch loss;
  GSPO, SAPO and GMPO aggregate their policy-gradient term per sequence whatever it says, as verl's do (logged once).
- Entropy mask (ms-swift `top_entropy_quantile`, Wang et al., 2025 "Beyond the 80/20 rule"): only the tokens whose
  entropy is at or above the batch quantile `1 - q` take part in the policy-gradient term.
"""

import functools
import logging

import torch

from megatron_cpo.algorithms.aggregation import LOSS_AGGREGATIONS, aggregate_loss  # noqa: F401  (the table: re-exported)
from megatron_cpo.algorithms.config import RolloutCorrectionConfig
from megatron_cpo.algorithms.kl import kl_penalty
from megatron_cpo.algorithms.loss_config import PolicyLossConfig
from megatron_cpo.algorithms.mismatch import (  # noqa: F401  (re-exported: the loss module's public surface)
    rollout_mismatch_metrics,
    truncated_importance_weights,
)
from megatron_cpo.algorithms.policy_losses import POLICY_LOSS_MODES
from megatron_cpo.algorithms.rollout_correction import rollout_correction

logger = logging.getLogger(__name__)


@functools.cache
def _announce(note: str) -> None:
    """Log `note` once per process (the first micro-batch that computes it)."""
    logger.info("%s", note)


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


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    entropy: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    correction: RolloutCorrectionConfig | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total actor loss `pg - entropy_coeff * entropy + kl_loss_coef * kl` for one micro-batch, and its metrics.

    All per-token inputs are Tensor[N, T]; `mask` is the response (loss) mask. See `aggregate_loss` for the global
    counts. `rollout_log_probs` (the engine's log-probs of the sampled tokens) adds mismatch metrics, and TIS when
    `config.tis` is set. `correction` (a resolved `algorithm.rollout_correction`, rollout_correction.py) weights the
    policy-gradient term by its importance weights and drops the tokens it rejects from it. `generator` draws the
    random choices of a mode that makes any (Clip-Cov's tokens).
    """
    mode = POLICY_LOSS_MODES[config.policy_loss.loss_mode]
    pg_losses, metrics = mode.losses(log_probs, old_log_probs, advantages, mask, config, generator)
    if rollout_log_probs is not None:
        metrics.update(rollout_mismatch_metrics(old_log_probs, rollout_log_probs, mask))
        if config.tis is not None:
            weights, tis_metrics = truncated_importance_weights(old_log_probs, rollout_log_probs, mask, config.tis)
            pg_losses = mode.weighted(pg_losses, weights, mask)
            metrics.update(tis_metrics)
    elif config.tis is not None or correction is not None:
        raise ValueError("tis / rollout_correction is enabled but rollout_log_probs is None; pass the engine's "
                         "log-probs or switch the correction off")
    pg_mask = mask.bool()
    if correction is not None:
        corrected = rollout_correction(old_log_probs, rollout_log_probs, mask, correction)
        pg_losses = mode.weighted(pg_losses, corrected.weights, mask)
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
    if note := config.aggregation_note():
        _announce(note)
    pg_loss = aggregate_loss(pg_losses, pg_mask, config.policy_aggregation, global_tokens, global_seqs)
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
