"""Rank 0's scoring of finished groups: decode the responses and grade them in one call to the reward pool.

The controller calls `ResponseScorer.score_groups` for every batch of finished groups; validation calls it with its
own counter so the remote reward model's numbers of a validation do not mix into the training step's. (The graders
themselves, one per data source, are `rewards/registry.py`'s.)
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from megatron_cpo.rewards.manager import RewardConfig, RewardManager


class ResponseScorer:
    """Scores groups of responses: [(record, response token ids)] -> [(scores [n], acc [n], response texts)], with
    the grading pool (and the remote reward model) of `reward.*`."""

    def __init__(self, config: RewardConfig, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.rewards = RewardManager(config)
        self.remote_counts: Counter = Counter()  # the remote reward model's numbers since they were last logged

    def score_groups(self, items: list[tuple[Any, list[list[int]]]], remote_counts: Counter | None = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        """Decode and grade every response of the given groups in one call to the grading pool; the remote reward
        model's numbers are added to `remote_counts` (default: the training step's, see `remote_reward_metrics`)."""
        texts = [[self.tokenizer.decode(r, skip_special_tokens=True) for r in responses] for _, responses in items]
        flat_records = [record for (record, responses) in items for _ in responses]
        prompts = None
        if self.rewards.remote is not None:  # the reward model reads the prompt as the policy saw it (chat template)
            prompts = [self.tokenizer.decode(record.prompt_ids, skip_special_tokens=False)
                       for record, responses in items for _ in responses]
        result = self.rewards.score([r.data_source for r in flat_records], [t for ts in texts for t in ts],
                                    [r.ground_truth for r in flat_records], [r.extra_info for r in flat_records],
                                    prompts)
        if "reward/remote/failed" in result.metrics:
            counts = self.remote_counts if remote_counts is None else remote_counts
            counts.update({"samples": len(flat_records), "failed": result.metrics["reward/remote/failed"],
                           "seconds": result.metrics["reward/remote/seconds"],
                           "score_sum": result.metrics["reward/remote/score_mean"] * len(flat_records)})
        out, start = [], 0
        for group_texts in texts:
            stop = start + len(group_texts)
            out.append((result.scores[start:stop], result.acc[start:stop].float(), group_texts))
            start = stop
        return out

    def remote_reward_metrics(self, counts: Counter | None = None, prefix: str = "reward/remote") -> dict[str, float]:
        """`reward/remote/{score_mean,failed,seconds}` since the last call (empty without `reward.remote`)."""
        counts = self.remote_counts if counts is None else counts
        if not counts["samples"]:
            return {}
        metrics = {f"{prefix}/score_mean": counts["score_sum"] / counts["samples"],
                   f"{prefix}/failed": float(counts["failed"]), f"{prefix}/seconds": float(counts["seconds"])}
        counts.clear()
        return metrics

    def close(self) -> None:
        self.rewards.close()
