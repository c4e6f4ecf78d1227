"""Group-relative advantages (GRPO, Dr.GRPO) by prompt group, broadcast over response tokens.

GRPO (Shao et al., 2024) scores each response against the other responses to the same prompt:
`A_i = (r_i - mean_g) / (std_g + eps)` with the unbiased std and eps = 1e-6, as verl's `compute_grpo_outcome_advantage`.
Dr.GRPO (Liu et al., 2025) drops the std division (`norm_by_std=False`, verl's `norm_adv_by_std_in_grpo=False`).

One deliberate difference from verl: a prompt with a single response has no peer to compare with, so its advantage is
0 here (verl passes its raw score through). A lone sample carries no relative signal and should not be pushed.
"""
import torch

from megatron_cpo.algorithms.groups import check_group, group_count, group_mean, group_std
from megatron_cpo.algorithms.masked import masked_select_zero


def grpo_scalar_advantages(
    scores: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-response group-relative advantage, Tensor[N]; responses alone in their group get 0."""
    if scores.dim() != 1:
        raise ValueError(f"scores has shape {tuple(scores.shape)}; pass one scalar score per response, shape (N,)")
    check_group(group, scores.shape[0])
    values = scores.float()
    centred = values - group_mean(values, group)[group]
    if norm_by_std:
        centred = centred / (group_std(values, group, unbiased=True)[group] + eps)
    alone = group_count(group)[group] < 2
    return torch.where(alone, torch.zeros_like(centred), centred)


def grpo_advantages(
    scores: torch.Tensor,
    group: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO / Dr.GRPO advantages broadcast over tokens, Tensor[N, T] (0 on padding).

    scores: one outcome score per response (e.g. the sum of the sparse token-level scores), Tensor[N].
    group: prompt group index of each response, LongTensor[N] with values 0..G-1.
    response_mask: 1 on real response tokens, Tensor[N, T].
    norm_by_std: divide by the group's std (GRPO) or not (Dr.GRPO).
    """
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"response_mask has shape {tuple(response_mask.shape)}; expected ({scores.shape[0]}, T) to match scores"
        )
    per_response = grpo_scalar_advantages(scores, group, norm_by_std=norm_by_std, eps=eps)
    return masked_select_zero(per_response[:, None].expand(-1, response_mask.shape[1]), response_mask)
