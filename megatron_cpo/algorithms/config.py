"""`algorithm.*`: the advantage estimator (advantages.py) and its shaping, DAPO's filter-groups, verl's KL-in-reward
settings and the off-policy correction (`rollout_correction`, rollout_correction.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.algorithms.advantages import ADVANTAGE_ESTIMATORS, ESTIMATOR_ALIASES, Estimator, estimator
from megatron_cpo.algorithms.kl import KL_ESTIMATORS
from megatron_cpo.algorithms.rollout_correction import RolloutCorrectionConfig
from megatron_cpo.algorithms.shapers import (ADVANTAGE_SHAPERS, AdvantageShaper, CPOConfig, build_shaper,
                                             shaped_estimator)
from megatron_cpo.config_checks import check, check_choice

FILTER_METRICS = ("acc", "score", "seq_reward")
ON_LIMIT = ("error", "use_partial")


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop prompts whose responses all got the same `metric`, accumulate until full.

    `max_num_gen_batches` counts prompts requested in units of `data.gen_batch_size` (by default
    `data.train_batch_size`; <= 0: no limit); it bounds RAGEN's rollout filter too. When it is reached before the batch
    is full, `on_limit="error"` stops the run (verl's behaviour) and `"use_partial"` trains on the prompts kept so far
    (seed 001's behaviour), as it does when the data runs out.
    """
    enable: bool = False
    metric: str = "acc"
    max_num_gen_batches: int = 0
    on_limit: str = "error"

    def __post_init__(self) -> None:
        check_choice("algorithm.filter_groups.metric", self.metric, FILTER_METRICS)
        check_choice("algorithm.filter_groups.on_limit", self.on_limit, ON_LIMIT)


@dataclass
class KLControlConfig:
    """verl's `algorithm.kl_ctrl`: the coefficient of the KL penalty in the reward (`algorithm.use_kl_in_reward`).
    Only `type: fixed` is implemented; `adaptive` is refused rather than run as fixed."""
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1

    def __post_init__(self) -> None:
        check(self.type == "fixed", f"algorithm.kl_ctrl.type={self.type!r} is not supported (only 'fixed'; an "
                                    "adaptive coefficient is not implemented); set algorithm.kl_ctrl.type=fixed")
        check(self.kl_coef >= 0, f"algorithm.kl_ctrl.kl_coef={self.kl_coef} must be >= 0")


@dataclass
class AlgorithmConfig:
    """Advantage estimator and its shaping: `adv_estimator` names an estimator of advantages.py under verl's names
    (`grpo`, `rloo`, `reinforce_plus_plus`, `remax`, ...; docs/algorithms.md), or `cpo`: CPO's shaping rule on the
    advantages of `algorithm.cpo.base_estimator` (its settings under `algorithm.cpo`, algorithms/shapers.py,
    docs/cpo.md). `gamma` / `lam`: the discount and GAE's lambda (REINFORCE++'s returns; GAE).
    `norm_adv_by_std_in_grpo`: GRPO's and grpo_passk's division by the group's std (false: Dr.GRPO).
    `use_kl_in_reward` (verl) subtracts `kl_ctrl.kl_coef` x the `kl_penalty` estimate of KL(actor || reference)
    from every token's reward (the response's score sits on its last sampled token) before the advantages (needs the
    reference model); the outcome estimators sum these token rewards.
    `rollout_correction` (verl's section): importance weights and rejection against the engine's log-probs, on by
    default when samples may be stale (`async_training.max_staleness` > 0; docs/async.md)."""
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    cpo: CPOConfig = field(default_factory=CPOConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        check_choice("algorithm.kl_penalty", self.kl_penalty, tuple(KL_ESTIMATORS))
        check_choice("algorithm.adv_estimator", self.adv_estimator,
                     (*ADVANTAGE_ESTIMATORS, *ESTIMATOR_ALIASES, *ADVANTAGE_SHAPERS))
        check(not self.estimator.needs_critic, f"algorithm.adv_estimator={self.adv_estimator} needs a critic "
              "(critic.enable / critic.model.path), which is not available in this version; use a critic-free "
              "estimator: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, ... "
              "(docs/algorithms.md)")
        check(0.0 <= self.gamma <= 1.0, f"algorithm.gamma={self.gamma} must be in [0, 1] (1: no discount)")
        check(0.0 <= self.lam <= 1.0, f"algorithm.lam={self.lam} must be in [0, 1] (GAE's lambda)")

    @property
    def estimator(self) -> Estimator:
        """The estimator whose advantages the run computes (`algorithm.cpo.base_estimator` under CPO)."""
        return estimator(shaped_estimator(self.adv_estimator, self.cpo))

    @property
    def shaper(self) -> AdvantageShaper:
        """The advantage shaper `adv_estimator` selects; ask it whether hint contexts are needed."""
        return build_shaper(self.adv_estimator, self.cpo)
