"""Rollout-engine vs trainer log-prob mismatch: metrics (also split by staleness) and truncated importance sampling
(TIS): the policy-gradient term re-weighted by `pi_trainer / pi_rollout`, truncated at C, per token or per sequence.
Why and the paper: docs/async.md, "The off-policy correction".
"""
import torch

from megatron_cpo.algorithms.kl import LOG_RATIO_CLAMP
from megatron_cpo.algorithms.loss_config import TISConfig
from megatron_cpo.algorithms.masked import masked_mean, masked_select_zero


def rollout_mismatch_metrics(
    trainer_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the trainer's on the sampled response tokens.

    Reports the mean and max absolute difference of the probabilities (verl's `rollout_probs_diff`), of the log-probs,
    and the k3 estimate of KL(rollout || trainer) from the samples.
    """
    with torch.no_grad():
        mask = mask.to(trainer_log_probs.dtype)
        valid = mask > 0
        log_ratio = torch.clamp(trainer_log_probs - rollout_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        prob_diff = (trainer_log_probs.exp() - rollout_log_probs.exp()).abs()
        log_prob_diff = log_ratio.abs()
        k3 = (torch.expm1(log_ratio) - log_ratio).clamp(min=0.0)  # >= 0: no rounding below 0 near log-ratio 0
        has_tokens = bool(valid.any())
        return {
            "mismatch/probs_diff_mean": float(masked_mean(prob_diff, mask)),
            "mismatch/probs_diff_max": float(prob_diff[valid].max()) if has_tokens else 0.0,
            "mismatch/log_probs_diff_mean": float(masked_mean(log_prob_diff, mask)),
            "mismatch/log_probs_diff_max": float(log_prob_diff[valid].max()) if has_tokens else 0.0,
            "mismatch/k3_kl": float(masked_mean(k3, mask)),
        }


def truncated_importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    config: TISConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached TIS weights `min(pi_trainer / pi_rollout, C)`, Tensor[N, T] (1 on padding), and their metrics."""
    with torch.no_grad():
        mask_f = mask.to(old_log_probs.dtype)
        log_ratio = masked_select_zero(old_log_probs - rollout_log_probs, mask_f)
        if config.level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old_log_probs)
        ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weights = torch.where(mask_f > 0, ratio.clamp(max=config.threshold), torch.ones_like(ratio))
        metrics = {
            "tis/weight_mean": float(masked_mean(weights, mask_f)),
            "tis/truncated_frac": float(masked_mean((ratio > config.threshold).to(mask_f.dtype), mask_f)),
        }
    return weights, metrics


def mismatch_by_staleness(
    trainer_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor
) -> dict[str, float]:
    """`rollout_mismatch_metrics` of the tokens of each staleness (policy versions between the weights that sampled
    a token and the trainer's), as `mismatch/staleness_<s>/<metric>`, and each staleness's token fraction as
    `mismatch/staleness_<s>/token_frac`. Staleness 0 is the engine-vs-trainer difference of the same weights alone;
    above it, the policy's change since the token was sampled adds to it."""
    valid = mask.bool()
    metrics: dict[str, float] = {}
    total = max(int(valid.sum()), 1)
    for value in torch.unique(staleness[valid]).tolist():
        selected = valid & (staleness == value)
        prefix = f"mismatch/staleness_{int(value)}/"
        for key, number in rollout_mismatch_metrics(trainer_log_probs, rollout_log_probs, selected).items():
            metrics[prefix + key.removeprefix("mismatch/")] = number
        metrics[prefix + "token_frac"] = int(selected.sum()) / total
    return metrics
