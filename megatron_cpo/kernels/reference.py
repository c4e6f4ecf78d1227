"""Plain-torch references that materialise the float32 logits: what the fused paths replace (used by benchmarks).

Single-rank only; the tests keep their own float64 reference for correctness.
"""
from __future__ import annotations

import torch


def materialized_log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                                      ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax`` over a float32 copy of all logits (float64 ones stay float64), then gather and
    ``-sum p log p`` (autograd by torch)."""
    log_p = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    ignored = targets == ignore_index
    picked = log_p.gather(-1, targets.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return picked.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0)


def materialized_linear_log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                             temperature: float = 1.0,
                                             ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """The lm-head matmul in the input dtype followed by ``materialized_log_probs_and_entropy``."""
    return materialized_log_probs_and_entropy(hidden @ weight.T, targets, temperature, ignore_index)
