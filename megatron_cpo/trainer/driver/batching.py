"""Rank 0 turns the kept groups into the step's `StepBatch` (step 2 of docs/architecture.md's "One RL step")."""
from __future__ import annotations

from typing import Any

import torch

from megatron_cpo.rollout.teachers import TeacherScores
from megatron_cpo.trainer.batch.ragged import RaggedRows
from megatron_cpo.trainer.batch.step_batch import StepBatch
from megatron_cpo.trainer.driver.accumulator import ScoredGroup


def make_step_batch(groups: list[ScoredGroup], kept_ratio: float, hint_builder: Any = None,
                    policy_version: int | None = None, teacher: TeacherScores | None = None) -> StepBatch:
    """Flatten kept groups into a `StepBatch`; `hint_builder(groups)` adds CPO's hinted prompts (its `StepBatch`
    fields); `policy_version`: the weight version that trains it (the token versions travel when every group has
    them); `teacher`: the engine teachers' scores of the rows (distillation)."""
    hints = hint_builder(groups) if hint_builder is not None else {}
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
        policy_version=policy_version, reward_baselines=greedy_baselines(groups),
        teacher_log_probs=teacher.log_probs if teacher is not None else None,
        teacher_topk_ids=teacher.topk_ids if teacher is not None else None,
        teacher_topk_log_probs=teacher.topk_log_probs if teacher is not None else None)


def greedy_baselines(groups: list[ScoredGroup]) -> torch.Tensor | None:
    """ReMax: every response's baseline, its prompt's greedy answer's score [N]; None unless every group has one."""
    if any(g.greedy_score is None for g in groups):
        return None
    return torch.cat([torch.full((g.n,), g.greedy_score) for g in groups])


def batch_loss_mask(groups: list[ScoredGroup]) -> RaggedRows | None:
    """The kept groups' loss masks as one ragged tensor (a group without one: all 1); None when no group has one."""
    if all(g.loss_mask is None for g in groups):
        return None
    return RaggedRows.cat([g.loss_mask if g.loss_mask is not None else
                           RaggedRows(torch.ones_like(g.ragged()[0].values), g.ragged()[0].offsets) for g in groups])
