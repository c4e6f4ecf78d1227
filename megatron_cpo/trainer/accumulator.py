"""Filter-and-accumulate for one training batch: the pure part of the rank-0 controller.

Groups finish in any order (engines interleave requests); they are *committed* in request order, like a re-order
buffer, so that which prompts form a batch depends only on the data order and the per-request seeds, never on
timing. That makes runs reproducible and resume exact, at the cost of occasionally holding a finished group until
the ones requested before it finish. A committed group passes the group filter (DAPO: std of a metric > 0) and is
kept or dropped; the batch is full when `target_prompts` groups are kept. Requested prompts after the last
committed one are handed back to the data stream (they are re-generated next step with the updated weights), so no
prompt is lost and none is trained on twice in an epoch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

GroupFilter = Callable[[torch.Tensor], torch.Tensor]
"""Maps a [groups, n] metric matrix to a bool [groups] keep mask (vectorised over the groups)."""


@dataclass
class ScoredGroup:
    """The n responses to one prompt, scored. `seq` is the prompt's position in this step's request order."""
    seq: int
    record: Any
    prompt_token_ids: list[int]
    response_token_ids: list[list[int]]
    rollout_log_probs: list[list[float]]
    truncated: torch.Tensor
    scores: torch.Tensor
    acc: torch.Tensor
    response_texts: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.response_token_ids)

    def metric(self, name: str) -> torch.Tensor:
        """Per-response value of a filter metric: `acc`, `score`, or `seq_reward` (the sparse reward's sum)."""
        if name == "acc":
            return self.acc.float()
        if name in ("score", "seq_reward"):
            return self.scores.float()
        raise KeyError(f"unknown group metric {name!r}; use 'acc', 'score' or 'seq_reward'")


@dataclass
class AccumulatorStats:
    """Counts for one batch; `committed` prompts were consumed from the data stream."""
    committed: int = 0
    kept: int = 0
    filtered: int = 0
    filtered_trajectories: int = 0
    filtered_all_correct: int = 0
    filtered_all_wrong: int = 0
    metric_std_sum: float = 0.0


class GroupAccumulator:
    """Commits scored groups in request order, filters them, and keeps them until `target_prompts` are kept."""

    def __init__(self, target_prompts: int, group_filter: GroupFilter | None = None, metric: str = "acc") -> None:
        if target_prompts < 1:
            raise ValueError(f"target_prompts={target_prompts} must be >= 1")
        self.target_prompts = target_prompts
        self.group_filter = group_filter
        self.metric = metric
        self.kept: list[ScoredGroup] = []
        self.stats = AccumulatorStats()
        self._pending: dict[int, ScoredGroup] = {}

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target_prompts

    @property
    def next_seq(self) -> int:
        """The request-order position of the next group to commit (= prompts consumed so far)."""
        return self.stats.committed

    def add(self, groups: list[ScoredGroup]) -> None:
        """Take finished groups (any order); commit every group that is next in request order until full."""
        for group in groups:
            if group.seq < self.stats.committed or group.seq in self._pending:
                raise ValueError(f"group seq={group.seq} was already added; each request finishes once")
            self._pending[group.seq] = group
        ready = []
        while self.stats.committed + len(ready) in self._pending:
            ready.append(self._pending.pop(self.stats.committed + len(ready)))
        if ready:
            self._commit(ready)

    def _commit(self, ready: list[ScoredGroup]) -> None:
        metric = torch.stack([g.metric(self.metric) for g in ready])
        keep = self.group_filter(metric) if self.group_filter is not None else torch.ones(len(ready), dtype=torch.bool)
        needed = self.target_prompts - len(self.kept)
        # Commit up to and including the group that fills the batch; later ones go back to the stream.
        kept_so_far = torch.cumsum(keep.long(), 0)
        fills = torch.nonzero(kept_so_far >= needed)
        count = int(fills[0]) + 1 if len(fills) else len(ready)
        keep, metric = keep[:count], metric[:count]
        dropped = ~keep
        self.kept.extend(g for g, k in zip(ready[:count], keep.tolist()) if k)
        self.stats.committed += count
        self.stats.kept += int(keep.sum())
        self.stats.filtered += int(dropped.sum())
        self.stats.filtered_trajectories += sum(g.n for g, k in zip(ready[:count], keep.tolist()) if not k)
        self.stats.filtered_all_correct += int((dropped & (metric.min(dim=1).values > 0)).sum())
        self.stats.filtered_all_wrong += int((dropped & (metric.max(dim=1).values <= 0)).sum())
        self.stats.metric_std_sum += float(metric.std(dim=1, unbiased=False).sum())
        for group in ready[count:]:
            self._pending[group.seq] = group

    def batch(self) -> list[ScoredGroup]:
        """The kept groups, exactly `target_prompts` of them when full (fewer for a partial batch)."""
        return self.kept[: self.target_prompts]

    def metrics(self) -> dict[str, float]:
        s = self.stats
        committed = max(s.committed, 1)
        return {
            "filter/kept_prompts": float(min(s.kept, self.target_prompts)),
            "filter/committed_prompts": float(s.committed),
            "filter/filtered_prompts": float(s.filtered),
            "filter/filter_rate": s.filtered / committed,
            "filter/filtered_all_correct": float(s.filtered_all_correct),
            "filter/filtered_all_wrong": float(s.filtered_all_wrong),
            "filter/mean_metric_std": s.metric_std_sum / committed,
        }


def std_positive_filter(metric: torch.Tensor) -> torch.Tensor:
    """DAPO's filter-groups rule on a [groups, n] metric matrix: keep groups whose responses disagree (std > 0)."""
    return metric.std(dim=1, unbiased=False) > 0
