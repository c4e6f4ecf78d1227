"""The actor's loss function for Megatron's schedule: what one optimizer step computes on each micro-batch's forward.

`PolicyLossStep` is called once per micro-batch with the forward's log-probs and entropy, a `StudentScorer` of other
ids at the same positions (distillation's top-k losses) and its `PolicyMicroBatch`: on-policy it shapes the
micro-batch's advantages from that forward (trainer/workers/shaping.py), then computes `actor.policy_loss`'s loss
(algorithms/losses.py) over the whole mini-batch's tokens, with distillation's term when on
(trainer/workers/distillation_step.py), and returns the loss the schedule backpropagates with a `LossOutput` (the
metrics, and the per-token tensors the update gathers afterwards).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_cpo.algorithms.config import RolloutCorrectionConfig
from megatron_cpo.algorithms.distillation_config import DistillationLossConfig
from megatron_cpo.algorithms.losses import policy_loss
from megatron_cpo.trainer.config import ActorConfig
from megatron_cpo.trainer.workers.distillation_step import StudentScorer, TeacherSignal, distillation_term
from megatron_cpo.trainer.workers.megatron_model import MicroBatch
from megatron_cpo.trainer.workers.shaping import ResponseShaping, ScoredTokens
from megatron_cpo.trainer.workers.update_guard import FiniteProbe


@dataclass(frozen=True, kw_only=True)
class PolicyMicroBatch(MicroBatch):
    """One micro-batch of an actor update: its rows of the update's per-token inputs [rows, R] (None: not given),
    of the shaping's per-response inputs (on-policy shaping; None: the advantages are final), and for a mixture of
    experts each row's recorded routing to replay or compare (None: none)."""
    advantages: torch.Tensor
    old_log_probs: torch.Tensor | None
    ref_log_probs: torch.Tensor | None
    rollout_log_probs: torch.Tensor | None
    shaping: ResponseShaping | None
    routing: list[torch.Tensor | None] | None
    teacher: TeacherSignal | None = None  # distillation: the teacher's scores of these rows


@dataclass(frozen=True)
class LossOutput:
    """One micro-batch's results (last pipeline stage): the loss's metrics, the forward's log-probs and entropy, and
    the shaping's per-token columns (`ResponseShaping.columns`; empty when it was not shaped here), [rows, R] each."""
    metrics: dict[str, torch.Tensor]
    log_probs: torch.Tensor
    entropy: torch.Tensor
    shaped: tuple[torch.Tensor, ...] = ()

    def columns(self) -> tuple[torch.Tensor, ...]:
        """The per-token tensors the update gathers over micro-batches and ranks, in this order."""
        return (self.log_probs, self.entropy, *self.shaped)


@dataclass(frozen=True)
class PolicyLossStep:
    """The loss of one optimizer step: `config`'s policy loss aggregated over the whole mini-batch (`global_tokens`
    and `global_seqs` on every rank), times `scale` (the schedule divides each micro-batch's loss by this rank's
    micro-batch count, and DDP averages over DP); `probe` sees the log-probs, shaped advantages and loss;
    `generator` draws the loss mode's random choices; `distillation`: verl's distillation term, added to the policy
    loss or replacing it (trainer/workers/distillation_step.py; None: none)."""
    config: ActorConfig
    correction: RolloutCorrectionConfig | None
    probe: FiniteProbe
    generator: torch.Generator
    global_tokens: float
    global_seqs: float
    scale: float
    distillation: DistillationLossConfig | None = None

    def __call__(self, log_probs: torch.Tensor, entropy: torch.Tensor, student: StudentScorer,
                 micro: PolicyMicroBatch) -> tuple[torch.Tensor, LossOutput]:
        device = log_probs.device
        mask = micro.seqs.response_mask().to(device)
        old = micro.old_log_probs.to(device) if micro.old_log_probs is not None else log_probs.detach()
        self.probe.observe("log-probs", log_probs, mask)
        advantages, shaped = self._advantages(micro, ScoredTokens(mask, old, entropy.detach()))
        loss, metrics = policy_loss(
            log_probs, old, advantages, mask, self.config, entropy=entropy,
            ref_log_probs=_on(micro.ref_log_probs, device), rollout_log_probs=_on(micro.rollout_log_probs, device),
            global_tokens=self.global_tokens, global_seqs=self.global_seqs, correction=self.correction,
            generator=self.generator)
        if self.distillation is not None and micro.teacher is not None:
            teacher = micro.teacher.map_rows(lambda tensor: tensor.to(device))
            loss, distilled = distillation_term(log_probs, old, mask, teacher, self.distillation,
                                                self.config.loss_agg_mode, loss, self.global_tokens, self.global_seqs,
                                                student)
            metrics.update(distilled)
        self.probe.observe("loss", loss)
        output = LossOutput({name: torch.tensor(float(value)) for name, value in metrics.items()},
                            log_probs.detach(), entropy.detach(), shaped)
        return loss * self.scale, output

    def _advantages(self, micro: PolicyMicroBatch, tokens: ScoredTokens
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The micro-batch's advantages to train on, and the shaping's columns when it shapes them from `tokens`,
        this forward's (on-policy: the old log-probs)."""
        advantages = micro.advantages.to(tokens.mask.device)
        if micro.shaping is None:
            return advantages, ()
        shaping = micro.shaping.map_rows(lambda tensor: tensor.to(tokens.mask.device))
        shaped = shaping.shape(advantages, tokens)
        self.probe.observe("advantages", shaped.advantages, tokens.mask)
        return shaped.advantages, shaping.columns(shaped)


def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return tensor.to(device) if tensor is not None else None
