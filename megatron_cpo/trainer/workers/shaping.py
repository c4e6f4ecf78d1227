"""The shaping half of step 4 (docs/architecture.md, "One RL step"): the selected shaper (`algorithm.adv_estimator`,
e.g. CPO's rule) and the filters' loss scale applied to GRPO's advantages, on whole responses.

Every shaper works per response once the per-response inputs that depend on a prompt's other responses are known
(`AdvantageShaper.response_inputs`, e.g. CPO's difficulty): so when the shaper reads the actor's log-probs and the
update is on-policy (`policy_update.old_log_probs_from_update`), the update's own forward gives them and each
micro-batch is shaped inside it (`MegatronPolicy.update_on_policy`) instead of a separate forward-only pass first;
otherwise the whole batch is shaped before the update. Both compute the same per-response math: the whole-batch call
after such an update reproduces the advantages it trained on, with the step's metrics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_cpo.algorithms.filters import filter_loss_scale, scale_advantages
from megatron_cpo.algorithms.shapers import AdvantageShaper
from megatron_cpo.kernels import hint_mi_signals


@dataclass
class ResponseShaping:
    """The shaper and the filters' loss scale (`actor.filter_loss_scaling` of the batch's `kept_ratio`), with what
    they read per response of the step batch: correctness and prompt group, and which responses were scored under a
    hint (`hinted` [N]) with those log-probs (`hint_log_probs` [N, R], 0 on the other rows, whose plain log-probs
    stand in for them)."""
    shaper: AdvantageShaper
    correct: torch.Tensor
    group: torch.Tensor
    hinted: torch.Tensor
    hint_log_probs: torch.Tensor
    kept_ratio: float
    loss_scaling: str

    def row_inputs(self) -> dict[str, torch.Tensor]:
        """Per-response tensors (rows first) for `__call__`: each micro-batch takes its rows of them."""
        return {**self.shaper.response_inputs(self.correct, self.group), "hinted": self.hinted,
                "hint_log_probs": self.hint_log_probs}

    def __call__(self, advantages: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor, entropy: torch.Tensor,
                 rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The advantages to train on of some whole responses: their GRPO advantages, mask, log-probs and entropy
        [rows, R], and their rows of `row_inputs()`."""
        inputs = dict(rows)
        hinted, hint_log_probs = inputs.pop("hinted"), inputs.pop("hint_log_probs")
        hint_log_probs, signals = self._hint(mask, log_probs, entropy, hinted, hint_log_probs)
        shaped = self.shaper.shape_rows(advantages, mask=mask, log_probs=log_probs, entropy=entropy,
                                        hint_log_probs=hint_log_probs, signals=signals, **inputs)
        return scale_advantages(shaped, self.kept_ratio, self.loss_scaling)

    def whole_batch(self, advantages: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor | None,
                    entropy: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """The whole batch's advantages to train on, and the shaper's and the loss scale's metrics."""
        hint_log_probs, signals = self._hint(mask, log_probs, entropy, self.hinted, self.hint_log_probs)
        shaped, metrics = self.shaper.shape(advantages, mask=mask, correct=self.correct, group=self.group,
                                            log_probs=log_probs, entropy=entropy, hint_log_probs=hint_log_probs,
                                            signals=signals, hinted=self.hinted)
        metrics["filter/loss_scale"] = filter_loss_scale(self.kept_ratio, self.loss_scaling)
        return scale_advantages(shaped, self.kept_ratio, self.loss_scaling), metrics

    def _hint(self, mask, log_probs, entropy, hinted, hint_log_probs):
        """The hinted log-probs (the plain ones on rows not scored under a hint) and their signals; (None, None)
        for a shaper that reads no hint."""
        if not self.shaper.needs_hint_contexts:
            return None, None
        hint_log_probs = torch.where(hinted[:, None].to(log_probs.device), hint_log_probs.to(log_probs.device),
                                     log_probs)
        return hint_log_probs, hint_mi_signals(log_probs, hint_log_probs, entropy, mask)
