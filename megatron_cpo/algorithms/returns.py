"""Token-level return math the estimators share: a reverse linear scan, discounted returns, GAE, masked whitening.

Every recurrence is `x_t = b_t + a_t * x_{t+1}`, solved for all positions at once by recursive doubling (no loop per
token, no division that can overflow). Returns and advantages are 0 where verl's mask is 0 (padding, observations).
"""
import torch

from megatron_cpo.algorithms.masked import masked_select_zero

WHITEN_EPS = 1e-8


def reverse_linear_scan(coefficients: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """x [N, T] with `x_t = inputs_t + coefficients_t * x_{t+1}` and x_T = 0, for every row at once."""
    a, b = coefficients, inputs
    width, offset = b.shape[-1], 1
    while offset < width:
        b = b + a * torch.nn.functional.pad(b[:, offset:], (0, offset))
        a = a * torch.nn.functional.pad(a[:, offset:], (0, offset))
        offset *= 2
    return b


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`(values - mean) / sqrt(var + 1e-8)` over the batch's masked positions (unbiased variance), as verl's
    `masked_whiten`; 0 where the mask is 0. With fewer than two valid positions there is no spread to divide by:
    the values are only centred (verl raises there)."""
    valid = mask.bool()
    count = valid.sum()
    mean = masked_select_zero(values, valid).sum() / count.clamp(min=1)
    centred = values - mean
    variance = masked_select_zero(centred.square(), valid).sum() / (count - 1).clamp(min=1)
    scale = torch.rsqrt(variance + WHITEN_EPS) if int(count) > 1 else torch.ones_like(variance)
    return masked_select_zero(centred * scale, valid)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE++'s returns, verl's recurrence: `R_t = r_t + gamma * m_{t+1} * R_{t+1}`: a masked position ends the
    discounted sum before it (a multi-turn observation cuts the return off, as verl resets after each EOS)."""
    next_mask = torch.nn.functional.pad(mask[:, 1:], (0, 1))
    return reverse_linear_scan(gamma * next_mask, token_rewards)


def reward_to_go(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ReMax's returns: the undiscounted sum of the masked rewards from each position to the end."""
    rewards = masked_select_zero(token_rewards, mask)
    return rewards.flip(-1).cumsum(-1).flip(-1)


def generalized_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                           lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al., 2016) over the masked positions, as verl's `compute_gae_advantage_return`: the TD error
    `delta_t = r_t + gamma * V_next - V_t` with V_next the value of the next masked-in position, and
    `A_t = delta_t + gamma * lam * A_next`; masked-out positions are skipped (their rewards too), not reset.
    Returns the raw advantages and the returns `A + V` (the critic's targets), both 0 where the mask is 0."""
    m = mask.to(values.dtype)
    kept_values = reverse_linear_scan(1.0 - m, m * values)  # the value at the next masked-in position, from t on
    next_values = torch.nn.functional.pad(kept_values[:, 1:], (0, 1))
    deltas = token_rewards + gamma * next_values - values
    advantages = reverse_linear_scan(m * gamma * lam + (1.0 - m), m * deltas)
    return masked_select_zero(advantages, mask), masked_select_zero(advantages + values, mask)
