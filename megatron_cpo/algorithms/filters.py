"""Which prompt groups to train on: DAPO filter-groups, RAGEN's strategies, filter loss scaling (docs/filters.md).

DAPO keeps groups whose metric has std > 0 (a group of one is kept: it cannot be judged); RAGEN ranks groups by a
score and keeps the best. Every filter keeps or drops whole groups and returns a `GroupFilterResult`.
"""
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_cpo.algorithms.config import RolloutFilterConfig
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


RAGEN_STRATEGIES: dict[str, Callable] = {  # keyed by config.RAGEN_STRATEGY_NAMES
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


def ragen_group_scores(
    rewards: torch.Tensor, group: torch.Tensor, config: RolloutFilterConfig, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """The per-group score RAGEN ranks by, Tensor[G]: reward std / mean / sum, or mean response length."""
    if config.group_score == "length":
        if lengths is None or lengths.shape != rewards.shape:
            raise ValueError("rollout_filter_metric='length' needs the response lengths: pass lengths= with one per "
                             "response")
        return group_mean(lengths.double(), group)
    return GROUP_SCORES[config.group_score](rewards.double(), group)


def ragen_filter(
    rewards: torch.Tensor, group: torch.Tensor, config: RolloutFilterConfig, lengths: torch.Tensor | None = None
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


FILTER_LOSS_SCALINGS: dict[str, Callable[[float], float]] = {  # keyed by config.FILTER_LOSS_SCALING_MODES
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
