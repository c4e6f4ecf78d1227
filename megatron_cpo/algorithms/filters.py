"""Which prompt groups to train on: DAPO filter-groups, RAGEN's strategies, filter loss scaling, early stopping.

- DAPO dynamic sampling (Yu et al., 2025): a group whose responses all got the same metric value gives GRPO nothing
  to compare, so only groups with std > 0 are kept (a group of one is kept: it cannot be judged).
- RAGEN (Wang et al., 2025) ranks groups by a score, the in-group reward std by default (high variance = the prompt
  is at the edge of the model's ability), and keeps the best by `top_p`, `top_k` or `min_p`. Keeping few groups
  raises gradient variance; `filter_loss_scaling` shrinks the advantages by the kept ratio (or its square root).
  When the reward std collapses for many attempts in a row, the `EarlyStopMonitor` says to stop.

Every filter keeps or drops whole groups and returns a `GroupFilterResult`. Group indices are 0..G-1 (see groups.py).
"""
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from megatron_cpo.algorithms.groups import check_group, group_count, group_max, group_mean, group_min, group_std


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


def select_filter_metric(fields: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """The per-response values of the field `name` (`acc`, `score`, `seq_reward`, `seq_final_reward` or any other
    per-sample field). A token-level field [N, T] is summed over tokens, as DAPO's `seq_reward` is."""
    if name not in fields:
        raise ValueError(f"filter_groups.metric={name!r} is not a field of the batch; available: {sorted(fields)}")
    values = fields[name]
    if values.dim() == 2:
        values = values.sum(-1)
    if values.dim() != 1:
        raise ValueError(f"field {name!r} has shape {tuple(values.shape)}; expected (N,) or (N, T)")
    return values.float()


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


def _top_p(scores: torch.Tensor, candidate: torch.Tensor, value: float) -> torch.Tensor:
    probs = torch.softmax(scores.masked_fill(~candidate, float("-inf")), dim=0)
    order = torch.sort(probs, descending=True, stable=True).indices
    mass_before = torch.cumsum(probs[order], dim=0) - probs[order]
    chosen_sorted = mass_before < value
    chosen_sorted[0] = True
    chosen = torch.zeros_like(candidate)
    chosen[order] = chosen_sorted
    return chosen


def _top_k(scores: torch.Tensor, candidate: torch.Tensor, value: float) -> torch.Tensor:
    order = torch.sort(scores.masked_fill(~candidate, float("-inf")), descending=True, stable=True).indices
    chosen = torch.zeros_like(candidate)
    chosen[order[: int(value)]] = True
    return chosen


def _min_p(scores: torch.Tensor, candidate: torch.Tensor, value: float) -> torch.Tensor:
    best = scores.masked_fill(~candidate, float("-inf")).max()
    return (scores >= value * best) | (scores == best)


RAGEN_STRATEGIES: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "top_p": _top_p,
    "top_k": _top_k,
    "min_p": _min_p,
}
GROUP_SCORES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "std": lambda rewards, group: group_std(rewards, group, unbiased=True),
    "mean": group_mean,
}


@dataclass
class RagenFilterConfig:
    """RAGEN rollout filter.

    strategy: `top_p` (smallest set of groups whose softmax probability mass reaches `value`, at least one),
    `top_k` (the `value` best groups, an integer >= 1) or `min_p` (score >= value * best score; the best is kept).
    filter_type: `largest` keeps high scores, `smallest` low ones (the scores are negated).
    include_zero: whether groups whose score is exactly 0 may be kept at all.
    group_score: `std` (in-group reward std, RAGEN's variance filter) or `mean` (mean reward).
    """

    strategy: str = "top_p"
    value: float = 0.9
    filter_type: str = "largest"
    include_zero: bool = True
    group_score: str = "std"

    def __post_init__(self) -> None:
        if self.strategy not in RAGEN_STRATEGIES:
            raise ValueError(
                f"rollout_filter_strategy={self.strategy!r} is unknown; choose one of {list(RAGEN_STRATEGIES)}"
            )
        if self.filter_type not in ("largest", "smallest"):
            raise ValueError(f"rollout_filter_type={self.filter_type!r} is unknown; choose 'largest' or 'smallest'")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score={self.group_score!r} is unknown; choose one of {list(GROUP_SCORES)}")
        if self.strategy == "top_p" and not 0.0 < self.value <= 1.0:
            raise ValueError(f"top_p needs rollout_filter_value in (0, 1], got {self.value}")
        if self.strategy == "top_k" and (self.value < 1 or self.value != int(self.value)):
            raise ValueError(f"top_k needs an integer rollout_filter_value >= 1 (groups to keep), got {self.value}")
        if self.strategy == "min_p" and not 0.0 <= self.value <= 1.0:
            raise ValueError(f"min_p needs rollout_filter_value in [0, 1], got {self.value}")


