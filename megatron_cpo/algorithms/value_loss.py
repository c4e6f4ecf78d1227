"""PPO's critic: its clipped value loss and verl's value metrics, pure tensor math over response-aligned [N, T] tensors.

verl's `compute_value_loss`: the larger of the clipped and unclipped squared errors, as additive shares of the
mini-batch's global counts so the result does not depend on the micro-batch split (docs/algorithms.md).
"""
from __future__ import annotations

import torch

from megatron_cpo.algorithms.aggregation import aggregate_loss
from megatron_cpo.algorithms.masked import masked_sum

EXPLAINED_VARIANCE_EPS = 1e-5


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, loss_agg_mode: str, global_tokens: float | None = None,
               global_seqs: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss of one micro-batch and its metrics, verl's names: `vf_loss` (the loss), `vf_clipfrac`
    (the share of tokens whose clipped error is the larger) and `vpred_mean` (the mean new value), each a share of
    the mini-batch's when the global counts are given (else this micro-batch's own value)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped_error, clipped_error), mask, loss_agg_mode, global_tokens,
                                global_seqs)
    tokens = global_tokens if global_tokens is not None else mask.sum().clamp(min=1)
    weights = mask.to(values.dtype)
    metrics = {"vf_loss": loss.detach(),
               "vf_clipfrac": masked_sum((clipped_error > unclipped_error).to(values.dtype), weights) / tokens,
               "vpred_mean": masked_sum(values.detach(), weights) / tokens}
    return loss, metrics


def value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's batch metrics of a critic: `critic/values/{mean,max,min}`, `critic/returns/{mean,max,min}` over the
    response tokens, and `critic/vf_explained_var` = 1 - Var(R - V) / (Var(R) + 1e-5) (unbiased variances): 1 when
    the values predict the returns, 0 when they explain none of their spread."""
    valid = mask.bool()
    kept_values, kept_returns = values[valid].double(), returns[valid].double()
    metrics: dict[str, float] = {}
    for name, kept in (("values", kept_values), ("returns", kept_returns)):
        if kept.numel():
            metrics.update({f"critic/{name}/mean": float(kept.mean()), f"critic/{name}/max": float(kept.max()),
                            f"critic/{name}/min": float(kept.min())})
    if kept_values.numel() > 1:
        explained = 1 - (kept_returns - kept_values).var() / (kept_returns.var() + EXPLAINED_VARIANCE_EPS)
        metrics["critic/vf_explained_var"] = float(explained)
    return metrics
