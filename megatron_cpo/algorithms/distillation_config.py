"""On-policy distillation's signal settings, torch-free: verl's `distillation.distillation_loss` section
(`DistillationLossConfig`) and the names of its loss modes with what each needs of the teacher.

The math is distillation.py (which reads this section as it is); the teachers and the rest of `distillation.*` are
rollout/teacher_config.py. Formulas and when to use each mode: docs/distillation.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_cpo.algorithms.config import KL_ESTIMATOR_KINDS
from megatron_cpo.config_checks import check, check_choice


@dataclass(frozen=True)
class DistillationModeRules:
    """What a loss mode needs: `topk` (the teacher's top-k ids and log-probs, and the student's log-probs at those ids
    from the fused lm-head) or a single-sample estimator of the sampled tokens' log-probs; `has_gradient`: whether
    backpropagating it as a loss trains towards the teacher (k1's gradient does not depend on the teacher)."""
    topk: bool = False
    has_gradient: bool = True


DISTILLATION_LOSS_MODES: dict[str, DistillationModeRules] = {
    **{name: DistillationModeRules(has_gradient=KL_ESTIMATOR_KINDS[name] != "k1") for name in KL_ESTIMATOR_KINDS},
    "forward_kl_topk": DistillationModeRules(topk=True),
    "forward_kl_topk_tail": DistillationModeRules(topk=True),
}
"""`distillation.distillation_loss.loss_mode` (verl's names, distillation.py `DISTILLATION_LOSSES`) -> what it needs.
`forward_kl_topk_tail` is verl's open PR #7855 (the top-k forward KL plus one bucket for the mass outside the top-k)."""
DISTILLATION_POLICY_LOSS_MODES = ("vanilla",)
"""`distillation_loss.policy_loss_mode`: verl implements only PPO's clip for the policy-gradient form."""
ADDITIVE_LOSS_MODES = ("k1", "kl")
"""slime's additive form subtracts `opd_kl_coef * (student - teacher)` from the advantages: the k1 estimator."""


def _optional_float(value: float | str | None) -> float | None:
    """YAML's null and the spellings "none" / "null" mean off; anything else is a number."""
    return None if value is None or str(value).lower() in ("none", "null", "") else float(value)


@dataclass
class DistillationLossConfig:
    """verl's `distillation.distillation_loss` (defaults: verl's distillation.yaml), read by distillation.py.

    loss_mode: the per-token divergence D between the student and the teacher: a single-sample estimator of the reverse
        KL on the sampled token (`k1`/`kl`, `abs`, `k2`/`mse`, `k3`/`low_var_kl`), or `forward_kl_topk` over the
        teacher's top `topk` tokens (clamped at 0), or `forward_kl_topk_tail` (that plus the tail bucket; needs
        `log_prob_min_clamp` null; `tail_mass_eps` floors the student's tail mass inside its log).
    use_policy_gradient: true: PPO's clipped objective (`policy_loss_mode` vanilla, `clip_ratio_low/high`, or
        `clip_ratio` where those are null) against the old log-probs with advantage -D per token (on-policy
        distillation as Thinking Machines'; k1 recommended); false: D aggregated with `actor.loss_agg_mode` is the loss
        (GKD; k1 is refused: its gradient ignores the teacher).
    use_task_rewards: add the task's policy loss; the distillation term is then weighted by `distillation_loss_coef`.
    loss_max_clamp: clamp D to [-c, c] per token (null: off); log_prob_min_clamp: floor on the top-k log-probs (null:
        off).
    """
    loss_mode: str = "k3"
    topk: int = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    tail_mass_eps: float = 1e-6

    def __post_init__(self) -> None:
        prefix = "distillation.distillation_loss."
        self.loss_max_clamp = _optional_float(self.loss_max_clamp)
        self.log_prob_min_clamp = _optional_float(self.log_prob_min_clamp)
        self.clip_ratio_low = _optional_float(self.clip_ratio_low)
        self.clip_ratio_high = _optional_float(self.clip_ratio_high)
        check_choice(prefix + "loss_mode", self.loss_mode, tuple(DISTILLATION_LOSS_MODES))
        check_choice(prefix + "policy_loss_mode", self.policy_loss_mode, DISTILLATION_POLICY_LOSS_MODES)
        check(not self.rules.topk or self.topk >= 1, f"{prefix}topk={self.topk} must be >= 1 for loss_mode="
              f"{self.loss_mode} (the teacher's top-k tokens)")
        check(self.loss_max_clamp is None or self.loss_max_clamp > 0,
              f"{prefix}loss_max_clamp={self.loss_max_clamp} must be > 0 (e.g. 10.0) or null")
        check(self.log_prob_min_clamp is None or self.log_prob_min_clamp < 0,
              f"{prefix}log_prob_min_clamp={self.log_prob_min_clamp} must be < 0 (e.g. -10.0) or null")
        check(self.loss_mode != "forward_kl_topk_tail" or self.log_prob_min_clamp is None,
              f"{prefix}loss_mode=forward_kl_topk_tail requires log_prob_min_clamp=null (the tail bucket needs the "
              f"top-k masses unclamped); set {prefix}log_prob_min_clamp=null")
        check(0 < self.tail_mass_eps < 1, f"{prefix}tail_mass_eps={self.tail_mass_eps} must be in (0, 1), e.g. 1e-6")
        check(self.distillation_loss_coef >= 0, f"{prefix}distillation_loss_coef={self.distillation_loss_coef} must "
                                                 "be >= 0")
        low, high = self.clip_range
        check(0 <= low < 1 and high >= 0, f"{prefix}clip_ratio_low={low} must be in [0, 1) and clip_ratio_high={high}"
                                          " >= 0 (PPO's clip range [1 - low, 1 + high])")

    def gradient_problem(self) -> str | None:
        """Why this signal as a loss would not train towards the teacher (k1 without the policy gradient), else None;
        checked by `distillation.*` unless slime's additive form replaces the loss term."""
        if self.use_policy_gradient or self.rules.has_gradient:
            return None
        prefix = "distillation.distillation_loss."
        return (f"{prefix}loss_mode={self.loss_mode} as a loss (use_policy_gradient=false) has a gradient that does "
                f"not depend on the teacher's log-probs; set {prefix}use_policy_gradient=true (k1 as a reward) or "
                "choose k3 / forward_kl_topk")

    @property
    def rules(self) -> DistillationModeRules:
        return DISTILLATION_LOSS_MODES[self.loss_mode]

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high) of the policy-gradient form's clip: `clip_ratio_low/high`, or `clip_ratio` where null."""
        low = self.clip_ratio_low if self.clip_ratio_low is not None else self.clip_ratio
        high = self.clip_ratio_high if self.clip_ratio_high is not None else self.clip_ratio
        return low, high

    @property
    def teacher_topk(self) -> int:
        """The top-k the teacher must return: `topk` for the top-k modes, else 0 (the sampled tokens only)."""
        return self.topk if self.rules.topk else 0
