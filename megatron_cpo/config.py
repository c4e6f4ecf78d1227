"""One typed configuration tree for a training run, with verl-compatible dotted names.

A run is described by a YAML file whose nesting follows verl's (`data.train_batch_size`,
`actor_rollout_ref.rollout.n`, `algorithm.filter_groups.enable`, ...) plus dotted overrides on the command line
(`actor_rollout_ref.actor.optim.lr=1e-5`). Each dataclass validates itself in `__post_init__`; cross-field checks
live in `Config.__post_init__`. Every error names the offending value and says how to fix it.

Accepted aliases (the seeds' names) are rewritten to the canonical names when the file is loaded, see `ALIASES`.
Parsing, coercion and building live in `config_loader.py`; `load_config` / `build_config` are its entry points.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_cpo.algorithms.cpo import known_rules
from megatron_cpo.algorithms.kl import known_kl_kinds
from megatron_cpo.config_loader import ConfigError, ConfigLoader, Resolved, known_names, parse_override  # noqa: F401
from megatron_cpo.data.hint_keys import DEFAULT_HINT_KEYS, check_hint_keys
from megatron_cpo.rewards.remote import RemoteRewardConfig
from megatron_cpo.verl_compat import VERL_ALIASES, VERL_MOVED_HINTS, VERL_MUST_EQUAL, VERL_NO_OP_KEYS


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    _check(value in choices, f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}")


@dataclass
class DataConfig:
    """Datasets (verl parquet schema) and batch geometry.

    `train_batch_size` is in prompts: every step trains on exactly `train_batch_size * rollout.n` responses.
    `hint_key`: where CPO reads the worked solution it shows as a hint, first non-empty wins (docs/data.md).
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
    prompt_key: str = "prompt"
    truncation: str = "error"
    filter_overlong_prompts: bool = False
    gen_batch_size: int = 0

    def __post_init__(self) -> None:
        self.train_files = [f for entry in self.train_files for f in str(entry).split(",") if f]
        self.val_files = [f for entry in self.val_files for f in str(entry).split(",") if f]
        _check_choice("data.truncation", self.truncation, ("error", "left", "right"))
        _check(self.gen_batch_size == 0 or self.gen_batch_size >= self.train_batch_size,
               f"data.gen_batch_size={self.gen_batch_size} is below data.train_batch_size={self.train_batch_size}; "
               "raise it (verl's DAPO uses 3 x train_batch_size) or set 0")
        _check(self.train_batch_size >= 1, f"data.train_batch_size={self.train_batch_size} must be >= 1")
        _check(self.val_max_samples == -1 or self.val_max_samples >= 1, f"data.val_max_samples="
               f"{self.val_max_samples} must be >= 1, or -1 to validate on every row of data.val_files")
        try:
            check_hint_keys(self.hint_key)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        _check(self.max_prompt_length >= 1, f"data.max_prompt_length={self.max_prompt_length} must be >= 1")
        _check(self.max_response_length >= 1, f"data.max_response_length={self.max_response_length} must be >= 1")


@dataclass
class ModelConfig:
    """The HF model directory the actor, the reference and the rollout engines start from.

    `use_fused_kernels` (verl's name) computes the actor's and the reference's log-probs and entropy from the final
    hidden states and the vocab-parallel lm-head weight in one kernel, so the `[tokens, vocab]` logits are never
    materialised (the memory that dominates at long responses and a 152k vocabulary); the results are the same.
    """
    path: str = ""
    use_fused_kernels: bool = False


@dataclass
class OptimConfig:
    """Adam with linear warm-up then constant / linear / cosine decay, and global-norm gradient clipping."""
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        _check(len(self.betas) == 2, f"actor_rollout_ref.actor.optim.betas={list(self.betas)} must hold two numbers "
                                     "(Adam's beta1, beta2), e.g. [0.9,0.999]")
        _check(self.lr > 0, f"actor_rollout_ref.actor.optim.lr={self.lr} must be > 0")
        _check(0 <= self.min_lr <= self.lr, f"actor_rollout_ref.actor.optim.min_lr={self.min_lr} must be in [0, lr]")
        _check(self.lr_warmup_steps >= 0, f"actor_rollout_ref.actor.optim.lr_warmup_steps={self.lr_warmup_steps} "
                                          "must be >= 0")
        _check_choice("actor_rollout_ref.actor.optim.lr_decay_style", self.lr_decay_style,
                      ("constant", "linear", "cosine"))
        _check(self.clip_grad > 0, f"actor_rollout_ref.actor.optim.clip_grad={self.clip_grad} must be > 0")


