"""Which prompt groups to train on: DAPO filter-groups, RAGEN's strategies, filter loss scaling.

- DAPO dynamic sampling (Yu et al., 2025): a group whose responses all got the same metric value gives GRPO nothing
  to compare, so only groups with std > 0 are kept (a group of one is kept: it cannot be judged).
- RAGEN (Wang et al., 2025) ranks groups by a score, the in-group reward std by default (high variance = the prompt
  is at the edge of the model's ability), and keeps the best by `top_p`, `top_k` or `min_p`. Keeping few groups
  raises gradient variance; `filter_loss_scaling` shrinks the advantages by the kept ratio (or its square root).

Every filter keeps or drops whole groups and returns a `GroupFilterResult`. Group indices are 0..G-1 (see groups.py).
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_cpo.algorithms.groups import (
    check_group,
    group_count,
    group_max,
    group_mean,
    group_min,
    group_std,
    group_sum,
)


@dataclass
class GroupFilterResult:
    """keep: BoolTensor[N], true on every response of a kept group. metrics: kept / filtered (groups),
    filter_rate (filtered / present groups), mean_std (mean in-group std of the filtered-on values), kept_ratio."""

    keep: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def _result(
    keep_group: torch.Tensor, present: torch.Tensor, group: torch.Tensor, std: torch.Tensor
) -> GroupFilterResult:
    total = int(present.sum())
    kept = int((keep_group & present).sum())
    return GroupFilterResult(
        keep=keep_group[group],
        metrics={
            "kept": float(kept),
            "filtered": float(total - kept),
            "filter_rate": (total - kept) / total if total else 0.0,
            "kept_ratio": kept / total if total else 0.0,
            "mean_std": float(std[present].mean()) if total else 0.0,
        },
    )


def filter_groups(metric: torch.Tensor, group: torch.Tensor) -> GroupFilterResult:
    """DAPO filter-groups: keep the groups whose metric varies (std > 0) and the groups of one response.

    "Varies" is tested exactly (max != min) so that rounding cannot keep a constant group; `mean_std` uses the
    population std like DAPO's `np.std`.
    """
    if metric.dim() != 1:
        raise ValueError(f"metric has shape {tuple(metric.shape)}; pass one value per response, shape (N,)")
    check_group(group, metric.shape[0])
    values = metric.float()
    count = group_count(group)
    keep_group = (group_max(values, group) > group_min(values, group)) | (count == 1)
    return _result(keep_group, count > 0, group, group_std(values, group, unbiased=False))


ZERO_SCORE_TOL = 1e-10
"""A group score with |score| <= this counts as zero (RAGEN's `include_zero` test); a constant group's std is 0."""
MIN_P_TOL = 1e-10


def _ranked_order(scores: torch.Tensor, candidate: torch.Tensor, largest: bool) -> torch.Tensor:
    """Group indices best-first (high scores first for `largest`, low first otherwise), candidates before the rest,
    ties in group order."""
    key = scores if largest else -scores
    return torch.sort(key.masked_fill(~candidate, float("-inf")), descending=True, stable=True).indices


def _top_p_softmax(scores, candidate, config, num_groups):
    """Smallest best-first prefix whose softmax mass reaches `value` (RAGEN: `searchsorted(cumsum, value) + 1`)."""
    logits = scores if config.rollout_filter_type == "largest" else -scores
    probs = torch.softmax(logits.double().masked_fill(~candidate, float("-inf")), dim=0)
    order = _ranked_order(scores, candidate, config.rollout_filter_type == "largest")
    cumulative = torch.cumsum(probs[order], dim=0)
    cutoff = int(torch.searchsorted(cumulative, torch.tensor([config.rollout_filter_value], dtype=cumulative.dtype)))
    count = min(cutoff + 1, int(candidate.sum()))
    return _first(order, count, candidate)


def _top_p_linear(scores, candidate, config, num_groups):
    """RAGEN's linear top-p: walk the groups best-first adding their scores until the sum reaches
    `value * (sum of the candidates' scores) - selection_eps`; stop early at a score <= 0; keep the prefix only if
    the sum was reached, else nothing."""
    order = _ranked_order(scores, candidate, config.rollout_filter_type == "largest")
    ranked = scores.double()[order][: int(candidate.sum())]
    total = float(scores.double()[candidate].sum())
    threshold = config.rollout_filter_value * total - config.rollout_filter_selection_eps
    positive_prefix = torch.cumprod((ranked > 0).long(), dim=0).bool()
    before = torch.cumsum(ranked, dim=0) - ranked
    taken = positive_prefix & (before < threshold)
    if float(ranked[taken].sum()) < threshold:
        return torch.zeros_like(candidate)
    return _first(order, int(taken.sum()), candidate)


def _top_p(scores, candidate, config, num_groups):
    if config.rollout_filter_value >= 1.0:  # every candidate, exactly (a peaked softmax must not drop the tail)
        return candidate.clone()
    mode = _top_p_softmax if config.rollout_filter_top_p_prob_mode == "softmax" else _top_p_linear
    return mode(scores, candidate, config, num_groups)


def _top_k(scores, candidate, config, num_groups):
    """The k best groups, k = int(value * groups) for a fraction value < 1 (RAGEN's `top_k`), else int(value)
    (RAGEN's `top_k_abs`); at least one, at most the candidates."""
    value = config.rollout_filter_value
    k = int(value * num_groups) if value < 1 else int(value)
    k = max(min(k, int(candidate.sum())), 1)
    return _first(_ranked_order(scores, candidate, config.rollout_filter_type == "largest"), k, candidate)


def _min_p(scores, candidate, config, num_groups):
    """largest: score >= value * best; smallest: score <= best / value (RAGEN's thresholds, with its 1e-10 slack).
    The best group itself is always kept: with a negative best score the threshold lies beyond it (value * best >
    best) and RAGEN would keep nothing (docs/filters.md)."""
    values = scores.double()
    if config.rollout_filter_type == "largest":
        best = values.masked_fill(~candidate, float("-inf")).max()
        chosen = values >= best * config.rollout_filter_value - MIN_P_TOL
    else:
        best = values.masked_fill(~candidate, float("inf")).min()
        chosen = values <= best / (config.rollout_filter_value + MIN_P_TOL) + MIN_P_TOL
    return (chosen | (values == best)) & candidate


def _first(order: torch.Tensor, count: int, candidate: torch.Tensor) -> torch.Tensor:
    chosen = torch.zeros_like(candidate)
    chosen[order[:count]] = True
    return chosen & candidate


def _group_std_exact(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Unbiased in-group std (RAGEN's `std(dim=-1)`), exactly 0 for a constant group (max == min, as filter_groups
    tests it) so that rounding can neither keep it under include_zero=false nor rank it above another group."""
    constant = group_max(values, group) == group_min(values, group)
    return torch.where(constant, 0.0, group_std(values, group, unbiased=True))


RAGEN_STRATEGIES: dict[str, Callable] = {
    "top_p": _top_p,
    "top_k": _top_k,
    "min_p": _min_p,
}
GROUP_SCORES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "std": _group_std_exact,
    "mean": group_mean,
    "sum": group_sum,
    "length": group_mean,  # mean response length: the filter is given lengths instead of rewards
}
TOP_P_PROB_MODES = ("linear", "softmax")


RAGEN_FILTER_METRICS = {"reward_std": "std", "reward_variance": "std", "reward_mean": "mean", "reward": "mean",
                        "reward_sum": "sum", "length": "length"}
"""`rollout_filter_metric` (RAGEN's names) -> the group score of `GROUP_SCORES` (RAGEN's `reward_variance` is its
in-group std)."""


@dataclass
class RolloutFilterConfig:
    """RAGEN's rollout filter under RAGEN's names (keys of `actor_rollout_ref.rollout`, whose config extends this
    class; the option mapping is in docs/filters.md). Within every generation batch of `data.train_batch_size`
    prompts, rank the groups by `rollout_filter_metric` and keep those that `rollout_filter_strategy` selects.

    rollout_filter_strategy: `none` (the default) turns the filter off; `top_p` (value >= 1 keeps every candidate;
    else by `rollout_filter_top_p_prob_mode`: `linear` (RAGEN's default) keeps the best groups until their scores sum
    to `value` of the total (minus `rollout_filter_selection_eps`), `softmax` the smallest set whose softmax mass
    reaches `value`), `top_k` (`value` < 1: that fraction of the groups, else the `value` best groups; at least one)
    or `min_p` (score >= value * best; `smallest`: score <= best / value).
    rollout_filter_type: `largest` ranks high scores first, `smallest` low ones.
    rollout_filter_include_zero: whether groups whose score is 0 (|score| <= 1e-10; a constant group's std is
    exactly 0) may be kept.
    rollout_filter_metric: `reward_std` (= RAGEN's `reward_variance`, the in-group reward std), `reward_mean`
    (`reward`), `reward_sum` or `length` (mean response length; `ragen_filter` is then given the lengths).
    Groups accumulate until `data.train_batch_size` are kept, bounded by `algorithm.filter_groups.max_num_gen_batches`
    / `on_limit` like DAPO's filter (see docs/filters.md).
    """

    rollout_filter_strategy: str = "none"
    rollout_filter_value: float = 1.0
    rollout_filter_type: str = "largest"
    rollout_filter_include_zero: bool = True
    rollout_filter_metric: str = "reward_std"
    rollout_filter_top_p_prob_mode: str = "linear"
    rollout_filter_selection_eps: float = 0.01

    @property
    def rollout_filter_enabled(self) -> bool:
        return self.rollout_filter_strategy != "none"

    @property
    def group_score(self) -> str:
        """The `GROUP_SCORES` entry `rollout_filter_metric` names."""
        return RAGEN_FILTER_METRICS[self.rollout_filter_metric]

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout."
        strategy, value = self.rollout_filter_strategy, self.rollout_filter_value
        if strategy != "none" and strategy not in RAGEN_STRATEGIES:
            raise ValueError(f"{prefix}rollout_filter_strategy={strategy!r} is not supported; choose one of "
                             f"{', '.join(map(repr, ['none', *RAGEN_STRATEGIES]))}")
        if self.rollout_filter_type not in ("largest", "smallest"):
            raise ValueError(f"{prefix}rollout_filter_type={self.rollout_filter_type!r} is not supported; choose "
                             "one of 'largest', 'smallest'")
        if self.rollout_filter_metric not in RAGEN_FILTER_METRICS:
            raise ValueError(f"{prefix}rollout_filter_metric={self.rollout_filter_metric!r} is not supported; choose "
                             f"one of {', '.join(map(repr, RAGEN_FILTER_METRICS))} (RAGEN's 'entropy' metrics need a "
                             "trainer forward pass on every generated group and are not offered)")
        if self.rollout_filter_top_p_prob_mode not in TOP_P_PROB_MODES:
            raise ValueError(f"{prefix}rollout_filter_top_p_prob_mode={self.rollout_filter_top_p_prob_mode!r} is not "
                             f"supported; choose one of {', '.join(map(repr, TOP_P_PROB_MODES))}")
        if self.rollout_filter_selection_eps < 0:
            raise ValueError(f"{prefix}rollout_filter_selection_eps={self.rollout_filter_selection_eps} must be >= 0 "
                             "(RAGEN: 0.01)")
        if strategy == "top_p" and not 0.0 < value <= 1.0:
            raise ValueError(f"{prefix}rollout_filter_value={value} must be in (0, 1] for top_p (the probability "
                             "mass to keep)")
        whole = value >= 1 and float(value).is_integer()
        if strategy == "top_k" and not (0.0 < value < 1.0 or whole):
            raise ValueError(f"{prefix}rollout_filter_value={value} must be a whole number >= 1 for top_k (groups to "
                             "keep per generation batch of data.train_batch_size prompts) or a fraction in (0, 1) "
                             "of that batch's groups")
        if strategy == "min_p" and not 0.0 <= value <= 1.0:
            raise ValueError(f"{prefix}rollout_filter_value={value} must be in [0, 1] for min_p (fraction of the best "
                             "score)")


def ragen_group_scores(
    rewards: torch.Tensor, group: torch.Tensor, config: RolloutFilterConfig, lengths: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The per-group score RAGEN ranks by, Tensor[G]: reward std / mean / sum, or mean response length."""
    if config.group_score == "length":
        if lengths is None or lengths.shape != rewards.shape:
            raise ValueError("rollout_filter_metric='length' needs the response lengths: pass lengths= with one per "
                             "response")
        return group_mean(lengths.double(), group)
    return GROUP_SCORES[config.group_score](rewards.double(), group)


def ragen_filter(
    rewards: torch.Tensor, group: torch.Tensor, config: RolloutFilterConfig, lengths: Optional[torch.Tensor] = None
) -> GroupFilterResult:
    """Keep the prompt groups that RAGEN's strategy selects by group score; returns whole-group keep mask + metrics.

    rewards (and lengths for the `length` score): one per response, Tensor[N]. Scores are computed in float64.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; pass one reward per response, shape (N,)")
    check_group(group, rewards.shape[0])
    scores = ragen_group_scores(rewards, group, config, lengths)
    present = group_count(group) > 0
    if not config.rollout_filter_enabled:
        raise ValueError("rollout_filter_strategy='none' selects no filter; call ragen_filter only when it is on")
    candidate = present if config.rollout_filter_include_zero else present & (scores.abs() > ZERO_SCORE_TOL)
    if bool(candidate.any()):
        strategy = RAGEN_STRATEGIES[config.rollout_filter_strategy]
        keep_group = strategy(scores, candidate, config, int(present.sum())) & candidate
    else:
        keep_group = torch.zeros_like(candidate)
    return _result(keep_group, present, group, group_std(rewards.float(), group, unbiased=True))


FILTER_LOSS_SCALINGS: dict[str, Callable[[float], float]] = {
    "none": lambda kept_ratio: 1.0,
    "linear": lambda kept_ratio: kept_ratio,
    "sqrt": math.sqrt,
}


def filter_loss_scale(kept_ratio: float, mode: str) -> float:
    """Factor for the advantages after a filter kept `kept_ratio` of the groups: 1, the ratio, or its square root."""
    if mode not in FILTER_LOSS_SCALINGS:
        raise ValueError(f"filter_loss_scaling={mode!r} is unknown; choose one of {list(FILTER_LOSS_SCALINGS)}")
    if not 0.0 <= kept_ratio <= 1.0:
        raise ValueError(f"kept_ratio={kept_ratio} must be in [0, 1] (kept groups / all groups)")
    return FILTER_LOSS_SCALINGS[mode](kept_ratio)


def scale_advantages(advantages: torch.Tensor, kept_ratio: float, mode: str) -> torch.Tensor:
    """Advantages multiplied by `filter_loss_scale(kept_ratio, mode)` (RAGEN applies the scaling here)."""
    return advantages * filter_loss_scale(kept_ratio, mode)


def in_group_reward_std(rewards: torch.Tensor, group: torch.Tensor) -> float:
    """Mean over present groups of the in-group reward std (RAGEN's `rollout/in_group_reward_std`)."""
    check_group(group, rewards.shape[0])
    present = group_count(group) > 0
    return float(group_std(rewards.float(), group, unbiased=True)[present].mean()) if bool(present.any()) else 0.0
