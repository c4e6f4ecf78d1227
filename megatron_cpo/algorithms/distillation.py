"""On-policy distillation's signal, per token and aggregated: the divergence D between the student and a teacher on
the student's own samples, used as a reward (policy gradient) or as a loss, under verl's `distillation_loss` names.

1. D per token (`DISTILLATION_LOSSES`, keyed by `loss_mode`): a single-sample estimator of the reverse KL from the
   sampled tokens' log-probs (kl.py's `kl_penalty`: k1, abs, k2, k3), or the forward KL over the teacher's top-k
   tokens from the student's log-probs at those ids (the fused lm-head gives them, kernels/log_probs.py), clamped at 0;
   or that plus one bucket for the mass outside the top-k (`forward_kl_topk_tail`, verl's open PR #7855).
2. `loss_max_clamp` clamps D to [-c, c]; then either PPO's clipped objective with advantage -D (detached) against the
   old log-probs (`use_policy_gradient`), or D aggregated with `actor.loss_agg_mode` as the loss.
3. `total_loss`: the task's policy loss plus `distillation_loss_coef` times that (`use_task_rewards`), else that alone.
slime's form is `additive_advantages`: the estimator's advantages minus `opd_kl_coef * (student - teacher)` per token.

Everything is vectorised over [N, T] (top-k: [N, T, K]); padding may hold anything, it is zeroed before the
arithmetic. Each equals verl's / slime's code on random inputs (tests/algorithms/test_distillation_vs_verl.py);
formulas in docs/distillation.md. Metric names are verl's (`actor/distillation/...`): means over the valid tokens of
this micro-batch, except `loss_min` / `loss_max` (reduce them with min / max; +inf / -inf when no token is valid).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_cpo.algorithms.aggregation import aggregate_loss
from megatron_cpo.algorithms.distillation_config import DistillationLossConfig
from megatron_cpo.algorithms.kl import kl_penalty
from megatron_cpo.algorithms.policy_losses import clipped_policy_loss

METRIC_PREFIX = "actor/distillation/"
DUAL_CLIP = 3.0  # verl's clip_ratio_c default, which its distillation config does not set


@dataclass(frozen=True)
class TopKInputs:
    """The teacher's top-k per response token and the student's view of the same ids, [N, T, K] each.

    teacher_ids / teacher_log_probs: the teacher's k most likely ids and their log-probs (at temperature 1).
    student_log_probs: the student's full-vocabulary log-probs at `teacher_ids` (differentiable).
    student_ids: the student's own top-k ids (detached), for verl's overlap metrics; None leaves them out.
    """
    teacher_ids: torch.Tensor
    teacher_log_probs: torch.Tensor
    student_log_probs: torch.Tensor
    student_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class DistillationInputs:
    """One micro-batch's student and teacher, response-aligned [N, T]: the student's current log-probs of the sampled
    tokens (differentiable), the response mask, the teacher's log-probs of the sampled tokens (estimator modes) and
    the top-k tensors (top-k modes)."""
    student_log_probs: torch.Tensor
    mask: torch.Tensor
    teacher_log_probs: torch.Tensor | None = None
    topk: TopKInputs | None = None


@dataclass(frozen=True)
class Divergence:
    """D per token [N, T] (before `loss_max_clamp`) and its per-token diagnostics (detached, [N, T])."""
    losses: torch.Tensor
    parts: dict[str, torch.Tensor]


def estimator_divergence(inputs: DistillationInputs, config: DistillationLossConfig) -> Divergence:
    """verl's `kl_penalty(student, teacher, loss_mode)` on the sampled tokens."""
    if inputs.teacher_log_probs is None:
        raise ValueError(f"loss_mode={config.loss_mode} needs the teacher's log-probs of the sampled tokens")
    valid = inputs.mask.bool()
    student = torch.where(valid, inputs.student_log_probs, 0.0)
    teacher = torch.where(valid, inputs.teacher_log_probs.to(student.dtype), 0.0)
    return Divergence(kl_penalty(student, teacher, config.loss_mode), {})