@dataclass
class MegatronConfig:
    """Model parallelism of the trainer; data parallelism is what remains of the world size."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    use_distributed_optimizer: bool = True
    params_dtype: str = "float32"

    def __post_init__(self) -> None:
        _check(self.tensor_model_parallel_size >= 1, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size="
                                                     f"{self.tensor_model_parallel_size} must be >= 1")
        _check(self.pipeline_model_parallel_size >= 1, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="
                                                       f"{self.pipeline_model_parallel_size} must be >= 1")
        _check_choice("actor_rollout_ref.actor.megatron.params_dtype", self.params_dtype,
                      ("float32", "bfloat16", "float16"))


CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass
class CheckpointContentsConfig:
    """verl's `actor_rollout_ref.actor.checkpoint.save_contents`: what each checkpoint holds. `model`, `optimizer`
    and `extra` (schedule, RNG, data position, run controls) are what `trainer.resume=auto` restores, so they are
    always saved; `hf_model` also writes the actor as a Hugging Face model directory (`step_<k>/huggingface`)."""
    save_contents: list[str] = field(default_factory=lambda: list(CHECKPOINT_CONTENTS))

    def __post_init__(self) -> None:
        name = "actor_rollout_ref.actor.checkpoint.save_contents"
        unknown = [item for item in self.save_contents if item not in CHECKPOINT_CONTENTS]
        _check(not unknown, f"{name}={self.save_contents} holds unknown entries {unknown}; choose from "
                            f"{list(CHECKPOINT_CONTENTS)}")
        missing = [item for item in ("model", "optimizer", "extra") if item not in self.save_contents]
        _check(not missing, f"{name}={self.save_contents} leaves out {missing}: resume needs them; keep "
                            "['model', 'optimizer', 'extra'] and add 'hf_model' to also write a Hugging Face model")

    @property
    def hf_model(self) -> bool:
        return "hf_model" in self.save_contents


@dataclass
class ActorConfig:
    """The policy update: PPO clipping (clip-higher), loss aggregation, KL, entropy, CPO weights.

    `ppo_mini_batch_size` is in prompts like `data.train_batch_size` (one optimizer step per mini-batch);
    `ppo_micro_batch_size_per_gpu` is in responses (one forward/backward per micro-batch).
    `top_entropy_quantile` < 1 (ms-swift's entropy mask) trains the policy gradient only on the tokens whose entropy is
    in that top fraction of the micro-batch; `filter_loss_scaling` (RAGEN: `none`, `linear`, `sqrt`) multiplies the
    advantages by the group filters' kept ratio (see docs/filters.md).
    `use_dynamic_bsz` (verl's dynamic batch size) replaces the fixed micro-batch row count by token budgets: rows are
    split over the data-parallel ranks balanced by tokens, then cut into micro-batches of at most
    `ppo_max_token_len_per_gpu` padded tokens (rows x their own longest prompt + response) for the update, and
    `log_prob_max_token_len_per_gpu` for the actor's and the reference's log-prob passes (verl sets the latter under
    `rollout`/`ref`); the loss is still aggregated over the whole mini-batch, so the update does not change.
    """
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 8
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    top_entropy_quantile: float = 1.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    cpo_lambda: float = 5.0
    pos_alpha: float = 0.05
    neg_alpha: float = 0.1
    filter_loss_scaling: str = "none"
    tis_imp_ratio_cap: float = -1.0
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    log_prob_max_token_len_per_gpu: int = 16384

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.actor."
        _check(self.ppo_mini_batch_size >= 1, f"{prefix}ppo_mini_batch_size={self.ppo_mini_batch_size} must be >= 1")
        _check(self.ppo_micro_batch_size_per_gpu >= 1,
               f"{prefix}ppo_micro_batch_size_per_gpu={self.ppo_micro_batch_size_per_gpu} must be >= 1")
        _check(self.ppo_epochs >= 1, f"{prefix}ppo_epochs={self.ppo_epochs} must be >= 1")
        _check(0 <= self.clip_ratio_low < 1, f"{prefix}clip_ratio_low={self.clip_ratio_low} must be in [0, 1)")
        _check(self.clip_ratio_high >= 0, f"{prefix}clip_ratio_high={self.clip_ratio_high} must be >= 0")
        _check(self.clip_ratio_c > 1, f"{prefix}clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound)")
        _check_choice(prefix + "loss_agg_mode", self.loss_agg_mode,
                      ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
        _check_choice(prefix + "kl_loss_type", self.kl_loss_type, tuple(known_kl_kinds()))  # "+": k2's gradient
        _check(self.cpo_lambda >= 1, f"{prefix}cpo_lambda={self.cpo_lambda} must be >= 1 (ratio clamp [1/lam, lam])")
        _check_choice(prefix + "filter_loss_scaling", self.filter_loss_scaling, ("none", "linear", "sqrt"))
        _check(0 < self.top_entropy_quantile <= 1,
               f"{prefix}top_entropy_quantile={self.top_entropy_quantile} must be in (0, 1]: the fraction of "
               "highest-entropy tokens that take part in the policy gradient (1.0 keeps all, e.g. 0.2 for the top 20%)")
        for budget in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
            _check(getattr(self, budget) >= 1, f"{prefix}{budget}={getattr(self, budget)} must be >= 1 (tokens per "
                                               "micro-batch; at least the longest prompt + response)")


RAGEN_FILTER_METRICS = {"reward_std": "std", "reward_variance": "std", "reward_mean": "mean", "reward": "mean",
                        "reward_sum": "sum", "length": "length"}
"""`rollout_filter_metric` -> group score of `algorithms.filters` (RAGEN's `reward_variance` is its in-group std)."""


@dataclass
class RolloutFilterConfig:
    """RAGEN's rollout filter (keys of `actor_rollout_ref.rollout`): within every generation batch of
    `data.train_batch_size` prompts, rank the groups by `rollout_filter_metric` (`reward_std`: in-group reward std,
    RAGEN's variance filter; `reward_mean`) and keep those that `rollout_filter_strategy` selects: `top_p` (smallest
    set of best groups whose scores (`rollout_filter_top_p_prob_mode: linear`, RAGEN's default, less
    `rollout_filter_selection_eps`) or softmax mass (`softmax`) reach `rollout_filter_value` of the total; 1.0 keeps
    all), `top_k` (the `value` best groups, or that fraction of the groups when `value` < 1) or `min_p` (score >=
    value * best score); `none` (the default) turns the filter off. Metrics: `reward_std` (= RAGEN's
    `reward_variance`), `reward_mean` (`reward`), `reward_sum`, `length` (mean response length).
    `rollout_filter_type` `largest` keeps high scores, `smallest` low ones; `rollout_filter_include_zero: false`
    never keeps a group whose score is exactly 0. Groups accumulate until `data.train_batch_size` are kept, bounded
    by `algorithm.filter_groups.max_num_gen_batches` / `on_limit` like DAPO's filter (see docs/filters.md)."""
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

    def check_rollout_filter(self) -> None:
        prefix = "actor_rollout_ref.rollout."
        _check_choice(prefix + "rollout_filter_strategy", self.rollout_filter_strategy,
                      ("none", "top_p", "top_k", "min_p"))
        _check_choice(prefix + "rollout_filter_type", self.rollout_filter_type, ("largest", "smallest"))
        _check(self.rollout_filter_metric in RAGEN_FILTER_METRICS,
               f"{prefix}rollout_filter_metric={self.rollout_filter_metric!r} is not supported; choose one of "
               f"{', '.join(map(repr, RAGEN_FILTER_METRICS))} (RAGEN's 'entropy' metrics need a trainer forward "
               "pass on every generated group and are not offered)")
        _check_choice(prefix + "rollout_filter_top_p_prob_mode", self.rollout_filter_top_p_prob_mode,
                      ("linear", "softmax"))
        _check(self.rollout_filter_selection_eps >= 0,
               f"{prefix}rollout_filter_selection_eps={self.rollout_filter_selection_eps} must be >= 0 (RAGEN: 0.01)")
        value, strategy = self.rollout_filter_value, self.rollout_filter_strategy
        _check(strategy != "top_p" or 0 < value <= 1,
               f"{prefix}rollout_filter_value={value} must be in (0, 1] for top_p (the probability mass to keep)")
        _check(strategy != "top_k" or (value >= 1 and float(value).is_integer()) or 0 < value < 1,
               f"{prefix}rollout_filter_value={value} must be a whole number >= 1 for top_k (groups to keep per "
               "generation batch of data.train_batch_size prompts) or a fraction in (0, 1) of that batch's groups")
        _check(strategy != "min_p" or 0 <= value <= 1,
               f"{prefix}rollout_filter_value={value} must be in [0, 1] for min_p (fraction of the best score)")


@dataclass
class ValKwargsConfig:
    """How validation samples (verl's `rollout.val_kwargs`): greedy unless `do_sample`; with `do_sample`, `n`
    samples per prompt at `temperature` / `top_p` / `top_k`, and the accuracy is their mean (`mean@n`)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout.val_kwargs."
        _check(self.n >= 1, f"{prefix}n={self.n} must be >= 1")
        _check(self.temperature >= 0, f"{prefix}temperature={self.temperature} must be >= 0")
        _check(0 < self.top_p <= 1, f"{prefix}top_p={self.top_p} must be in (0, 1]")
        _check(self.top_k == -1 or self.top_k > 0, f"{prefix}top_k={self.top_k} must be -1 (off) or > 0")


@dataclass
class RolloutConfig(RolloutFilterConfig):
    """vLLM rollout engines and sampling. `max_inflight_prompts` caps the prompts the controller keeps in flight
    (0: 2 * data.train_batch_size); `kv_cache_gib` is each CPU engine's KV cache. `ray_address`: "auto" joins the
    Ray cluster in RAY_ADDRESS when that is set (the SLURM launcher sets it) and otherwise starts a private local one
    (never a cluster merely running on the machine); "local" always starts a private one; "host:port" joins that. `weight_transport`: how weights reach the
    engines after each update: "shm" (/dev/shm buckets, engines on the sending ranks' node), "collective" (a gloo or
    NCCL group between each sending rank and every engine worker, engines on any node), "auto" (collective when the
    Ray cluster or the trainer spans several nodes, else shm); `weight_sync_timeout_s` bounds forming that group and
    each broadcast.
    The `rollout_filter_*` keys are RAGEN's rollout filter (`RolloutFilterConfig`, docs/filters.md); off by default.
    vLLM engine options (GPU engines): `gpu_memory_utilization`, `enable_chunked_prefill`, `max_num_batched_tokens`
    (CPU engines never chunk prefills, see rollout/engine.py). `log_prob_micro_batch_size_per_gpu`: responses per
    forward when the actor recomputes log-probs (0: `actor.ppo_micro_batch_size_per_gpu`)."""
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    num_engines: int = 1
    tensor_model_parallel_size: int = 1
    kv_cache_gib: float = 1.0
    max_inflight_prompts: int = 0
    ray_address: str = "auto"
    weight_transport: str = "auto"
    weight_sync_timeout_s: float = 300.0
    gpu_memory_utilization: float = 0.6
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 8192
    log_prob_micro_batch_size_per_gpu: int = 0
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout."
        _check(0 < self.gpu_memory_utilization <= 1,
               f"{prefix}gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        _check(self.max_num_batched_tokens >= 1, f"{prefix}max_num_batched_tokens={self.max_num_batched_tokens} "
                                                 "must be >= 1")
        _check(self.log_prob_micro_batch_size_per_gpu >= 0, f"{prefix}log_prob_micro_batch_size_per_gpu="
               f"{self.log_prob_micro_batch_size_per_gpu} must be >= 0 (0: actor.ppo_micro_batch_size_per_gpu)")
        _check_choice(prefix + "weight_transport", self.weight_transport, ("auto", "shm", "collective"))
        _check(self.weight_sync_timeout_s > 0,
               f"{prefix}weight_sync_timeout_s={self.weight_sync_timeout_s} must be > 0")
        _check(self.n >= 1, f"{prefix}n={self.n} must be >= 1")
        _check(self.temperature >= 0, f"{prefix}temperature={self.temperature} must be >= 0")
        _check(0 < self.top_p <= 1, f"{prefix}top_p={self.top_p} must be in (0, 1]")
        _check(self.num_engines >= 1, f"{prefix}num_engines={self.num_engines} must be >= 1")
        _check(self.max_inflight_prompts >= 0, f"{prefix}max_inflight_prompts={self.max_inflight_prompts} must be "
                                               ">= 0 (0 means 2 * data.train_batch_size)")


@dataclass
class RefConfig:
    """The frozen reference policy; `sync_ref_model` mixes the actor into it every `ref_model_sync_steps` steps.
    It runs in the actor's TP/PP layout; `log_prob_micro_batch_size_per_gpu` is responses per forward (0: the
    actor's `ppo_micro_batch_size_per_gpu`)."""
    sync_ref_model: bool = False
    ref_model_sync_steps: int = 64
    ref_model_mixup_alpha: float = 0.6
    log_prob_micro_batch_size_per_gpu: int = 0

    def __post_init__(self) -> None:
        _check(self.ref_model_sync_steps >= 1,
               f"actor_rollout_ref.ref.ref_model_sync_steps={self.ref_model_sync_steps} must be >= 1")
        _check(0 <= self.ref_model_mixup_alpha <= 1,
               f"actor_rollout_ref.ref.ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1]")


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


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
        _check_choice("algorithm.filter_groups.metric", self.metric, ("acc", "score", "seq_reward"))
        _check_choice("algorithm.filter_groups.on_limit", self.on_limit, ("error", "use_partial"))


@dataclass
class KLControlConfig:
    """verl's `algorithm.kl_ctrl`: the coefficient of the KL penalty in the reward (`algorithm.use_kl_in_reward`).
    Only `type: fixed` is implemented; `adaptive` is refused rather than run as fixed."""
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1

    def __post_init__(self) -> None:
        _check(self.type == "fixed", f"algorithm.kl_ctrl.type={self.type!r} is not supported (only 'fixed'; an "
                                     "adaptive coefficient is not implemented); set algorithm.kl_ctrl.type=fixed")
        _check(self.kl_coef >= 0, f"algorithm.kl_ctrl.kl_coef={self.kl_coef} must be >= 0")


@dataclass
class AlgorithmConfig:
    """Advantage estimator and CPO shaping; see docs/cpo.md ("Specification") for the rules behind `wrap_method`.
    `use_kl_in_reward` (verl) subtracts `kl_ctrl.kl_coef` x the `kl_penalty` estimate of KL(actor || reference),
    summed over the response, from each response's score before the advantages (needs the reference model)."""
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gold_as_hint: bool = True
    wrap_method: str = "negonly_mi3"
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)

    def __post_init__(self) -> None:
        _check_choice("algorithm.kl_penalty", self.kl_penalty, ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"))
        _check_choice("algorithm.adv_estimator", self.adv_estimator, ("grpo", "cpo"))
        rules = known_rules()
        _check(self.wrap_method in rules, f"algorithm.wrap_method={self.wrap_method!r} is not a CPO shaping rule; "
                                          f"choose one of {rules}")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`, accepted as an alias): a response
    longer than `data.max_response_length - len` tokens gets `-(length - (max - len)) / len * penalty_factor` added
    to its score, before the group filters and the advantages see it (`acc` is unchanged). `log: true` logs
    `overlong/reward_mean` (mean penalty) and `overlong/frac` (share of penalised responses) per step."""
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False

    def __post_init__(self) -> None:
        _check(self.penalty_factor >= 0, f"reward.overlong_buffer.penalty_factor={self.penalty_factor} must be >= 0")
        _check(not self.enable or self.len > 0, f"reward.overlong_buffer.len={self.len} must be > 0 when the buffer "
                                                "is enabled (tokens before data.max_response_length where the "
                                                "penalty ramps up; DAPO uses max_response_length / 5)")


@dataclass
class SandboxConfig:
    """Where model-written code runs (see `megatron_cpo/rewards/sandbox.py`). `namespaces`: an unprivileged uid in
    its own PID/mount/IPC/UTS/network namespaces with rlimits (the isolation boundary; needs root or CAP_SYS_ADMIN);
    `remote`: a SandboxFusion service (`reward.sandbox_fusion.url`); `process`: rlimits and a throwaway uid only,
    NOT a boundary (logs a warning and `reward/sandbox_weak=1`); `auto`: remote when a URL is set, else namespaces
    when this machine allows them, else process; the choice is logged."""
    mode: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("reward.sandbox.mode", self.mode, ("auto", "namespaces", "process", "remote"))


@dataclass
class SandboxFusionConfig:
    """verl's `reward_model.sandbox_fusion` (accepted as an alias): `url` of the `run_code` endpoint (e.g.
    `http://host:8080/run_code`), `max_concurrent` requests per grading worker (the test cases of one sample run in
    parallel), `memory_limit_mb` per program."""
    url: str = ""
    max_concurrent: int = 64
    memory_limit_mb: int = 1024

    def __post_init__(self) -> None:
        _check(self.max_concurrent >= 1, f"reward.sandbox_fusion.max_concurrent={self.max_concurrent} must be >= 1")
        _check(self.memory_limit_mb >= 64, f"reward.sandbox_fusion.memory_limit_mb={self.memory_limit_mb} must be "
                                           ">= 64 (a Python interpreter needs about that)")


@dataclass
class RewardConfig:
    """The reward process pool: how many workers score responses and how long one grading may take.

    `custom_reward_function` ("pkg.module:function" or "file.py:function") grades every response instead of the
    grader registered for its data source; it takes `data_source, solution_str, ground_truth, extra_info` keywords
    and returns a score or a dict with `score` and `acc`. verl's spelling, `custom_reward_function.path` +
    `custom_reward_function.name` at the top level, is accepted too (one or the other).
    `custom_graders` (`{data_source: "pkg.module:fn"}`) adds or replaces the grader of single sources, in the
    trainer (data check) and in every grading worker.
    `remote` (`reward.remote.*`): a reward model served over HTTP whose score replaces or is added to the rule score.
    """
    num_workers: int = 2
    timeout_s: float = 10.0
    custom_reward_function: str = ""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    custom_graders: dict[str, str] = field(default_factory=dict)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)

    def __post_init__(self) -> None:
        _check(self.num_workers >= 1, f"reward.num_workers={self.num_workers} must be >= 1")
        _check(self.timeout_s > 0, f"reward.timeout_s={self.timeout_s} must be > 0")
        for source, path in self.custom_graders.items():
            _check(isinstance(path, str) and ":" in path, f"reward.custom_graders[{source!r}]={path!r} must be "
                   "'pkg.module:function' or 'file.py:function'")
        _check(self.sandbox.mode != "remote" or bool(self.sandbox_fusion.url),
               "reward.sandbox.mode=remote needs reward.sandbox_fusion.url (e.g. http://host:8080/run_code)")


@dataclass
class EarlyStopConfig:
    """Stop when the in-group reward std has collapsed (RAGEN's reward-variance early stop). Every step is one
    attempt whose value is `rollout/in_group_reward_std` over all the groups generated for it (filtered ones
    included); the baseline is the mean over the first `baseline_steps` steps; the run stops, logging
    `train/early_stopped: 1` and the reason, once the last `window` attempts are all below `ratio * baseline`. The
    monitor's state is checkpointed, so a resumed run continues (or stays stopped) where it was."""
    enable: bool = False
    baseline_steps: int = 10
    window: int = 10
    ratio: float = 0.1

    def __post_init__(self) -> None:
        _check(self.baseline_steps >= 1, f"trainer.early_stop.baseline_steps={self.baseline_steps} must be >= 1")
        _check(self.window >= 1, f"trainer.early_stop.window={self.window} must be >= 1 (attempts that must all "
                                 "be low)")
        _check(self.ratio > 0, f"trainer.early_stop.ratio={self.ratio} must be > 0 (e.g. 0.1: stop below 10% of "
                               "the baseline std)")


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
        _check(self.total_epochs >= 1, f"trainer.total_epochs={self.total_epochs} must be >= 1")
        _check(self.total_training_steps >= 0,
               f"trainer.total_training_steps={self.total_training_steps} must be >= 0 (0: run total_epochs)")
        _check_choice("trainer.resume", self.resume, ("auto", "disable"))
        if isinstance(self.logger, str):
            self.logger = [self.logger]
        for sink in self.logger:
            _check_choice("trainer.logger entry", sink, ("console", "jsonl", "tensorboard", "wandb"))
        _check(self.log_completions >= 0, f"trainer.log_completions={self.log_completions} must be >= 0 (rows/step)")


@dataclass
class CustomRewardFunctionConfig:
    """verl's `custom_reward_function`: the Python file `path` and the function `name` in it that grades every
    response, called as `name(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` and returning
    a score or a dict with `score` (and `acc`)."""
    path: str = ""
    name: str = "compute_score"

    def __post_init__(self) -> None:
        _check(not self.path or bool(self.name), "custom_reward_function.name is empty; name the function in "
                                                 f"{self.path!r} that computes the score (verl: compute_score)")

    @property
    def spec(self) -> str:
        """"file.py:function", the form `megatron_cpo.rewards.load_callable` imports; "" when unset."""
        return f"{self.path}:{self.name}" if self.path else ""


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
        _check(not grouped or rollout.n >= 2,
               f"actor_rollout_ref.rollout.n={rollout.n} cannot form groups for {algo.adv_estimator} advantages or "
               "filter_groups; set actor_rollout_ref.rollout.n >= 2")
        _check(self.data.train_batch_size % actor.ppo_mini_batch_size == 0,
               f"data.train_batch_size={self.data.train_batch_size} is not a multiple of "
               f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}; make it one")
        if rollout.max_inflight_prompts:
            _check(rollout.max_inflight_prompts >= self.data.train_batch_size,
                   f"actor_rollout_ref.rollout.max_inflight_prompts={rollout.max_inflight_prompts} is below "
                   f"data.train_batch_size={self.data.train_batch_size}; raise it or set 0 for the default")
        rollout.check_rollout_filter()
        _check(rollout.rollout_filter_strategy != "top_k" or rollout.rollout_filter_value < self.data.train_batch_size,
               f"actor_rollout_ref.rollout.rollout_filter_value={rollout.rollout_filter_value} keeps every group of a "
               f"generation batch of data.train_batch_size={self.data.train_batch_size} prompts; lower it below "
               "train_batch_size, or set rollout_filter_strategy=none")
        overlong = self.reward.overlong_buffer
        _check(not overlong.enable or overlong.len <= self.data.max_response_length,
               f"reward.overlong_buffer.len={overlong.len} exceeds data.max_response_length="
               f"{self.data.max_response_length}; the buffer is the last part of the response budget, make it smaller")
        model_len = self.data.max_prompt_length + self.data.max_response_length
        _check(rollout.enable_chunked_prefill or rollout.max_num_batched_tokens >= model_len,
               f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is below "
               f"data.max_prompt_length + data.max_response_length = {model_len}, which vLLM needs without chunked "
               "prefill; raise it or set actor_rollout_ref.rollout.enable_chunked_prefill=true")
        _check(self.data.max_prompt_length + self.data.max_response_length <= 1 << 20,
               "data.max_prompt_length + data.max_response_length is implausibly large; check the units (tokens)")
        _check(not (self.custom_reward_function.path and self.reward.custom_reward_function),
               f"both custom_reward_function.path={self.custom_reward_function.path!r} and "
               f"reward.custom_reward_function={self.reward.custom_reward_function!r} are set; keep one")

    @property
    def reward_function_spec(self) -> str:
        """The function that grades every response ("pkg.module:fn" or "file.py:fn"), "" when graders are per
        source: `custom_reward_function.path`/`.name` (verl) or `reward.custom_reward_function`."""
        return self.custom_reward_function.spec or self.reward.custom_reward_function

    @property
    def world_model_parallel_size(self) -> int:
        meg = self.actor_rollout_ref.actor.megatron
        return meg.tensor_model_parallel_size * meg.pipeline_model_parallel_size


# Seed aliases: accepted spellings -> canonical dotted name. Values given under an alias are moved, never duplicated.
ALIASES: dict[str, str] = {
    "algorithm.use_dynamic_sample": "algorithm.filter_groups.enable",
    "algorithm.dynamic_sample_max_gen_batches": "algorithm.filter_groups.max_num_gen_batches",
    "trainer.resume_mode": "trainer.resume",
    **{f"reward_model.overlong_buffer.{key}": f"reward.overlong_buffer.{key}"
       for key in ("enable", "len", "penalty_factor", "log")},
    **{f"reward_model.sandbox_fusion.{key}": f"reward.sandbox_fusion.{key}"
       for key in ("url", "max_concurrent", "memory_limit_mb")},
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
