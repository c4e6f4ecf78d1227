"""What rank 0 builds for rollout besides the engines: the sampling parameters and CPO's hint contexts."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_cpo.algorithms.shapers import CPOConfig
from megatron_cpo.data.config import DataConfig
from megatron_cpo.data.hints import HintReader, HintTemplate, build_hint_contexts
from megatron_cpo.rollout.config import RolloutConfig
from megatron_cpo.rollout.types import SamplingParams
from megatron_cpo.trainer.driver.accumulator import ScoredGroup


def training_sampling_params(rollout: RolloutConfig, max_response_length: int, eos_token_id: int, seed: int | None,
                             greedy: bool = False) -> SamplingParams:
    """`rollout.n` samples of at most `max_response_length` tokens (`data.max_response_length`; one greedy sample
    with `greedy`)."""
    return SamplingParams(n=1 if greedy else rollout.n, temperature=0.0 if greedy else rollout.temperature,
                          top_p=1.0 if greedy else rollout.top_p, top_k=-1 if greedy else rollout.top_k,
                          max_tokens=max_response_length, stop_token_ids=(eos_token_id,), seed=seed)


class HintContextBuilder:
    """CPO's hinted prompts for the responses of a batch whose advantages a hint can change (`hinted_responses`, the
    shaper's: from each response's correctness and prompt group), built through the chat template (see
    data/hints.py): `algorithm.cpo.gold_as_hint` says whether the data's solution is the hint, `data.*` where it is
    and how the hinted prompt reads."""

    def __init__(self, cpo: CPOConfig, data: DataConfig, tokenizer: Any,
                 hinted_responses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.tokenizer = tokenizer
        self.gold_as_hint = cpo.gold_as_hint
        self.hinted_responses = hinted_responses
        self.reader = HintReader(data.hint_key)
        self.max_prompt_length = data.max_prompt_length
        self.template = HintTemplate(instruction=data.hint_instruction)

    def __call__(self, groups: list[ScoredGroup]) -> dict[str, Any]:
        """The `StepBatch` fields of the hints: `has_hint` [N] (the responses to score under a hint),
        `hint_prompt_ids` (their hinted prompts, in row order; None when there is none), `hints_truncated` and
        `hint_metrics` (where the hints came from)."""
        correct = torch.cat([g.acc for g in groups]) > 0
        group = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([g.n for g in groups]))
        rows = (self.hinted_responses(correct, group) if self.gold_as_hint
                else torch.zeros_like(correct)).nonzero()[:, 0].tolist()
        has_hint = torch.zeros(len(correct), dtype=torch.bool)
        if not rows:  # no response's advantage can change through a hint: no hinted prompt is built
            return {"has_hint": has_hint}
        records = [g.record for g in groups for _ in range(g.n)]
        prompts = [g.prompt_token_ids for g in groups for _ in range(g.n)]
        hints, source_metrics = self.reader.read([records[r].extra_info for r in rows],
                                                 [records[r].reward_model for r in rows])
        contexts = build_hint_contexts(self.tokenizer, [records[r].messages for r in rows], hints,
                                       [prompts[r] for r in rows], self.max_prompt_length, self.template)
        has_hint[rows] = contexts.has_hint
        hinted_prompts = [ids for ids, found in zip(contexts.prompt_ids, contexts.has_hint.tolist()) if found]
        return {"has_hint": has_hint, "hints_truncated": contexts.num_truncated, "hint_metrics": source_metrics,
                "hint_prompt_ids": hinted_prompts or None}
