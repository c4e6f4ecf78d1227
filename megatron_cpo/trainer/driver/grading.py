"""Rank 0's scoring of finished groups: decode the responses and grade them in one call to the reward pool.

The controller calls `ResponseScorer.score_groups` for every batch of finished groups; validation calls it with its
own counter so the remote reward model's numbers of a validation do not mix into the training step's. (The graders
themselves, one per data source, are `rewards/registry.py`'s.) Here `reward.non_finite` is applied to the non-finite
scores every source refused where they entered (rewards/non_finite.py): the run's one place for that decision.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from megatron_cpo.rewards.manager import RewardConfig, RewardManager
from megatron_cpo.rewards.non_finite import NonFiniteRewardError, refusal_message
from megatron_cpo.rollout.types import RolloutSample

logger = logging.getLogger(__name__)


class ResponseScorer:
    """Scores groups of responses: [(record, samples)] -> [(scores [n], acc [n], response texts)], with the grading
    pool (and the remote reward model) of `reward.*`."""

    def __init__(self, config: RewardConfig, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.non_finite = config.non_finite
        self.rewards = RewardManager(config)
        self.counts: Counter = Counter()  # the training step's tallies (remote model, non-finite) since last logged
        self._warned_non_finite = False

    def score_groups(self, items: list[tuple[Any, list[RolloutSample] | list[list[int]]]],
                     counts: Counter | None = None, training: bool = True
                     ) -> list[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        """Decode and grade every response of the given groups in one call to the grading pool, adding the remote reward
        model's numbers and the refused non-finite scores to `counts`. A non-finite training score raises
        `NonFiniteRewardError` when `reward.non_finite=error`; else it is 0 and counted. Multi-turn scoring:
        docs/trainer.md.
        """
        samples = [[r if isinstance(r, RolloutSample) else None for r in responses] for _, responses in items]
        ids = [[r.token_ids if isinstance(r, RolloutSample) else r for r in responses] for _, responses in items]
        texts = [[self._text(token_ids, sample) for token_ids, sample in zip(group_ids, group_samples)]
                 for group_ids, group_samples in zip(ids, samples)]
        flat = [(record, sample, text) for (record, _), group_samples, group_texts in zip(items, samples, texts)
                for sample, text in zip(group_samples, group_texts)]
        graded = [i for i, (_, sample, _) in enumerate(flat) if sample is None or sample.episode is None
                  or sample.episode.final_score is None]
        grading = self._grade([flat[i][0] for i in graded], [self._graded_text(*flat[i][1:]) for i in graded],
                              counts)
        scores, acc = torch.zeros(len(flat)), torch.zeros(len(flat))
        if graded:
            scores[graded], acc[graded] = grading.scores.float(), grading.acc.float()
        episodes = [i for i, (_, sample, _) in enumerate(flat) if sample is not None and sample.episode is not None]
        for i in episodes:
            episode = flat[i][1].episode
            scores[i] += episode.env_reward + (episode.final_score or 0.0)
            if episode.final_score is not None:
                acc[i] = float(scores[i] > 0)
        refused = sorted([(graded[index], text) for index, text in grading.non_finite.items()]
                         + [(i, text) for i in episodes for text in flat[i][1].episode.non_finite_rewards])
        if refused:
            self._refuse([text for _, text in refused], counts, training)
        out, start = [], 0
        for group_texts in texts:
            stop = start + len(group_texts)
            out.append((scores[start:stop], acc[start:stop], group_texts))
            start = stop
        return out

    def _text(self, token_ids: list[int], sample: RolloutSample | None) -> str:
        """A response as text: a single answer without special tokens, an episode's whole transcript with them."""
        episode = sample is not None and sample.episode is not None
        return self.tokenizer.decode(token_ids, skip_special_tokens=not episode)

    @staticmethod
    def _graded_text(sample: RolloutSample | None, text: str) -> str:
        """What the grader reads: the response, or an episode's last assistant message."""
        return sample.episode.final_answer if sample is not None and sample.episode is not None else text

    def _grade(self, records: list[Any], texts: list[str], counts: Counter | None) -> Any:
        """One call to the grading pool (and the remote reward model) for these responses."""
        prompts = None
        if self.rewards.remote is not None:  # the reward model reads the prompt as the policy saw it (chat template)
            prompts = [self.tokenizer.decode(record.prompt_ids, skip_special_tokens=False) for record in records]
        result = self.rewards.score([r.data_source for r in records], texts, [r.ground_truth for r in records],
                                    [r.extra_info for r in records], prompts, rows=[r.index for r in records])
        if "reward/remote/failed" in result.metrics:
            (self.counts if counts is None else counts).update({
                "samples": len(records), "failed": result.metrics["reward/remote/failed"],
                "seconds": result.metrics["reward/remote/seconds"],
                "score_sum": result.metrics["reward/remote/score_mean"] * len(records)})
        return result

    def _refuse(self, descriptions: list[str], counts: Counter | None, training: bool) -> None:
        """`reward.non_finite` on the refused scores of one scoring call (already 0): raise, or count them."""
        if training and self.non_finite == "error":
            raise NonFiniteRewardError(refusal_message(descriptions))
        (self.counts if counts is None else counts)["non_finite"] += len(descriptions)
        if not self._warned_non_finite:
            self._warned_non_finite = True
            logger.warning("%s scored 0 (%s; counted in %s, warned once)", descriptions[0],
                           "reward.non_finite=zero" if training else "a validation score",
                           "reward/non_finite" if training else "val/non_finite")

    def counted_metrics(self, counts: Counter | None = None, prefix: str = "reward") -> dict[str, float]:
        """What was counted since the last call: `<prefix>/non_finite` (non-finite scores refused) and, with
        `reward.remote`, `<prefix>/remote/{score_mean,failed,seconds}`."""
        counts = self.counts if counts is None else counts
        metrics = {f"{prefix}/non_finite": float(counts["non_finite"])}
        if counts["samples"]:
            metrics.update({f"{prefix}/remote/score_mean": counts["score_sum"] / counts["samples"],
                            f"{prefix}/remote/failed": float(counts["failed"]),
                            f"{prefix}/remote/seconds": float(counts["seconds"])})
        counts.clear()
        return metrics

    def close(self) -> None:
        self.rewards.close()
