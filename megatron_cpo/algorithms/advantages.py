"""The advantage estimators under verl's names (`algorithm.adv_estimator`): one function and one row each.

Every estimator reads the same `AdvantageInputs` (token rewards, response mask, prompt groups) and returns
`(advantages, returns)`, Tensor[N, T], 0 where the mask is 0; vectorised by group (groups.py) and reverse scan
(returns.py). Each equals verl's `core_algos` (tests/algorithms/test_estimators_vs_verl.py); formulas, groups of one
and when to use each: docs/algorithms.md.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_cpo.algorithms.groups import check_group, group_count, group_max, group_mean, group_std, group_sum
from megatron_cpo.algorithms.masked import masked_select_zero
from megatron_cpo.algorithms.returns import discounted_returns, generalized_advantages, masked_whiten, reward_to_go

GRPO_EPS = 1e-6


@dataclass
class AdvantageInputs:
    """What an estimator reads. token_rewards, mask: [N, T]; group: LongTensor[N] of prompt indices 0..G-1.
    gamma / lam: `algorithm.gamma` / `algorithm.lam` (GAE, REINFORCE++). norm_by_std: `norm_adv_by_std_in_grpo`.
    values: the critic's value of every response token [N, T] (GAE). reward_baselines: the score of each response's
    prompt answered greedily [N] (ReMax)."""
    token_rewards: torch.Tensor
    mask: torch.Tensor
    group: torch.Tensor
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    values: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.token_rewards.dim() != 2 or self.mask.shape != self.token_rewards.shape:
            raise ValueError(f"token_rewards {tuple(self.token_rewards.shape)} and mask {tuple(self.mask.shape)} "
                             "must both be [N, T]")
        check_group(self.group, self.token_rewards.shape[0])

    @property
    def scores(self) -> torch.Tensor:
        """Each response's outcome score, float64 [N]: its token rewards summed (as verl's outcome estimators)."""
        return self.token_rewards.double().sum(-1)

    def broadcast(self, per_response: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A per-response advantage over its tokens (0 off the mask), in the rewards' dtype, as (advantages,
        returns)."""
        tokens = per_response[:, None].expand_as(self.mask).to(self.token_rewards.dtype)
        advantages = masked_select_zero(tokens, self.mask)
        return advantages, advantages


def _baseline_mean(scores: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Each response's group mean [N]; 0 for a response alone in its group (verl's lone-response baseline)."""
    alone = group_count(group)[group] < 2
    return torch.where(alone, torch.zeros_like(scores), group_mean(scores, group)[group])


def grpo_scalar_advantages(scores: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True,
                           eps: float = GRPO_EPS) -> torch.Tensor:
    """GRPO (Shao et al., 2024): `(r - mean_g) / (std_g + eps)` with the unbiased std; Dr.GRPO (Liu et al., 2025,
    `norm_by_std=False`) drops the division. A lone response: mean 0, std 1. Tensor[N] in the scores' dtype."""
    if scores.dim() != 1:
        raise ValueError(f"scores has shape {tuple(scores.shape)}; pass one scalar score per response, shape (N,)")
    check_group(group, scores.shape[0])
    values = scores.double()
    centred = values - _baseline_mean(values, group)
    if norm_by_std:
        alone = group_count(group)[group] < 2
        std = torch.where(alone, torch.ones_like(values), group_std(values, group, unbiased=True)[group])
        centred = centred / (std + eps)
    return centred.to(scores.dtype if scores.is_floating_point() else torch.float32)


def grpo_advantages(scores: torch.Tensor, group: torch.Tensor, response_mask: torch.Tensor, norm_by_std: bool = True,
                    eps: float = GRPO_EPS) -> torch.Tensor:
    """GRPO / Dr.GRPO advantages broadcast over the response tokens, Tensor[N, T] (0 on padding)."""
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}; expected ({scores.shape[0]}, T) to "
                         "match scores")
    per_response = grpo_scalar_advantages(scores, group, norm_by_std=norm_by_std, eps=eps)
    return masked_select_zero(per_response[:, None].expand(-1, response_mask.shape[1]), response_mask)


def grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO and Dr.GRPO (`norm_adv_by_std_in_grpo=False`)."""
    return inputs.broadcast(grpo_scalar_advantages(inputs.scores, inputs.group, inputs.norm_by_std))


def grpo_passk(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Chen et al., 2025): only each group's best response is pushed, by `r_max - r_second`
    (divided by the group's std + eps with `norm_adv_by_std_in_grpo`); every other response gets 0. Ties push
    nothing (the difference is 0)."""
    scores, group = inputs.scores, inputs.group
    counts = group_count(group)
    if bool((counts[group] < 2).any()):
        raise ValueError("grpo_passk compares each group's best response with its second best: every prompt needs "
                         "at least 2 responses (actor_rollout_ref.rollout.n >= 2)")
    best = group_max(scores, group)
    index = torch.arange(len(scores))
    at_best = scores == best[group]
    first_best = torch.full_like(best, len(scores), dtype=torch.long).scatter_reduce(
        0, group, torch.where(at_best, index, len(scores)), reduce="amin")
    is_first_best = index == first_best[group]
    second = group_max(torch.where(is_first_best, float("-inf"), scores), group)
    gap = best - second
    if inputs.norm_by_std:
        gap = gap / (group_std(scores, group, unbiased=True) + GRPO_EPS)
    return inputs.broadcast(torch.where(is_first_best, gap[group], torch.zeros_like(scores)))


def rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al., 2024): each response against the mean of the others, `r_i - mean_{j != i} r_j =
    n / (n - 1) * (r_i - mean_g)`; a lone response keeps its score."""
    scores, group = inputs.scores, inputs.group
    n = group_count(group)[group].to(scores.dtype)
    leave_one_out = n / (n - 1).clamp(min=1) * (scores - group_mean(scores, group)[group])
    return inputs.broadcast(torch.where(n > 1, leave_one_out, scores))


def opo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al., 2025): the baseline is the group's length-weighted mean score `sum_j |y_j| r_j / sum_j |y_j|`
    (the optimal baseline of on-policy training with sequence-summed losses); a lone response's is 0."""
    scores, group = inputs.scores, inputs.group
    lengths = inputs.mask.double().sum(-1)
    weighted = group_sum(lengths * scores, group) / group_sum(lengths, group).clamp(min=1e-12)
    alone = group_count(group)[group] < 2
    return inputs.broadcast(scores - torch.where(alone, torch.zeros_like(scores), weighted[group]))


def gpg(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al., 2025): `alpha * (r - mean_g)` with `alpha = N / (responses with a non-zero score)`, which
    rescales the batch's gradient for the groups that carry none (verl's f_norm = 1)."""
    scores, group = inputs.scores, inputs.group
    alpha = len(scores) / max(int(torch.count_nonzero(scores)), 1)
    return inputs.broadcast(alpha * (scores - _baseline_mean(scores, group)))


def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a baseline (Hu, 2025): the score minus its group's mean, then whitened over every response
    token of the batch (global normalisation instead of GRPO's per-group std)."""
    centred, _ = inputs.broadcast(inputs.scores - _baseline_mean(inputs.scores, inputs.group))
    advantages = masked_whiten(centred.double(), inputs.mask).to(inputs.token_rewards.dtype)
    return advantages, advantages


def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): the discounted return of each token (`algorithm.gamma`), whitened over the batch;
    no group, no critic. Returns the raw returns too."""
    returns = discounted_returns(inputs.token_rewards.double(), inputs.mask.double(), inputs.gamma)
    dtype = inputs.token_rewards.dtype
    return masked_whiten(returns, inputs.mask).to(dtype), masked_select_zero(returns, inputs.mask).to(dtype)


def remax(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., 2024): the reward-to-go minus the score of the prompt's greedy answer, which the same
    engines generate with the batch and the same reward grades (not trained on)."""
    if inputs.reward_baselines is None:
        raise ValueError("remax needs the greedy answers' scores (reward_baselines, one per response): the "
                         "controller generates them when algorithm.adv_estimator=remax")
    returns = reward_to_go(inputs.token_rewards.double(), inputs.mask)
    advantages = returns - inputs.reward_baselines.double()[:, None]
    dtype = inputs.token_rewards.dtype
    return masked_select_zero(advantages, inputs.mask).to(dtype), returns.to(dtype)


def gae(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE (Schulman et al., 2016) from the critic's values with `algorithm.gamma` / `algorithm.lam`, the
    advantages whitened over the batch; returns `A + V` are the critic's targets."""
    if inputs.values is None:
        raise ValueError("gae needs the critic's values of every response token (values=[N, T])")
    advantages, returns = generalized_advantages(inputs.token_rewards.double(), inputs.values.double(),
                                                 inputs.mask.double(), inputs.gamma, inputs.lam)
    dtype = inputs.token_rewards.dtype
    return masked_whiten(advantages, inputs.mask).to(dtype), returns.to(dtype)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]] = {
    "grpo": grpo,
    "grpo_passk": grpo_passk,
    "rloo": rloo,
    "opo": opo,
    "gpg": gpg,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
    "reinforce_plus_plus": reinforce_plus_plus,
    "remax": remax,
    "gae": gae,
}
"""`algorithm.adv_estimator` -> its function, keyed by config.ADVANTAGE_ESTIMATOR_NEEDS (which says what each needs;
adding an estimator: one function above, one row here and one there)."""