def _topk_terms(inputs: DistillationInputs, log_prob_min_clamp: float | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(teacher log-probs, their probabilities, student log-probs) at the teacher's ids, [N, T, K], clamped from below
    at `log_prob_min_clamp` (the student's clamp stops its gradient), and the masses and overlap per token."""
    topk = inputs.topk
    if topk is None:
        raise ValueError("the top-k loss modes need TopKInputs (the teacher's top-k and the student's log-probs at "
                         "those ids)")
    valid = inputs.mask.bool().unsqueeze(-1)
    dtype = torch.promote_types(topk.student_log_probs.dtype, torch.float32)  # bf16 -> float32, float64 stays
    teacher = torch.where(valid, topk.teacher_log_probs.to(dtype), 0.0)
    student = torch.where(valid, topk.student_log_probs.to(dtype), 0.0)
    if log_prob_min_clamp is not None:
        teacher = teacher.clamp_min(log_prob_min_clamp)
        student = student.clamp_min(log_prob_min_clamp)
    teacher_probs = teacher.exp()
    parts = {"student_mass": student.detach().exp().sum(-1), "teacher_mass": teacher_probs.sum(-1)}
    if topk.student_ids is not None:
        overlap = (topk.teacher_ids.unsqueeze(-1) == topk.student_ids.unsqueeze(-2)).any(-1)
        count = overlap.sum(-1)
        per_id = (teacher_probs * (teacher - student)).detach()
        advantage = (-per_id * overlap).sum(-1) / count.clamp_min(1)
        parts.update(overlap_count=count, overlap_token_advantage=torch.where(count > 0, advantage, 0.0))
    return teacher, teacher_probs, student, parts


def forward_kl_topk(inputs: DistillationInputs, config: DistillationLossConfig) -> Divergence:
    """`sum_k p_k (log p_k - log q_k)` over the teacher's top-k ids (q: the student's full-vocabulary softmax),
    clamped at 0 (the truncated sum can be negative), as verl's Megatron `_VocabParallelKLDivergence`."""
    teacher, teacher_probs, student, parts = _topk_terms(inputs, config.log_prob_min_clamp)
    return Divergence((teacher_probs * (teacher - student)).sum(-1).clamp_min(0.0), parts)


def forward_kl_topk_tail(inputs: DistillationInputs, config: DistillationLossConfig) -> Divergence:
    """The top-k forward KL plus the tail bucket `p_tail (log p_tail - log q_tail)`, p_tail = 1 - sum_k p_k and
    q_tail = max(1 - sum_k q_k, tail_mass_eps): the exact KL of the two distributions coarse-grained to the teacher's
    top-k ids and one bucket for the rest, so never negative and never clamped (verl PR #7855)."""
    teacher, teacher_probs, student, parts = _topk_terms(inputs, None)
    topk_loss = (teacher_probs * (teacher - student)).sum(-1)
    teacher_tail = (1.0 - parts["teacher_mass"]).clamp(0.0, 1.0)
    student_tail = (1.0 - student.exp().sum(-1)).clamp(config.tail_mass_eps, 1.0)
    tiny = torch.finfo(teacher_tail.dtype).tiny
    tail_loss = teacher_tail * (teacher_tail.clamp_min(tiny).log() - student_tail.log())
    parts.update(topk_loss=topk_loss.detach(), tail_loss=tail_loss.detach())
    return Divergence(topk_loss + tail_loss, parts)


DISTILLATION_LOSSES: dict[str, Callable[[DistillationInputs, DistillationLossConfig], Divergence]] = {
    **dict.fromkeys(("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"), estimator_divergence),
    "forward_kl_topk": forward_kl_topk,
    "forward_kl_topk_tail": forward_kl_topk_tail,
}
"""`loss_mode` -> the per-token divergence, keyed by distillation_config.DISTILLATION_LOSS_MODES."""


def _mean(values: torch.Tensor, valid: torch.Tensor) -> float:
    count = int(valid.sum())
    return float(values.detach().double()[valid].sum() / count) if count else 0.0


def divergence_metrics(divergence: Divergence, mask: torch.Tensor, config: DistillationLossConfig
                       ) -> dict[str, float]:
    """verl's per-micro-batch metrics of D (`loss_min`, `loss_max`, `abs_loss` for the estimators) and of the top-k
    modes (student / teacher top-k mass with min and max, overlap with the student's top-k, the tail bucket)."""
    valid = mask.bool()
    losses = divergence.losses.detach().double()[valid]
    metrics = {"loss_min": float(losses.min()) if losses.numel() else float("inf"),
               "loss_max": float(losses.max()) if losses.numel() else float("-inf")}
    parts = divergence.parts
    if not config.rules.topk:
        metrics["abs_loss"] = float(losses.abs().mean()) if losses.numel() else 0.0
    for name in ("student_mass", "teacher_mass") if config.rules.topk else ():
        values = parts[name].double()[valid]
        metrics.update({name: _mean(parts[name], valid),
                        f"{name}_min": float(values.min()) if values.numel() else float("inf"),
                        f"{name}_max": float(values.max()) if values.numel() else float("-inf")})
    if "overlap_count" in parts:
        metrics["overlap_ratio"] = _mean(parts["overlap_count"], valid) / config.topk
        metrics["overlap_token_advantage"] = _mean(parts["overlap_token_advantage"],
                                                   valid & (parts["overlap_count"] > 0))
    if "tail_loss" in parts:
        metrics.update(topk_loss=_mean(parts["topk_loss"], valid), tail_loss=_mean(parts["tail_loss"], valid),
                       teacher_tail_mass=_mean((1.0 - parts["teacher_mass"]).clamp_min(0.0), valid),
                       student_tail_mass=_mean((1.0 - parts["student_mass"]).clamp_min(0.0), valid))
    return metrics


def distillation_loss(inputs: DistillationInputs, old_log_probs: torch.Tensor | None, config: DistillationLossConfig,
                      loss_agg_mode: str, *, global_tokens: float | None = None, global_seqs: float | None = None,
                      weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The distillation term of one micro-batch (this micro-batch's share of the batch's, with the global counts as
    in `aggregate_loss`) and its metrics, verl's `distillation_loss`.

    `old_log_probs` [N, T]: the PPO ratio's denominator (policy-gradient form only). `weights` [N, T]: importance
    weights of the policy-gradient form's per-token losses (verl's `rollout_is_weights`; None: 1).
    """
    divergence = DISTILLATION_LOSSES[config.loss_mode](inputs, config)
    metrics = divergence_metrics(divergence, inputs.mask, config)
    losses = divergence.losses
    if config.loss_max_clamp is not None:
        losses = losses.clamp(-config.loss_max_clamp, config.loss_max_clamp)
    if config.use_policy_gradient:
        if old_log_probs is None:
            raise ValueError("use_policy_gradient=true needs the old log-probs (the PPO ratio's denominator)")
        low, high = config.clip_range
        pg_losses, pg_metrics = clipped_policy_loss(inputs.student_log_probs, old_log_probs, -losses.detach(),
                                                    inputs.mask, low, high, DUAL_CLIP)
        if weights is not None:
            pg_losses = pg_losses * weights
        loss = aggregate_loss(pg_losses, inputs.mask, loss_agg_mode, global_tokens, global_seqs)
        metrics.update(pg_metrics)
    else:
        loss = aggregate_loss(losses, inputs.mask, loss_agg_mode, global_tokens, global_seqs)
    metrics["loss"] = float(loss.detach())
    return loss, {METRIC_PREFIX + name: value for name, value in metrics.items()}


def total_loss(task_loss: torch.Tensor | None, distill_loss: torch.Tensor, config: DistillationLossConfig
               ) -> torch.Tensor:
    """verl's combination: `task + distillation_loss_coef * distillation` with `use_task_rewards`, else the
    distillation term alone (the task loss is neither needed nor added)."""
    if not config.use_task_rewards:
        return distill_loss
    if task_loss is None:
        raise ValueError("use_task_rewards=true needs the task's policy loss")
    return task_loss + config.distillation_loss_coef * distill_loss


def additive_advantages(advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                        mask: torch.Tensor, coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """slime's on-policy distillation (`--use-opd`): `A - coef * (log pi_student - log pi_teacher)` per token, after
    the advantage estimator; `student_log_probs` are the old (recomputed) ones. Padding gets 0. The metric is the mean
    over responses of each response's mean reverse KL (slime's `opd_reverse_kl`)."""
    valid = mask.bool()
    reverse_kl = torch.where(valid, student_log_probs - teacher_log_probs.to(student_log_probs.dtype), 0.0)
    shaped = torch.where(valid, advantages - coef * reverse_kl, 0.0)
    lengths = valid.sum(-1)
    per_response = reverse_kl.sum(-1) / lengths.clamp_min(1)
    nonempty = lengths > 0
    mean = float(per_response[nonempty].mean()) if bool(nonempty.any()) else 0.0
    return shaped, {"distillation/opd_reverse_kl": mean}