def ragen_filter(rewards: torch.Tensor, group: torch.Tensor, config: RagenFilterConfig) -> GroupFilterResult:
    """Keep the prompt groups that RAGEN's strategy selects by group score; returns whole-group keep mask + metrics."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; pass one reward per response, shape (N,)")
    check_group(group, rewards.shape[0])
    values = rewards.float()
    raw = GROUP_SCORES[config.group_score](values, group)
    present = group_count(group) > 0
    candidate = present if config.include_zero else present & (raw != 0)
    scores = -raw if config.filter_type == "smallest" else raw
    if bool(candidate.any()):
        keep_group = RAGEN_STRATEGIES[config.strategy](scores, candidate, config.value) & candidate
    else:
        keep_group = torch.zeros_like(candidate)
    return _result(keep_group, present, group, group_std(values, group, unbiased=True))


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


@dataclass
class EarlyStopConfig:
    """baseline_steps: successful steps whose mean reward std is the baseline; window: recent attempts (retries
    included) that must all be low; ratio: "low" means below ratio * baseline."""

    baseline_steps: int = 10
    window: int = 10
    ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.baseline_steps < 1 or self.window < 1:
            raise ValueError(f"baseline_steps={self.baseline_steps} and window={self.window} must both be >= 1")
        if not self.ratio > 0:
            raise ValueError(f"early-stop ratio={self.ratio} must be > 0 (e.g. 0.1 = 10% of the baseline)")


class EarlyStopMonitor:
    """Stop training when the in-group reward std has collapsed: all of the last `window` attempts are below
    `ratio` x the baseline (the mean over the first `baseline_steps` successful steps)."""

    def __init__(self, config: Optional[EarlyStopConfig] = None) -> None:
        self.config = config or EarlyStopConfig()
        self._baseline_values: list[float] = []
        self._recent: deque = deque(maxlen=self.config.window)
        self.stopped = False

    @property
    def baseline(self) -> Optional[float]:
        """The baseline std once `baseline_steps` successful steps were seen, else None."""
        if len(self._baseline_values) < self.config.baseline_steps:
            return None
        return sum(self._baseline_values) / len(self._baseline_values)

    def observe(self, reward_std: float, successful: bool) -> bool:
        """Record one rollout attempt (`successful`: it went on to a training step); returns whether to stop."""
        if successful and len(self._baseline_values) < self.config.baseline_steps:
            self._baseline_values.append(float(reward_std))
        self._recent.append(float(reward_std))
        baseline = self.baseline
        if baseline is not None and len(self._recent) == self.config.window:
            self.stopped = self.stopped or all(v < self.config.ratio * baseline for v in self._recent)
        return self.stopped

    def state_dict(self) -> dict:
        """Plain-Python state for checkpoints."""
        return {"baseline_values": list(self._baseline_values), "recent": list(self._recent), "stopped": self.stopped}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()`; the window keeps the newest `config.window` values."""
        self._baseline_values = [float(v) for v in state["baseline_values"]]
        self._recent = deque((float(v) for v in state["recent"]), maxlen=self.config.window)
        self.stopped = bool(state["stopped"])
