"""One typed configuration tree for a training run, with verl-compatible dotted names.

A run is described by a YAML file whose nesting follows verl's (`data.train_batch_size`,
`actor_rollout_ref.rollout.n`, `algorithm.filter_groups.enable`, ...) plus dotted overrides on the command line
(`actor_rollout_ref.actor.optim.lr=1e-5`). Each dataclass validates itself in `__post_init__`; cross-field checks
live in `Config.__post_init__`. Every error names the offending value and says how to fix it.

Accepted aliases (the seeds' names) are rewritten to the canonical names when the file is loaded, see `ALIASES`.
Parsing, coercion and building live in `config_loader.py`; `load_config` / `build_config` are its entry points. The
`actor_rollout_ref.*` and `reward.*` sections live in `configs/` and are re-exported here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_cpo.algorithms.filters import EarlyStopConfig  # noqa: F401  (trainer.early_stop: the monitor's config)
from megatron_cpo.algorithms.shapers import ADVANTAGE_SHAPERS, AdvantageShaper, CPOConfig, build_shaper
from megatron_cpo.config_loader import ConfigError, ConfigLoader, Resolved, known_names, parse_override  # noqa: F401
from megatron_cpo.configs.actor_rollout_ref import (  # noqa: F401  (sections re-exported: one import point)
    CHECKPOINT_CONTENTS, ActorConfig, ActorRolloutRefConfig, CheckpointContentsConfig,
    MegatronConfig, ModelConfig, OptimConfig, RefConfig, RolloutConfig, RolloutFilterConfig, ValKwargsConfig)
from megatron_cpo.configs.checks import check, check_choice
from megatron_cpo.configs.reward import (  # noqa: F401
    CustomRewardFunctionConfig, OverlongBufferConfig, RewardConfig, SandboxConfig)
from megatron_cpo.data.hint_keys import DEFAULT_HINT_KEYS, check_hint_keys
from megatron_cpo.data.hints import DEFAULT_INSTRUCTION
from megatron_cpo.verl_compat import VERL_ALIASES, VERL_MOVED_HINTS, VERL_MUST_EQUAL, VERL_NO_OP_KEYS


@dataclass
class DataConfig:
    """Datasets (verl parquet schema) and batch geometry.

    `train_batch_size` is in prompts: every step trains on exactly `train_batch_size * rollout.n` responses.
    `hint_key`: where CPO reads the worked solution it shows as a hint, first non-empty wins (docs/data.md);
    `hint_instruction`: what the hint context's second user turn asks after repeating the question (docs/cpo.md;
    the default asks for a `\\boxed{}` answer, which a task graded on another format should change).
    `train_files` / `val_files` are lists of parquet paths (a single path, `a,b` or verl's `[a,b]` all work).
    `prompt_key` is the column holding the chat messages; prompts longer than `max_prompt_length` are dropped
    (`filter_overlong_prompts`) or cut (`truncation: left|right`; `error` stops with the row named).
    `gen_batch_size` (verl's DAPO): prompts per generation batch, the unit `algorithm.filter_groups.max_num_gen_batches`
    counts in (0: `train_batch_size`).
    `val_max_samples` (verl): validate on the first this many rows of `val_files` (-1: all of them).
    """
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    train_batch_size: int = 8
    max_prompt_length: int = 128
    max_response_length: int = 32
    shuffle: bool = True
    val_max_samples: int = -1
    hint_key: list[str] = field(default_factory=lambda: list(DEFAULT_HINT_KEYS))
    hint_instruction: str = DEFAULT_INSTRUCTION
    prompt_key: str = "prompt"
    truncation: str = "error"
    filter_overlong_prompts: bool = False
    gen_batch_size: int = 0

    def __post_init__(self) -> None:
        self.train_files = [f for entry in self.train_files for f in str(entry).split(",") if f]
        self.val_files = [f for entry in self.val_files for f in str(entry).split(",") if f]
        check_choice("data.truncation", self.truncation, ("error", "left", "right"))
        check(self.gen_batch_size == 0 or self.gen_batch_size >= self.train_batch_size,
               f"data.gen_batch_size={self.gen_batch_size} is below data.train_batch_size={self.train_batch_size}; "
               "raise it (verl's DAPO uses 3 x train_batch_size) or set 0")
        check(self.train_batch_size >= 1, f"data.train_batch_size={self.train_batch_size} must be >= 1")
        check(self.val_max_samples == -1 or self.val_max_samples >= 1, f"data.val_max_samples="
               f"{self.val_max_samples} must be >= 1, or -1 to validate on every row of data.val_files")
        try:
            check_hint_keys(self.hint_key)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        check(self.max_prompt_length >= 1, f"data.max_prompt_length={self.max_prompt_length} must be >= 1")
        check(self.max_response_length >= 1, f"data.max_response_length={self.max_response_length} must be >= 1")

@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop prompts whose responses all got the same `metric`, accumulate until full.

    `max_num_gen_batches` counts prompts requested in units of `data.train_batch_size` (<= 0: no limit). When it is
    reached before the batch is full, `on_limit="error"` stops the run (verl's behaviour) and `"use_partial"` trains
    on the prompts kept so far (seed 001's behaviour).
    """
    enable: bool = False
    metric: str = "acc"
    max_num_gen_batches: int = 0
    on_limit: str = "error"

    def __post_init__(self) -> None:
        check_choice("algorithm.filter_groups.metric", self.metric, ("acc", "score", "seq_reward"))
        check_choice("algorithm.filter_groups.on_limit", self.on_limit, ("error", "use_partial"))


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
    """Advantage estimator and its shaping: `adv_estimator` selects the shaper (`grpo`, or `cpo` with its settings
    under `algorithm.cpo`, see algorithms/shapers.py and docs/cpo.md).
    `use_kl_in_reward` (verl) subtracts `kl_ctrl.kl_coef` x the `kl_penalty` estimate of KL(actor || reference),
    summed over the response, from each response's score before the advantages (needs the reference model)."""
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    cpo: CPOConfig = field(default_factory=CPOConfig)

    def __post_init__(self) -> None:
        check_choice("algorithm.kl_penalty", self.kl_penalty, ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"))
        check_choice("algorithm.adv_estimator", self.adv_estimator, tuple(ADVANTAGE_SHAPERS))

    @property
    def shaper(self) -> AdvantageShaper:
        """The advantage shaper `adv_estimator` selects; ask it whether hint contexts are needed."""
        return build_shaper(self.adv_estimator, self.cpo)

@dataclass
class TrainerConfig:
    """Run length, evaluation, checkpoints, logging.

    `resume="auto"` continues from the newest checkpoint under `default_local_dir` when there is one;
    `early_stop` ends the run when the reward variance collapses. `nnodes` x `n_gpus_per_node` (verl), when set,
    must equal the trainer's world size (torchrun's); 0 leaves it unchecked. `log_verl_metric_names` also logs each
    metric under verl's name (`critic/score/mean`, `response_length/mean`, ...) so verl dashboards keep working.
    `resume="disable"` refuses a `default_local_dir` that holds an earlier run unless `overwrite=true`, which first
    moves that run aside to `<default_local_dir>.archived-<UTC time>` (nothing is deleted). The last step is always
    checkpointed.
    """
    total_epochs: int = 1
    total_training_steps: int = 0
    test_freq: int = -1
    val_before_train: bool = True
    save_freq: int = -1
    default_local_dir: str = "outputs/run"
    resume: str = "auto"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "megatron-cpo"
    experiment_name: str = "run"
    log_completions: int = 0
    seed: int = 1
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    n_gpus_per_node: int = 0
    nnodes: int = 0
    log_verl_metric_names: bool = True
    overwrite: bool = False

    def __post_init__(self) -> None:
        check(self.total_epochs >= 1, f"trainer.total_epochs={self.total_epochs} must be >= 1")
        check(self.total_training_steps >= 0,
               f"trainer.total_training_steps={self.total_training_steps} must be >= 0 (0: run total_epochs)")
        check_choice("trainer.resume", self.resume, ("auto", "disable"))
        if isinstance(self.logger, str):
            self.logger = [self.logger]
        for sink in self.logger:
            check_choice("trainer.logger entry", sink, ("console", "jsonl", "tensorboard", "wandb"))
        check(self.log_completions >= 0, f"trainer.log_completions={self.log_completions} must be >= 0 (rows/step)")

@dataclass
class Config:
    """The whole run."""
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)

    def __post_init__(self) -> None:
        rollout, actor, algo = self.actor_rollout_ref.rollout, self.actor_rollout_ref.actor, self.algorithm
        grouped = algo.filter_groups.enable or algo.adv_estimator in ("grpo", "cpo")
        check(not grouped or rollout.n >= 2,
               f"actor_rollout_ref.rollout.n={rollout.n} cannot form groups for {algo.adv_estimator} advantages or "
               "filter_groups; set actor_rollout_ref.rollout.n >= 2")
        check(self.data.train_batch_size % actor.ppo_mini_batch_size == 0,
               f"data.train_batch_size={self.data.train_batch_size} is not a multiple of "
               f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}; make it one")
        if rollout.max_inflight_prompts:
            check(rollout.max_inflight_prompts >= self.data.train_batch_size,
                   f"actor_rollout_ref.rollout.max_inflight_prompts={rollout.max_inflight_prompts} is below "
                   f"data.train_batch_size={self.data.train_batch_size}; raise it or set 0 for the default")
        check(rollout.rollout_filter_strategy != "top_k" or rollout.rollout_filter_value < self.data.train_batch_size,
               f"actor_rollout_ref.rollout.rollout_filter_value={rollout.rollout_filter_value} keeps every group of a "
               f"generation batch of data.train_batch_size={self.data.train_batch_size} prompts; lower it below "
               "train_batch_size, or set rollout_filter_strategy=none")
        overlong = self.reward.overlong_buffer
        check(not overlong.enable or overlong.len <= self.data.max_response_length,
               f"reward.overlong_buffer.len={overlong.len} exceeds data.max_response_length="
               f"{self.data.max_response_length}; the buffer is the last part of the response budget, make it smaller")
        model_len = self.data.max_prompt_length + self.data.max_response_length
        check(rollout.enable_chunked_prefill or rollout.max_num_batched_tokens >= model_len,
               f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is below "
               f"data.max_prompt_length + data.max_response_length = {model_len}, which vLLM needs without chunked "
               "prefill; raise it or set actor_rollout_ref.rollout.enable_chunked_prefill=true")
        check(self.data.max_prompt_length + self.data.max_response_length <= 1 << 20,
               "data.max_prompt_length + data.max_response_length is implausibly large; check the units (tokens)")
        verl_function = self.custom_reward_function.spec
        check(not verl_function or self.reward.custom_reward_function in ("", verl_function),
               f"both custom_reward_function.path={self.custom_reward_function.path!r} and "
               f"reward.custom_reward_function={self.reward.custom_reward_function!r} are set; keep one")
        if verl_function:  # verl's spelling lands in the reward manager's config, the one place it is read
            self.reward.custom_reward_function = verl_function

    @property
    def reward_function_spec(self) -> str:
        """The function that grades every response ("pkg.module:fn" or "file.py:fn"), "" when graders are per
        source: `custom_reward_function.path`/`.name` (verl) or `reward.custom_reward_function`."""
        return self.reward.custom_reward_function


# Seed aliases: accepted spellings -> canonical dotted name. Values given under an alias are moved, never duplicated.
ALIASES: dict[str, str] = {
    "algorithm.use_dynamic_sample": "algorithm.filter_groups.enable",
    "algorithm.dynamic_sample_max_gen_batches": "algorithm.filter_groups.max_num_gen_batches",
    "trainer.resume_mode": "trainer.resume",
    "algorithm.wrap_method": "algorithm.cpo.wrap_method",
    "algorithm.gold_as_hint": "algorithm.cpo.gold_as_hint",
    **{f"actor_rollout_ref.actor.{key}": f"algorithm.cpo.{key}" for key in ("cpo_lambda", "pos_alpha", "neg_alpha")},
    **{f"reward_model.overlong_buffer.{key}": f"reward.overlong_buffer.{key}"
       for key in ("enable", "len", "penalty_factor", "log")},
    **{f"{section}.sandbox_fusion.{key}": f"reward.sandbox.fusion_{key}"
       for section in ("reward_model", "reward") for key in ("url", "max_concurrent", "memory_limit_mb")},
}
# Seed 001 trained on the partial batch when its limit was reached; its alias keeps that unless on_limit is given.
ALIAS_IMPLIES: dict[str, tuple[str, Any]] = {
    "algorithm.dynamic_sample_max_gen_batches": ("algorithm.filter_groups.on_limit", "use_partial"),
}


# The loader (YAML + dotted overrides -> typed tree) lives in config_loader.py; these names stay importable from here.
_LOADER = ConfigLoader(Config, {**ALIASES, **VERL_ALIASES}, ALIAS_IMPLIES, VERL_NO_OP_KEYS, VERL_MUST_EQUAL,
                       VERL_MOVED_HINTS)
build_config = _LOADER.build
load_config = _LOADER.load
resolve_config = _LOADER.resolve_file
_known_names = known_names


def config_to_dict(config: Config) -> dict:
    """The config as plain nested dicts (for logging and checkpoints)."""
    return dataclasses.asdict(config)

