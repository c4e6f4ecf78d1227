"""The policy loss's settings, torch-free like config.py: `PolicyLossConfig` (the loss part of
`actor_rollout_ref.actor`, which the actor's config extends), its mode `PolicyLossModeConfig` (verl's
`actor.policy_loss`) and what each mode defines (`POLICY_LOSS_MODE_RULES`, keying policy_losses.py's
`POLICY_LOSS_MODES`; tests/algorithms/test_variant_names.py checks both sides), and the TIS settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.algorithms.config import LOSS_AGGREGATION_MODES, check_kl_kind
from megatron_cpo.config_checks import check_choice


@dataclass(frozen=True)
class LossModeRules:
    """What a policy-loss mode defines: the aggregation its objective fixes for the policy-gradient term whatever
    `loss_agg_mode` says, as verl's does (None: `loss_agg_mode`'s; the entropy and KL-loss terms always follow
    `loss_agg_mode`), and whether it clips the ratio to [1 - clip_ratio_low, 1 + clip_ratio_high] (then
    clip_ratio_low must stay below 1)."""
    policy_aggregation: str | None = None
    ratio_clip: bool = True


SEQUENCE_MEAN = "seq-mean-token-mean"
POLICY_LOSS_MODE_RULES: dict[str, LossModeRules] = {
    "vanilla": LossModeRules(),
    "gspo": LossModeRules(SEQUENCE_MEAN),
    "sapo": LossModeRules(SEQUENCE_MEAN, ratio_clip=False),
    "cispo": LossModeRules(ratio_clip=False),
    "geo_mean": LossModeRules(SEQUENCE_MEAN, ratio_clip=False),  # one loss per sequence: the mean over responses
    "gpg": LossModeRules(ratio_clip=False),
    "clip_cov": LossModeRules(),
    "kl_cov": LossModeRules(ratio_clip=False),
}
"""`actor.policy_loss.loss_mode` (policy_losses.py `POLICY_LOSS_MODES`, docs/algorithms.md) -> what it defines."""


TIS_LEVELS = ("token", "sequence")


@dataclass
class TISConfig:
    """Truncated importance sampling on the policy loss.

    level: `token` truncates each token's ratio; `sequence` truncates the product of a response's token ratios.
    threshold: the truncation C (weights are min(ratio, C)); 2.0 is the value the TIS authors recommend.
    """

    level: str = "token"
    threshold: float = 2.0

    def __post_init__(self) -> None:
        if self.level not in TIS_LEVELS:
            raise ValueError(f"tis.level={self.level!r} is unknown; choose one of {list(TIS_LEVELS)}")
        if not self.threshold > 0:
            raise ValueError(f"tis.threshold={self.threshold} must be > 0 (typical values 1.5 to 5)")


def _sapo_problems(config: PolicyLossConfig) -> list[str]:
    return [f"actor_rollout_ref.actor.{name}={getattr(config, name)} must be > 0 (SAPO's gate temperature)"
            for name in ("tau_pos", "tau_neg") if getattr(config, name) <= 0]


def _clip_cov_problems(config: PolicyLossConfig) -> list[str]:
    loss, prefix = config.policy_loss, "actor_rollout_ref.actor.policy_loss."
    problems = [] if loss.clip_cov_ratio > 0 else [f"{prefix}clip_cov_ratio={loss.clip_cov_ratio} must be > 0 (e.g. "
                                                   "0.0002)"]
    if loss.clip_cov_lb >= loss.clip_cov_ub:
        problems.append(f"{prefix}clip_cov_lb={loss.clip_cov_lb} must be below clip_cov_ub={loss.clip_cov_ub}")
    return problems


def _kl_cov_problems(config: PolicyLossConfig) -> list[str]:
    loss, prefix = config.policy_loss, "actor_rollout_ref.actor.policy_loss."
    problems = [] if loss.kl_cov_ratio > 0 else [f"{prefix}kl_cov_ratio={loss.kl_cov_ratio} must be > 0 (e.g. "
                                                 "0.0002)"]
    if loss.ppo_kl_coef < 0:
        problems.append(f"{prefix}ppo_kl_coef={loss.ppo_kl_coef} must be >= 0")
    return problems


LOSS_MODE_CHECKS = {"sapo": _sapo_problems, "clip_cov": _clip_cov_problems, "kl_cov": _kl_cov_problems}
"""The loss modes whose own settings have bounds -> their problems with a config (messages naming key and fix)."""


@dataclass
class PolicyLossModeConfig:
    """verl's `actor_rollout_ref.actor.policy_loss`: the mode of the policy-gradient term (policy_losses.py,
    docs/algorithms.md) and the settings of Clip-Cov and KL-Cov.

    loss_mode: vanilla (PPO's clip), gspo, sapo, cispo, geo_mean (GMPO), gpg, clip_cov or kl_cov.
    clip_cov_ratio / clip_cov_lb / clip_cov_ub: the fraction of tokens Clip-Cov may detach, among those whose
        advantage-log-prob covariance lies in (lb, ub).
    kl_cov_ratio / ppo_kl_coef: the fraction of highest-covariance tokens KL-Cov penalises, and the penalty's weight.
    """
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    def __post_init__(self) -> None:
        check_choice("actor_rollout_ref.actor.policy_loss.loss_mode", self.loss_mode, tuple(POLICY_LOSS_MODE_RULES))

    @property
    def rules(self) -> LossModeRules:
        return POLICY_LOSS_MODE_RULES[self.loss_mode]


@dataclass
class PolicyLossConfig:
    """Everything that selects the policy-loss variant, under verl's names. The actor's config
    (`actor_rollout_ref.actor`, trainer/config.py) extends this class, so the trainer passes it as is.
    GRPO: the defaults; DAPO: `clip_ratio_high=0.28`, `loss_agg_mode="token-mean"`; Dr.GRPO:
    `loss_agg_mode="seq-mean-token-sum-norm"`.

    policy_loss: the mode of the policy-gradient term and its settings (`PolicyLossModeConfig`).
    clip_ratio_low / clip_ratio_high: the clip range [1 - low, 1 + high] of the modes that clip the ratio (GSPO's
    paper uses 3e-4 / 4e-4; GMPO clips the log-ratio to [-low, high]; CISPO accepts low >= 1: no lower clip).
    clip_ratio_c: dual-clip bound for negative advantages (> 1; vanilla only).
    loss_agg_mode: one of LOSS_AGGREGATION_MODES (gspo, sapo and geo_mean aggregate their policy-gradient term with
    seq-mean-token-mean whatever it says, as verl; `policy_aggregation`).
    tau_pos / tau_neg: SAPO's gate temperatures for positive / other advantages.
    entropy_coeff: weight of the entropy bonus (subtracted from the loss); needs `entropy`.
    top_entropy_quantile (ms-swift's entropy mask): keep only that top fraction of tokens by entropy in the
    policy-gradient term (1.0 = all).
    use_kl_loss / kl_loss_coef / kl_loss_type: KL(policy || reference) as a loss term; needs `ref_log_probs`.
    tis_imp_ratio_cap (verl's name): > 0 turns on token-level truncated importance sampling against the rollout
    engine's log-probs, truncated at this cap; needs them. <= 0: off.
    """

    policy_loss: PolicyLossModeConfig = field(default_factory=PolicyLossModeConfig)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    entropy_coeff: float = 0.0
    top_entropy_quantile: float = 1.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    tis_imp_ratio_cap: float = -1.0

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.actor."
        rules, mode = self.policy_loss.rules, self.policy_loss.loss_mode
        if self.clip_ratio_low < 0 or (rules.ratio_clip and self.clip_ratio_low >= 1):
            raise ValueError(f"{prefix}clip_ratio_low={self.clip_ratio_low} must be in [0, 1) (the ratio's lower "
                             f"clip 1 - low of policy_loss.loss_mode={mode})")
        if self.clip_ratio_high < 0:
            raise ValueError(f"{prefix}clip_ratio_high={self.clip_ratio_high} must be >= 0")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"{prefix}clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound; default 3.0)")
        if self.loss_agg_mode not in LOSS_AGGREGATION_MODES:
            raise ValueError(f"{prefix}loss_agg_mode={self.loss_agg_mode!r} is not supported; choose one of "
                             f"{', '.join(map(repr, LOSS_AGGREGATION_MODES))}")
        for problem in LOSS_MODE_CHECKS.get(mode, lambda config: [])(self):
            raise ValueError(problem)
        try:
            check_kl_kind(self.kl_loss_type)  # "+": k2's gradient
        except ValueError as error:
            raise ValueError(f"{prefix}kl_loss_type={self.kl_loss_type!r}: {error}") from None
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"{prefix}top_entropy_quantile={self.top_entropy_quantile} must be in (0, 1]: the "
                             "fraction of highest-entropy tokens that take part in the policy gradient (1.0 keeps "
                             "all, e.g. 0.2 for the top 20%)")

    @property
    def policy_aggregation(self) -> str:
        """How the policy-gradient term is aggregated: the mode's own (GSPO, SAPO, GMPO), else `loss_agg_mode`."""
        return self.policy_loss.rules.policy_aggregation or self.loss_agg_mode

    def aggregation_note(self) -> str:
        """The one line saying how a mode that fixes its aggregation aggregates ("" for the others)."""
        if self.policy_loss.rules.policy_aggregation is None:
            return ""
        return (f"policy_loss.loss_mode={self.policy_loss.loss_mode} aggregates its policy-gradient term with "
                f"{self.policy_aggregation}, as verl does whatever loss_agg_mode says; the entropy and KL-loss terms "
                f"use actor_rollout_ref.actor.loss_agg_mode={self.loss_agg_mode}")

    @property
    def tis(self) -> TISConfig | None:
        """Token-level TIS at `tis_imp_ratio_cap`, or None when it is off."""
        return TISConfig(level="token", threshold=self.tis_imp_ratio_cap) if self.tis_imp_ratio_cap > 0 else None
