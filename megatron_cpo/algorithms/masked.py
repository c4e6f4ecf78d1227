"""Masked reductions that ignore whatever padded positions hold (NaN and inf included).

Multiplying by the mask is not enough: `nan * 0` is nan, so one NaN or inf left on a padded position (a stale
log-prob, an advantage of an empty response) would poison the whole sum. These select with `torch.where` first, as
verl's `masked_sum` does, and then weight by the mask (a 0/1 mask or a bool; fractional weights are kept).
The backward pass of the select sends zero gradient to padded positions.
"""

import torch


def masked_select_zero(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values * mask` on valid positions and exactly 0 on padding (mask 0), whatever `values` holds there."""
    valid = mask.bool()
    weighted = values if mask.dtype == torch.bool else values * mask.to(values.dtype)
    return torch.where(valid, weighted, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` over the positions where `mask` is non-zero (over `dim`, or everything when None)."""
    selected = masked_select_zero(values, mask)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is non-zero; 0 where there is none (count clamped to 1)."""
    count = masked_sum(torch.ones_like(values), mask, dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)
