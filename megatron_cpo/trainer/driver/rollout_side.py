"""What rank 0 builds for rollout besides the engines: the sampling parameters and CPO's hint contexts."""
from __future__ import annotations

from typing import Any

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
    """CPO's hinted prompt for every response of a batch, built through the chat template (see data/hints.py):
    `algorithm.cpo.gold_as_hint` says whether the data's solution is the hint, `data.*` where it is and how the
    hinted prompt reads."""

    def __init__(self, cpo: CPOConfig, data: DataConfig, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.gold_as_hint = cpo.gold_as_hint
        self.reader = HintReader(data.hint_key)
        self.max_prompt_length = data.max_prompt_length
        self.template = HintTemplate(instruction=data.hint_instruction)

    def __call__(self, groups: list[ScoredGroup], prompts: list[list[int]], responses: list[list[int]]) -> Any:
        records = [g.record for g in groups for _ in range(g.n)]
        hints, source_metrics = [None] * len(records), {}
        if self.gold_as_hint:
            hints, source_metrics = self.reader.read([r.extra_info for r in records],
                                                     [r.reward_model for r in records])
        contexts = build_hint_contexts(self.tokenizer, [r.messages for r in records], hints, prompts,
                                       self.max_prompt_length, self.template)
        contexts.source_metrics = source_metrics
        return contexts
