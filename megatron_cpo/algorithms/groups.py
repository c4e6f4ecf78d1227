"""Per-group statistics over a flat batch, vectorised with scatter reductions.

A batch of N responses is split into prompt groups by `group: LongTensor[N]` holding indices 0..G-1 (the controller
maps prompt uids to these ints). Every function here returns one value per group index `0..G-1`; an index that no
response uses has count 0 and its statistics are 0. No Python loop runs over samples or groups.
"""
import torch


def check_group(group: torch.Tensor, n: int) -> None:
    """Raise a clear error unless `group` is a 1-D integer tensor of length n with non-negative entries."""
    if group.dim() != 1 or group.shape[0] != n:
        raise ValueError(f"group has shape {tuple(group.shape)}; expected one group index per response, shape ({n},)")
    if group.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"group has dtype {group.dtype}; map prompt uids to integer indices 0..G-1 (torch.long)")
    if n > 0 and int(group.min()) < 0:
        raise ValueError(f"group holds the negative index {int(group.min())}; group indices must be 0..G-1")


def num_groups(group: torch.Tensor) -> int:
    """Number of group slots G = max index + 1 (0 for an empty batch)."""
    return int(group.max()) + 1 if group.numel() else 0


def group_count(group: torch.Tensor) -> torch.Tensor:
    """Responses per group, LongTensor[G]."""
    return torch.bincount(group.long(), minlength=num_groups(group))


def group_sum(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Sum of `values[N]` within each group, Tensor[G]."""
    out = torch.zeros(num_groups(group), dtype=values.dtype, device=values.device)
    return out.index_add_(0, group.long(), values)


def group_mean(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Mean of `values[N]` within each group, Tensor[G] (0 for an unused index)."""
    count = group_count(group).to(values.dtype)
    return group_sum(values, group) / count.clamp(min=1)


def group_std(values: torch.Tensor, group: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """Standard deviation of `values[N]` within each group, Tensor[G].

    `unbiased=True` divides by n-1 like `torch.std` (what verl's GRPO uses); a group of one then has std 0.
    `unbiased=False` divides by n like `np.std` (what DAPO's filter-groups statistics use).
    """
    count = group_count(group).to(values.dtype)
    centred = values - group_mean(values, group)[group]
    sq = group_sum(centred * centred, group)
    denom = (count - 1) if unbiased else count
    return torch.sqrt(sq / denom.clamp(min=1))


def group_max(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Maximum of `values[N]` within each group, Tensor[G] (-inf for an unused index)."""
    out = torch.full((num_groups(group),), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, group.long(), values, reduce="amax", include_self=True)


def group_min(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Minimum of `values[N]` within each group, Tensor[G] (+inf for an unused index)."""
    out = torch.full((num_groups(group),), float("inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, group.long(), values, reduce="amin", include_self=True)
