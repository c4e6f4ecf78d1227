"""The batch one RL step trains on, as rank 0 builds it from the kept groups (`driver/batching.py`) and
`collectives.broadcast_batch` sends it to every rank (step 2 of docs/architecture.md's "One RL step")."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_cpo.trainer.batch.ragged import RaggedRows


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
    hint_prompt_ids: RaggedRows | None = None  # CPO: the hinted prompts of the rows `has_hint` marks, in row order
    has_hint: torch.Tensor | None = None  # [N] bool: the responses scored under a hint (data/hints.py, the shaper's)
    hints_truncated: int = 0
    hint_metrics: dict[str, float] | None = None  # cpo/hint_source/<key> counts (data.hint_key)
    loss_mask: RaggedRows | None = None  # multi-turn: 1 on sampled, 0 on observation tokens (None: all sampled)
    policy_versions: RaggedRows | None = None  # the weight version that sampled each response token
    policy_version: int | None = None  # the version of the weights that train this batch
    reward_baselines: torch.Tensor | None = None  # ReMax: each response's prompt's greedy answer's score [N]
    # distillation's engine teachers (trainer/driver/teacher_feed.py): each response token's log-prob under its teacher
    # [N, longest response], and for the top-k losses the teacher's k best ids [N, longest, k] with their log-probs
    teacher_log_probs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_log_probs: torch.Tensor | None = None

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
