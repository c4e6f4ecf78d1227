"""Filter-and-accumulate for one training batch: the pure part of the rank-0 controller.

Groups are committed in request order, like a re-order buffer, so a batch's prompts depend on the data order and
seeds, never on timing; unused requests go back to the data stream (docs/trainer.md).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_cpo.algorithms.config import FilterGroupsConfig, OverlongBufferConfig, RolloutFilterConfig
from megatron_cpo.algorithms.filters import filter_groups, ragen_filter
from megatron_cpo.algorithms.overlong import overlong_reward_penalty
from megatron_cpo.rollout.types import EpisodeInfo, RolloutSample
from megatron_cpo.trainer.batch.ragged import RaggedRows

MetricFilter = Callable[[torch.Tensor], torch.Tensor]
"""Maps a [groups, n] metric matrix to a bool [groups] keep mask (vectorised over the groups)."""


@dataclass
class GroupSelection:
    """Which committed groups are trained on, and how their scores are shaped first.

    metric_filter: DAPO filter-groups' per-group rule. ragen: RAGEN's strategy, deciding `window` groups (one
    generation batch) at a time. overlong: DAPO's overlong penalty, added to the scores before any filter.
    """
    metric_filter: MetricFilter | None = None
    ragen: RolloutFilterConfig | None = None
    window: int = 1
    overlong: OverlongBufferConfig | None = None
    max_response_length: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1 (groups decided together)")
        if self.overlong is not None and self.max_response_length < 1:
            raise ValueError("the overlong penalty needs max_response_length (data.max_response_length)")

    def overlong_penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """DAPO's penalty (<= 0) of each response of a group, by its length (`ScoredGroup.response_lengths`)."""
        return overlong_reward_penalty(lengths, self.max_response_length, self.overlong.len,
                                       self.overlong.penalty_factor)

    @property
    def windowed(self) -> bool:
        return self.ragen is not None

    def keep(self, metric: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Bool [groups] keep mask for [groups, n] metric and score matrices (and response lengths, which RAGEN's
        `length` score ranks by)."""
        keep = self.metric_filter(metric) if self.metric_filter is not None else torch.ones(len(metric), dtype=bool)
        if self.ragen is None or not bool(keep.any()):
            return keep
        candidates = torch.nonzero(keep).squeeze(1)
        rows = scores[candidates]
        group = torch.arange(len(candidates)).repeat_interleave(rows.shape[1])
        row_lengths = lengths[candidates].reshape(-1) if lengths is not None else None
        chosen = ragen_filter(rows.reshape(-1), group, self.ragen, lengths=row_lengths).keep.reshape(rows.shape)[:, 0]
        keep = torch.zeros_like(keep)
        keep[candidates[chosen]] = True
        return keep


GroupFilter = GroupSelection | MetricFilter
"""What the controller passes to the accumulator: a `GroupSelection` or a bare per-group metric rule."""


@dataclass
class ScoredGroup:
    """The n responses to one prompt, scored. `seq` is the prompt's position in request order (this step's; with
    asynchronous training, the run's). `overlong_penalty` is what the overlong shaping added to `scores` (None when
    it is off); `policy_versions` the weight version of each response token (None: unknown, all current).
    Multi-turn episodes carry `loss_mask` (1 on sampled, 0 on observation tokens) and `episodes` (how each went);
    None otherwise."""
    seq: int
    record: Any
    prompt_token_ids: list[int]
    response_token_ids: list[list[int]]
    rollout_log_probs: list[list[float]]
    truncated: torch.Tensor
    scores: torch.Tensor
    acc: torch.Tensor
    response_texts: list[str] = field(default_factory=list)
    overlong_penalty: torch.Tensor | None = None
    loss_mask: RaggedRows | None = None
    episodes: list[EpisodeInfo] | None = None
    policy_versions: RaggedRows | None = None
    greedy_score: float | None = None  # ReMax: the score of the prompt's greedy answer (the baseline)
    request_id: str = ""  # the generation request's id (a distillation teacher scores the group under it)
    _ragged: tuple[RaggedRows, RaggedRows] | None = field(default=None, init=False, repr=False)

    @property
    def n(self) -> int:
        return len(self.response_token_ids)

    def ragged(self) -> tuple[RaggedRows, RaggedRows]:
        """The response token ids and the engine's log-probs as flat tensors (converted once, cached): the
        accumulator converts each group as it arrives, while generation still runs, so building the step batch only
        concatenates tensors."""
        if self._ragged is None:
            self._ragged = (RaggedRows.from_lists(self.response_token_ids),
                            RaggedRows.from_lists(self.rollout_log_probs, torch.float32))
        return self._ragged

    def response_lengths(self) -> torch.Tensor:
        """[n] the tokens of each response the policy sampled (an episode's observation tokens do not count): the
        length DAPO's overlong penalty and RAGEN's `length` score read."""
        if self.loss_mask is not None:
            running = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(self.loss_mask.values.long(), 0)])
            return running[self.loss_mask.offsets[1:]] - running[self.loss_mask.offsets[:-1]]
        return torch.tensor([len(r) for r in self.response_token_ids], dtype=torch.long)

    def metric(self, name: str) -> torch.Tensor:
        """Per-response value of a filter metric: `acc`, `score`, or `seq_reward` (the sparse reward's sum)."""
        if name == "acc":
            return self.acc.float()
        if name in ("score", "seq_reward"):
            return self.scores.float()
        raise KeyError(f"unknown group metric {name!r}; use 'acc', 'score' or 'seq_reward'")


def episode_fields(samples: list[RolloutSample]) -> dict[str, Any]:
    """A group's `loss_mask` and `episodes` for its `ScoredGroup` (None each for single answers)."""
    masks = [s.loss_mask if s.loss_mask is not None else [1] * len(s.token_ids) for s in samples]
    has_mask = any(s.loss_mask is not None for s in samples)
    return {"loss_mask": RaggedRows.from_lists(masks) if has_mask else None,
            "episodes": [s.episode for s in samples] if any(s.episode is not None for s in samples) else None}


@dataclass
class AccumulatorStats:
    """Counts for one batch; `committed` prompts were consumed from the data stream. `judged` / `judged_kept`
    count the filters' decisions on every group that finished in order, including those past the group that filled
    the batch (they go back to the data stream, but their outcome is a sample of the keep rate all the same)."""
    committed: int = 0
    kept: int = 0
    filtered: int = 0
    filtered_trajectories: int = 0
    filtered_all_correct: int = 0
    filtered_all_wrong: int = 0
    metric_std_sum: float = 0.0
    judged: int = 0
    judged_kept: int = 0
    reward_std_sum: float = 0.0
    responses: int = 0
    overlong_penalty_sum: float = 0.0
    overlong_penalized: int = 0


class GroupAccumulator:
    """Commits scored groups in request order, filters them, and keeps them until `target_prompts` are kept.

    With RAGEN a window is decided at once (an incomplete one at the first `batch()` / `metrics()`); with asynchronous
    training `start_seq` and `pending` carry groups in from the previous batch and `leftover()` hands them on.
    """

    def __init__(self, target_prompts: int, group_filter: GroupFilter | None = None, metric: str = "acc",
                 start_seq: int = 0, pending: dict[int, ScoredGroup] | None = None) -> None:
        if target_prompts < 1:
            raise ValueError(f"target_prompts={target_prompts} must be >= 1")
        self.target_prompts = target_prompts
        self.start_seq = start_seq
        self.selection = (group_filter if isinstance(group_filter, GroupSelection)
                          else GroupSelection(metric_filter=group_filter))
        self.metric = metric
        self.kept: list[ScoredGroup] = []
        self.stats = AccumulatorStats()
        self._pending: dict[int, ScoredGroup] = dict(pending or {})
        self._window: list[ScoredGroup] = []
        self._drops_cache: dict[int, bool] = {}  # seq -> whether the filter drops it whatever comes before

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target_prompts

    @property
    def next_seq(self) -> int:
        """The request-order position of the next group to commit."""
        return self.start_seq + self.consumed

    @property
    def consumed(self) -> int:
        """Prompts this batch has consumed (committed, or waiting in an undecided window)."""
        return self.stats.committed + len(self._window)

    @property
    def dropping(self) -> int:
        """Finished groups waiting to commit that the filter will drop whatever comes before them (a per-group
        filter: DAPO's; RAGEN's compares groups, so it decides nothing early). They will never be trained."""
        if self.selection.windowed or self.selection.metric_filter is None:
            return 0
        for seq, group in self._pending.items():
            if seq not in self._drops_cache:
                self._drops_cache[seq] = not bool(self.selection.keep(group.metric(self.metric)[None],
                                                                      group.scores.float()[None])[0])
        return sum(self._drops_cache[seq] for seq in self._pending)

    def leftover(self) -> dict[int, ScoredGroup]:
        """The groups that finished after the batch filled (by seq), for the next batch; they leave this one."""
        leftover, self._pending = self._pending, {}
        return leftover

    def add(self, groups: list[ScoredGroup]) -> None:
        """Take finished groups (any order); commit every group that is next in request order until full."""
        for group in groups:
            if group.seq < self.next_seq or group.seq in self._pending:
                raise ValueError(f"group seq={group.seq} was already added; each request finishes once")
            if self.selection.overlong is not None:
                group.overlong_penalty = self.selection.overlong_penalty(group.response_lengths())
                group.scores = group.scores.float() + group.overlong_penalty
            group.ragged()  # the list -> tensor conversion, now rather than on the step's critical path
            self._pending[group.seq] = group
        while not self.full and self.next_seq in self._pending:
            self._window.append(self._pending.pop(self.next_seq))
            if self.selection.windowed and len(self._window) == self.selection.window:
                self._decide()
        if not self.selection.windowed and self._window:
            self._decide()

    def _decide(self) -> None:
        """Judge the window's groups together; commit up to and including the group that fills the batch."""
        ready, self._window = self._window, []
        metric = torch.stack([g.metric(self.metric) for g in ready])
        scores = torch.stack([g.scores.float() for g in ready])
        lengths = torch.stack([g.response_lengths() for g in ready]).float()
        keep = self.selection.keep(metric, scores, lengths)
        needed = self.target_prompts - len(self.kept)
        kept_so_far = torch.cumsum(keep.long(), 0)
        fills = torch.nonzero(kept_so_far >= needed)
        count = int(fills[0]) + 1 if len(fills) else len(ready)
        s = self.stats
        s.judged += len(ready)
        s.judged_kept += int(keep.sum())
        s.reward_std_sum += float(scores.std(dim=1).nan_to_num(0.0).sum())
        keep, metric, used = keep[:count], metric[:count], ready[:count]
        dropped = ~keep
        self.kept.extend(g for g, k in zip(used, keep.tolist()) if k)
        s.committed += count
        s.kept += int(keep.sum())
        s.filtered += int(dropped.sum())
        s.filtered_trajectories += sum(g.n for g, k in zip(used, keep.tolist()) if not k)
        s.filtered_all_correct += int((dropped & (metric.min(dim=1).values > 0)).sum())
        s.filtered_all_wrong += int((dropped & (metric.max(dim=1).values <= 0)).sum())
        s.metric_std_sum += float(metric.std(dim=1, unbiased=False).sum())
        penalties = [g.overlong_penalty for g in used if g.overlong_penalty is not None]
        if penalties:
            penalty = torch.cat(penalties)
            s.overlong_penalty_sum += float(penalty.sum())
            s.overlong_penalized += int((penalty < 0).sum())
        s.responses += sum(g.n for g in used)
        for group in ready[count:]:
            self._pending[group.seq] = group

    def _finish(self) -> None:
        if self._window and not self.full:
            self._decide()

    def batch(self) -> list[ScoredGroup]:
        """The kept groups, exactly `target_prompts` of them when full (fewer for a partial batch)."""
        self._finish()
        return self.kept[: self.target_prompts]

    def metrics(self) -> dict[str, float]:
        """Filter counts; `filter/kept_ratio` (kept / judged groups) is what `filter_loss_scaling` scales by and
        `rollout/in_group_reward_std` (mean unbiased in-group score std of the judged groups) what early stop reads."""
        self._finish()
        s = self.stats
        committed = max(s.committed, 1)
        metrics = {
            "filter/kept_prompts": float(min(s.kept, self.target_prompts)),
            "filter/committed_prompts": float(s.committed),
            "filter/filtered_prompts": float(s.filtered),
            "filter/filter_rate": s.filtered / committed,
            "filter/filtered_all_correct": float(s.filtered_all_correct),
            "filter/filtered_all_wrong": float(s.filtered_all_wrong),
            "filter/mean_metric_std": s.metric_std_sum / committed,
            "filter/kept_ratio": s.judged_kept / max(s.judged, 1),
            "rollout/in_group_reward_std": s.reward_std_sum / max(s.judged, 1),
        }
        if self.selection.overlong is not None:
            metrics["overlong/reward_mean"] = s.overlong_penalty_sum / max(s.responses, 1)
            metrics["overlong/frac"] = s.overlong_penalized / max(s.responses, 1)
        return metrics


def keep_varied_groups(metric: torch.Tensor) -> torch.Tensor:
    """DAPO filter-groups on a [groups, n] metric matrix via the algorithms' vectorised (exact) rule."""
    groups, n = metric.shape
    group = torch.arange(groups).repeat_interleave(n)
    return filter_groups(metric.reshape(-1), group).keep.reshape(groups, n)[:, 0]


def group_selection(filter_groups: FilterGroupsConfig, rollout_filter: RolloutFilterConfig,
                    overlong: OverlongBufferConfig, batch_size: int, max_response_length: int
                    ) -> GroupSelection | None:
    """The run's group selection: DAPO filter-groups (`algorithm.filter_groups`), RAGEN's rollout filter (the
    `rollout_filter_*` keys of `actor_rollout_ref.rollout`) and the overlong buffer (`reward.overlong_buffer`), as
    configured (None when none is on). RAGEN decides one generation batch (`batch_size` groups) at a time."""
    ragen = rollout_filter if rollout_filter.rollout_filter_enabled else None
    if not filter_groups.enable and ragen is None and not overlong.enable:
        return None
    return GroupSelection(metric_filter=keep_varied_groups if filter_groups.enable else None, ragen=ragen,
                          window=batch_size, overlong=overlong if overlong.enable else None,
                          max_response_length=max_response_length)
