"""Rank 0's held-out evaluation: `val/acc` and `val/score` (mean@n), overall and per data source."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import torch

from megatron_cpo.data.dataset import PromptDataset
from megatron_cpo.envs.metrics import episode_metrics
from megatron_cpo.rollout.config import ValKwargsConfig
from megatron_cpo.rollout.generators import GroupGenerator
from megatron_cpo.rollout.types import RolloutGroup, SamplingParams
from megatron_cpo.trainer.driver.grading import ResponseScorer


class Validator:
    """Samples the validation set on the engines as `rollout.val_kwargs` says and grades it: the first
    `max_samples` rows (`data.val_max_samples`, -1: all), sampled with seeds from `seed` (`trainer.seed`)."""

    def __init__(self, val_data: PromptDataset | None, generator: GroupGenerator, scorer: ResponseScorer,
                 greedy_params: SamplingParams, val_kwargs: ValKwargsConfig, seed: int = 0, max_samples: int = -1,
                 other_groups: Callable[[list[RolloutGroup]], None] | None = None) -> None:
        self.val_data = val_data
        self.val_kwargs, self.seed, self.max_samples = val_kwargs, seed, max_samples
        self.generator = generator
        self.scorer = scorer
        self.greedy_params = greedy_params  # the training sampling's length and stop tokens, greedy
        # where the groups of other requests go (training ones still in flight with asynchronous training)
        self.other_groups = other_groups

    def params(self, index: int) -> SamplingParams:
        """verl's `rollout.val_kwargs`: greedy unless `do_sample`, then `n` seeded samples per prompt."""
        val = self.val_kwargs
        if not val.do_sample:
            return replace(self.greedy_params, n=val.n)
        return SamplingParams(n=val.n, temperature=val.temperature, top_p=val.top_p, top_k=val.top_k,
                              max_tokens=self.greedy_params.max_tokens,
                              stop_token_ids=self.greedy_params.stop_token_ids, seed=self.seed + index)

    def size(self) -> int:
        """How many rows of the validation set `validate` uses: all, or the first `data.val_max_samples`."""
        cap = self.max_samples
        return len(self.val_data) if cap == -1 else min(cap, len(self.val_data))

    def validate(self) -> dict[str, float]:
        """Accuracy on the held-out set: `val/acc` and `val/score` (means over every sample, i.e. mean@n), and the same
        per data source (`val/<source>/acc`); {} without a validation set."""
        if self.val_data is None:
            return {}
        start = time.perf_counter()
        records = {}
        for index in range(self.size()):
            record = self.val_data[index]
            records[f"val-{index}"] = record
            self.generator.submit(f"val-{index}", record, self.params(index))
        finished = self._wait_for(set(records))
        items = [(records[rid], finished[rid].samples) for rid in records]
        val_counts: Counter = Counter()
        scored = self.scorer.score_groups(items, val_counts, training=False)
        metrics = {"val/count": float(len(records)), **self.scorer.counted_metrics(val_counts, "val")}
        sources = [record.data_source for record, _ in items]
        for source in [None, *sorted(set(sources))]:
            chosen = [i for i, s in enumerate(sources) if source is None or s == source]
            prefix = "val" if source is None else f"val/{source}"
            metrics[f"{prefix}/acc"] = float(torch.cat([scored[i][1] for i in chosen]).mean())
            metrics[f"{prefix}/score"] = float(torch.cat([scored[i][0].float() for i in chosen]).mean())
        metrics.update(episode_metrics([sample.episode for _, samples in items for sample in samples
                                        if sample.episode is not None], prefix="val/multi_turn"))
        metrics["timing/val_s"] = time.perf_counter() - start
        return metrics

    def _wait_for(self, request_ids: set[str]) -> dict[str, RolloutGroup]:
        """The groups of `request_ids`; any other group that finishes meanwhile goes to `other_groups`."""
        finished: dict[str, RolloutGroup] = {}
        while len(finished) < len(request_ids):
            groups = self.generator.finished(timeout=600)
            if not groups:
                raise RuntimeError(f"validation lost {len(request_ids) - len(finished)} of its requests (nothing is "
                                   "outstanding on the engines)")
            others = [group for group in groups if group.request_id not in request_ids]
            if others and self.other_groups is None:
                raise RuntimeError(f"validation received groups it did not request: {[g.request_id for g in others]}")
            if others:
                self.other_groups(others)
            finished.update((group.request_id, group) for group in groups if group.request_id in request_ids)
        return finished
