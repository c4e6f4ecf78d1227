"""The batch one RL step trains on, as rank 0 builds it from the kept groups and `collectives.broadcast_batch` sends
it to every rank (step 2 of docs/architecture.md's "One RL step")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_cpo.trainer.accumulator import ScoredGroup
from megatron_cpo.trainer.ragged import RaggedRows


@dataclass
class StepBatch:
    """Everything the ranks need for one update; one row per response, responses of a prompt contiguous.

    Token and log-prob rows are `RaggedRows` (one flat tensor + offsets each; Python lists are converted when the batch
    is built), so the broadcast sends a few buffers instead of pickling every token.
    """
    prompt_ids: RaggedRows
    response_ids: RaggedRows
    rollout_log_probs: RaggedRows
    scores: torch.Tensor
    acc: torch.Tensor
    group: torch.Tensor
    truncated: torch.Tensor
    kept_ratio: float  # the group filters' kept / judged groups (filter_loss_scaling scales by it)
    hint_prompt_ids: RaggedRows | None = None
    has_hint: torch.Tensor | None = None
    hints_truncated: int = 0
    hint_metrics: dict[str, float] | None = None  # cpo/hint_source/<key> counts (data.hint_key)
    loss_mask: RaggedRows | None = None  # multi-turn: 1 on sampled, 0 on observation tokens (None: all sampled)
    policy_versions: RaggedRows | None = None  # the weight version that sampled each response token
    policy_version: int | None = None  # the version of the weights that train this batch

    def __post_init__(self) -> None:
        self.prompt_ids = RaggedRows.of(self.prompt_ids)
        self.response_ids = RaggedRows.of(self.response_ids)
        self.rollout_log_probs = RaggedRows.of(self.rollout_log_probs, torch.float32)
        if self.hint_prompt_ids is not None:
            self.hint_prompt_ids = RaggedRows.of(self.hint_prompt_ids)
        if self.loss_mask is not None:
            self.loss_mask = RaggedRows.of(self.loss_mask)
        if self.policy_versions is not None:
            self.policy_versions = RaggedRows.of(self.policy_versions)


def make_step_batch(groups: list[ScoredGroup], kept_ratio: float, hint_builder: Any = None,
                    policy_version: int | None = None) -> StepBatch:
    """Flatten kept groups into a `StepBatch`; `hint_builder(groups, prompts, responses)` adds CPO hint contexts;
    `policy_version`: the weight version that trains it (the token versions travel when every group has them)."""
    hints = {}
    if hint_builder is not None:
        prompts = [g.prompt_token_ids for g in groups for _ in range(g.n)]
        responses = [r for g in groups for r in g.response_token_ids]
        contexts = hint_builder(groups, prompts, responses)
        hints = {"hint_prompt_ids": contexts.prompt_ids, "has_hint": contexts.has_hint,
                 "hints_truncated": contexts.num_truncated, "hint_metrics": contexts.source_metrics}
    group = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([g.n for g in groups]))
    return StepBatch(
        prompt_ids=RaggedRows.from_lists([g.prompt_token_ids for g in groups]).repeat_rows([g.n for g in groups]),
        response_ids=RaggedRows.cat([g.ragged()[0] for g in groups]),
        rollout_log_probs=RaggedRows.cat([g.ragged()[1] for g in groups]),
        scores=torch.cat([g.scores.float() for g in groups]), acc=torch.cat([g.acc.float() for g in groups]),
        group=group, truncated=torch.cat([g.truncated for g in groups]), kept_ratio=kept_ratio,
        loss_mask=batch_loss_mask(groups), **hints,
        policy_versions=(RaggedRows.cat([g.policy_versions for g in groups])
                         if all(g.policy_versions is not None for g in groups) else None),
        policy_version=policy_version)


def batch_loss_mask(groups: list[ScoredGroup]) -> RaggedRows | None:
    """The kept groups' loss masks as one ragged tensor (a group without one: all 1); None when no group has one."""
    if all(g.loss_mask is None for g in groups):
        return None
    return RaggedRows.cat([g.loss_mask if g.loss_mask is not None else
                           RaggedRows(torch.ones_like(g.ragged()[0].values), g.ragged()[0].offsets) for g in groups])
