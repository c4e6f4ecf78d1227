"""The settings of the algorithms, torch-free so that loading a config imports no torch: `algorithm.*`, RAGEN's rollout
filter (`RolloutFilterConfig`) and DAPO's overlong buffer; the policy loss's are in loss_config.py.

The names each setting accepts are declared here; each variant table lives with its math, and
tests/algorithms/test_variant_names.py checks that every table implements exactly them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_cpo.algorithms.shapers import ADVANTAGE_SHAPERS, AdvantageShaper, CPOConfig, build_shaper
from megatron_cpo.config_checks import check, check_choice

KL_ESTIMATOR_KINDS = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
"""Every KL estimator name (verl's) -> the estimator it is (kl.py); a trailing `+` names the straight-through
variant."""
LOSS_AGGREGATION_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                          "seq-mean-token-sum-norm")
"""`actor.loss_agg_mode` (aggregation.py `LOSS_AGGREGATIONS`)."""
RAGEN_STRATEGY_NAMES = ("top_p", "top_k", "min_p")
"""`rollout.rollout_filter_strategy` besides `none` (filters.py `RAGEN_STRATEGIES`)."""
FILTER_LOSS_SCALING_MODES = ("none", "linear", "sqrt")
"""`actor.filter_loss_scaling` (filters.py `FILTER_LOSS_SCALINGS`)."""


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs of the run. grouped: it compares the responses of a prompt (`rollout.n >=
    2`); critic: a critic's values; greedy_baseline: each prompt's greedy answer, scored (ReMax)."""
    grouped: bool = False
    critic: bool = False
    greedy_baseline: bool = False


ADVANTAGE_ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {
    "grpo": EstimatorNeeds(grouped=True),
    "grpo_passk": EstimatorNeeds(grouped=True),
    "rloo": EstimatorNeeds(grouped=True),
    "opo": EstimatorNeeds(grouped=True),
    "gpg": EstimatorNeeds(grouped=True),
    "reinforce_plus_plus_baseline": EstimatorNeeds(grouped=True),
    "reinforce_plus_plus": EstimatorNeeds(),
    "remax": EstimatorNeeds(greedy_baseline=True),
    "gae": EstimatorNeeds(critic=True),
}
"""`algorithm.adv_estimator` (advantages.py `ADVANTAGE_ESTIMATORS`, docs/algorithms.md) -> what it needs."""
ESTIMATOR_ALIASES = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
"""verl's vectorised implementations of the same estimators."""
CPO_BASE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
"""The group estimators whose advantages CPO's rule shapes (`algorithm.cpo.base_estimator`)."""


def known_kl_kinds() -> list[str]:
    """Every accepted KL `kind`, straight-through variants included."""
    return sorted(KL_ESTIMATOR_KINDS) + sorted(f"{name}+" for name in KL_ESTIMATOR_KINDS)


def check_kl_kind(kind: str) -> None:
    """Raise a clear error for an unknown KL estimator name."""
    if kind.removesuffix("+") not in KL_ESTIMATOR_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {known_kl_kinds()}")


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


IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
VERL_RATIO_RS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}
"""verl's names of the ratio bands (with a single threshold they keep the same tokens)."""
DIVERGENCE_RS = ("token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                 "seq_max_k3")
"""verl's divergence bounds (rollout_correction.py `divergence`)."""
AUTO = "auto"


def _off(value: str | None) -> str | None:
    """YAML's null and the spellings "none" / "null" all mean off."""
    return None if value is None or str(value).lower() in ("none", "null", "") else value


@dataclass
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction` (verl's names; each option: docs/async.md, "The off-policy correction").
    rollout_is: `token`, `sequence`, null or `auto` (token level when training on stale samples, unless the actor's TIS
    already weights the loss); rollout_is_threshold: the truncation C. rollout_rs: a rejection band or one of verl's
    divergence bounds, ends rollout_rs_threshold / _lower. rollout_token_veto_threshold: drop a response with any token
    ratio below it (null: off).
    """
    rollout_is: str | None = AUTO
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None

    def __post_init__(self) -> None:
        prefix = "algorithm.rollout_correction."
        self.rollout_is, self.rollout_rs = _off(self.rollout_is), _off(self.rollout_rs)
        self.rollout_rs = VERL_RATIO_RS.get(self.rollout_rs, self.rollout_rs)
        check(self.rollout_is in (None, AUTO, *IS_LEVELS), f"{prefix}rollout_is={self.rollout_is!r} is unknown; choose "
              "token, sequence, auto (token when training on stale samples) or null (off)")
        check("," not in str(self.rollout_rs), f"{prefix}rollout_rs={self.rollout_rs!r}: combining rejection criteria "
              "(verl's comma-separated list) is not built; choose one")
        check(self.rollout_rs in (None, *RS_LEVELS, *DIVERGENCE_RS), f"{prefix}rollout_rs={self.rollout_rs!r} is "
              f"unknown; choose token, sequence, geometric (ratio bands), one of {', '.join(DIVERGENCE_RS)} "
              "(divergence bounds) or null (off)")
        if self.rollout_rs in DIVERGENCE_RS:
            check(self.rollout_rs_threshold is not None and self.rollout_rs_threshold > 0 and
                  self.rollout_rs_threshold_lower is None, f"{prefix}rollout_rs={self.rollout_rs} bounds a divergence "
                  f"from above: set {prefix}rollout_rs_threshold > 0 (e.g. 0.01) and leave rollout_rs_threshold_lower "
                  "null")
        check(self.rollout_is_threshold > 0, f"{prefix}rollout_is_threshold={self.rollout_is_threshold} must be > 0 "
              "(typical 1.5-5)")
        upper, lower = self.rs_band
        check(self.rollout_rs in DIVERGENCE_RS or (upper > 0 and 0 <= lower < upper),
              f"{prefix}rollout_rs_threshold_lower={lower} and rollout_rs_threshold={upper} must satisfy "
              "0 <= lower < upper (the band of ratios kept)")
        veto = self.rollout_token_veto_threshold
        check(veto is None or 0 < veto < 1, f"{prefix}rollout_token_veto_threshold={veto} must be in (0, 1), e.g. "
              "1e-4, or null")

    @property
    def rs_band(self) -> tuple[float, float]:
        """(upper, lower) ends of the rejection band."""
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return upper, lower

    @property
    def explicit_is(self) -> bool:
        """Whether the importance weights were switched on by name (not by `auto`)."""
        return self.rollout_is in IS_LEVELS

    def resolve(self, max_staleness: int, tis_on: bool) -> RolloutCorrectionConfig | None:
        """The correction a run applies (None: nothing to do): `auto` becomes token-level IS when the samples may
        be stale (`max_staleness` > 0) and the actor's TIS is off, and is off otherwise."""
        level = self.rollout_is
        if level == AUTO:
            level = "token" if max_staleness > 0 and not tis_on else None
        if level is None and self.rollout_rs is None and self.rollout_token_veto_threshold is None:
            return None
        return replace(self, rollout_is=level)


@dataclass
class AlgorithmConfig:
    """Advantage estimator and its shaping: `adv_estimator` names an estimator under verl's names (docs/algorithms.md),
    `cpo` (CPO's rule on `algorithm.cpo.base_estimator`'s advantages, docs/cpo.md) or `gae` (PPO, with a critic).
    `gamma` / `lam`: discount and GAE's lambda. `norm_adv_by_std_in_grpo`: GRPO's std division (false: Dr.GRPO).
    `use_kl_in_reward` (verl) subtracts `kl_ctrl.kl_coef` x the `kl_penalty` estimate of KL(actor || reference) from
    every token's reward (needs the reference). `rollout_correction`: importance weights and rejection against the
    engine's log-probs, on by default when samples may be stale (docs/async.md).
    """
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
        check_choice("algorithm.kl_penalty", self.kl_penalty, tuple(KL_ESTIMATOR_KINDS))
        check_choice("algorithm.adv_estimator", self.adv_estimator,
                     (*ADVANTAGE_ESTIMATOR_NEEDS, *ESTIMATOR_ALIASES, *ADVANTAGE_SHAPERS))
        bases = [*CPO_BASE_ESTIMATORS, *(alias for alias, name in ESTIMATOR_ALIASES.items()
                                        if name in CPO_BASE_ESTIMATORS)]
        check(self.cpo.base_estimator in bases, f"algorithm.cpo.base_estimator={self.cpo.base_estimator!r} cannot "
              "carry CPO's shaping: the rule reads each prompt group's difficulty; choose grpo, rloo or "
              "reinforce_plus_plus_baseline")
        check(0.0 <= self.gamma <= 1.0, f"algorithm.gamma={self.gamma} must be in [0, 1] (1: no discount)")
        check(0.0 <= self.lam <= 1.0, f"algorithm.lam={self.lam} must be in [0, 1] (GAE's lambda)")

    @property
    def estimator_name(self) -> str:
        """The estimator whose advantages the run computes: `algorithm.cpo.base_estimator` under CPO's shaping, else
        `adv_estimator` (verl's aliases resolved)."""
        name = self.cpo.base_estimator if self.adv_estimator in ADVANTAGE_SHAPERS else self.adv_estimator
        return ESTIMATOR_ALIASES.get(name, name)

    @property
    def estimator_needs(self) -> EstimatorNeeds:
        """What that estimator needs of the run."""
        return ADVANTAGE_ESTIMATOR_NEEDS[self.estimator_name]

    @property
    def shaper(self) -> AdvantageShaper:
        """The advantage shaper `adv_estimator` selects; ask it whether hint contexts are needed."""
        return build_shaper(self.adv_estimator, self.cpo)


TOP_P_PROB_MODES = ("linear", "softmax")


RAGEN_FILTER_METRICS = {"reward_std": "std", "reward_variance": "std", "reward_mean": "mean", "reward": "mean",
                        "reward_sum": "sum", "length": "length"}
"""`rollout_filter_metric` (RAGEN's names) -> the group score of `GROUP_SCORES` (RAGEN's `reward_variance` is its
in-group std)."""


@dataclass
class RolloutFilterConfig:
    """RAGEN's rollout filter under RAGEN's names (keys of `actor_rollout_ref.rollout`; each option: docs/filters.md).
    Within every generation batch, rank the groups by `rollout_filter_metric` in the order of `rollout_filter_type` and
    keep those `rollout_filter_strategy` selects with `rollout_filter_value`: `none` (off), `top_p` (by
    `rollout_filter_top_p_prob_mode`, less `rollout_filter_selection_eps`), `top_k` or `min_p`;
    `rollout_filter_include_zero`: whether groups of score 0 may be kept. Bounded as DAPO's filter is.
    """

    rollout_filter_strategy: str = "none"
    rollout_filter_value: float = 1.0
    rollout_filter_type: str = "largest"
    rollout_filter_include_zero: bool = True
    rollout_filter_metric: str = "reward_std"
    rollout_filter_top_p_prob_mode: str = "linear"
    rollout_filter_selection_eps: float = 0.01

    @property
    def rollout_filter_enabled(self) -> bool:
        return self.rollout_filter_strategy != "none"

    @property
    def group_score(self) -> str:
        """The `GROUP_SCORES` entry (filters.py) `rollout_filter_metric` names."""
        return RAGEN_FILTER_METRICS[self.rollout_filter_metric]

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout."
        strategy, value = self.rollout_filter_strategy, self.rollout_filter_value
        if strategy != "none" and strategy not in RAGEN_STRATEGY_NAMES:
            raise ValueError(f"{prefix}rollout_filter_strategy={strategy!r} is not supported; choose one of "
                             f"{', '.join(map(repr, ['none', *RAGEN_STRATEGY_NAMES]))}")
        if self.rollout_filter_type not in ("largest", "smallest"):
            raise ValueError(f"{prefix}rollout_filter_type={self.rollout_filter_type!r} is not supported; choose "
                             "one of 'largest', 'smallest'")
        if self.rollout_filter_metric not in RAGEN_FILTER_METRICS:
            raise ValueError(f"{prefix}rollout_filter_metric={self.rollout_filter_metric!r} is not supported; choose "
                             f"one of {', '.join(map(repr, RAGEN_FILTER_METRICS))} (RAGEN's 'entropy' metrics need a "
                             "trainer forward pass on every generated group and are not offered)")
        if self.rollout_filter_top_p_prob_mode not in TOP_P_PROB_MODES:
            raise ValueError(f"{prefix}rollout_filter_top_p_prob_mode={self.rollout_filter_top_p_prob_mode!r} is not "
                             f"supported; choose one of {', '.join(map(repr, TOP_P_PROB_MODES))}")
        if self.rollout_filter_selection_eps < 0:
            raise ValueError(f"{prefix}rollout_filter_selection_eps={self.rollout_filter_selection_eps} must be >= 0 "
                             "(RAGEN: 0.01)")
        if strategy == "top_p" and not 0.0 < value <= 1.0:
            raise ValueError(f"{prefix}rollout_filter_value={value} must be in (0, 1] for top_p (the probability "
                             "mass to keep)")
        whole = value >= 1 and float(value).is_integer()
        if strategy == "top_k" and not (0.0 < value < 1.0 or whole):
            raise ValueError(f"{prefix}rollout_filter_value={value} must be a whole number >= 1 for top_k (groups to "
                             "keep per generation batch of data.train_batch_size prompts) or a fraction in (0, 1) "
                             "of that batch's groups")
        if strategy == "min_p" and not 0.0 <= value <= 1.0:
            raise ValueError(f"{prefix}rollout_filter_value={value} must be in [0, 1] for min_p (fraction of the best "
                             "score)")


@dataclass
class OverlongBufferConfig:
    """`reward.overlong_buffer.*`, DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`, accepted as
    an alias): a response longer than `data.max_response_length - len` tokens gets
    `-(length - (max - len)) / len * penalty_factor` added to its score, before the group filters and the advantages
    see it (`acc` is unchanged). `log: true` logs `overlong/reward_mean` (mean penalty) and `overlong/frac` (share of
    penalised responses) per step."""
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False

    def __post_init__(self) -> None:
        if self.penalty_factor < 0:
            raise ValueError(f"reward.overlong_buffer.penalty_factor={self.penalty_factor} must be >= 0")
        if self.enable and self.len <= 0:
            raise ValueError(f"reward.overlong_buffer.len={self.len} must be > 0 when the buffer is enabled (tokens "
                             "before data.max_response_length where the penalty ramps up; DAPO uses "
                             "max_response_length / 5)")
