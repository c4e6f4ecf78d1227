"""What rank 0 builds from the config for rollout: the data sets, sampling parameters, hint contexts (the engines:
`rollout/modes.py`'s `build_rollout_manager`)."""
from __future__ import annotations

from typing import Any

from megatron_cpo.config import Config
from megatron_cpo.data.dataset import PromptDataset
from megatron_cpo.data.hints import HintReader, HintTemplate, build_hint_contexts
from megatron_cpo.rollout import SamplingParams
from megatron_cpo.trainer.driver.accumulator import ScoredGroup


def load_dataset(files: list[str], tokenizer: Any, config: Config) -> PromptDataset:
    """Read and check a data file list as `data.*` says; rows need ground truths unless one reward function grades
    every response (the graders of the sources were checked by preflight)."""
    return PromptDataset(files, tokenizer, config.data, needs_ground_truth=config.reward.needs_ground_truth)


def training_sampling_params(config: Config, eos_token_id: int, seed: int | None, greedy: bool = False
                             ) -> SamplingParams:
    """`rollout.n` samples of at most `data.max_response_length` tokens (one greedy sample with `greedy`)."""
    rollout = config.actor_rollout_ref.rollout
    return SamplingParams(n=1 if greedy else rollout.n, temperature=0.0 if greedy else rollout.temperature,
                          top_p=1.0 if greedy else rollout.top_p, top_k=-1 if greedy else rollout.top_k,
                          max_tokens=config.data.max_response_length, stop_token_ids=(eos_token_id,), seed=seed)


class HintContextBuilder:
    """CPO's hinted prompt for every response of a batch, built through the chat template (see data/hints.py)."""

    def __init__(self, config: Config, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.gold_as_hint = config.algorithm.cpo.gold_as_hint
        self.reader = HintReader(config.data.hint_key)
        self.max_prompt_length = config.data.max_prompt_length
        self.template = HintTemplate(instruction=config.data.hint_instruction)

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
