"""KL estimators between the policy and a reference, per token, and the in-reward KL penalty.

Names and numerics follow verl's `kl_penalty` (`k1`/`kl`, `abs`, `k2`/`mse`, `k3`/`low_var_kl`; a trailing `+` is
the straight-through variant with k2's gradient). `k3` is clamped to [0, 10], not verl's [-10, 10]; docs/algorithms.md,
"KL estimators".
"""
from collections.abc import Callable

import torch

from megatron_cpo.algorithms.config import KL_ESTIMATOR_KINDS, check_kl_kind
from megatron_cpo.algorithms.masked import masked_select_zero, masked_sum

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs


def _abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - ref_log_probs).abs()


def _k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()


def _k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(ref_log_probs - log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.expm1(log_ratio) - log_ratio, 0.0, K3_CLAMP)


_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _k1, "abs": _abs, "k2": _k2, "k3": _k3}
KL_ESTIMATORS = {name: _ESTIMATORS[estimator] for name, estimator in KL_ESTIMATOR_KINDS.items()}
"""Every accepted name (config.py `KL_ESTIMATOR_KINDS`: verl's, with its aliases) -> its estimator."""


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference, same shape as the inputs."""
    check_kl_kind(kind)
    base = kind.removesuffix("+")
    forward = KL_ESTIMATORS[base](log_probs, ref_log_probs)
    if not kind.endswith("+") or base in ("k2", "mse"):
        return forward
    backward = _k2(log_probs, ref_log_probs)
    return backward - backward.detach() + forward.detach()


def kl_in_reward(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract `coef * KL` from the token-level scores (verl's `use_kl_in_reward`); returns rewards and metrics.

    The rewards are computed without gradient: the penalty shapes the return, it is not a loss term.
    """
    with torch.no_grad():
        kl = masked_select_zero(kl_penalty(log_probs, ref_log_probs, kind), mask)
        rewards = token_level_scores - coef * kl
        seq_kl = masked_sum(kl, mask, -1) / mask.sum(-1).clamp(min=1)
    return rewards, {"actor/reward_kl_penalty": float(seq_kl.mean()), "actor/reward_kl_penalty_coeff": float(coef)}
