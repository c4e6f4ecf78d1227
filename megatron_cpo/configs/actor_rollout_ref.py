"""`actor_rollout_ref.*`: the model, the actor (optimizer, Megatron layout, loss), the rollout engines (sampling,
RAGEN's rollout filter, validation sampling) and the reference, under verl's names."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.algorithms.kl import known_kl_kinds
from megatron_cpo.configs.checks import check, check_choice


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
        check(len(self.betas) == 2, f"actor_rollout_ref.actor.optim.betas={list(self.betas)} must hold two numbers "
                                     "(Adam's beta1, beta2), e.g. [0.9,0.999]")
        check(self.lr > 0, f"actor_rollout_ref.actor.optim.lr={self.lr} must be > 0")
        check(0 <= self.min_lr <= self.lr, f"actor_rollout_ref.actor.optim.min_lr={self.min_lr} must be in [0, lr]")
        check(self.lr_warmup_steps >= 0, f"actor_rollout_ref.actor.optim.lr_warmup_steps={self.lr_warmup_steps} "
                                          "must be >= 0")
        check_choice("actor_rollout_ref.actor.optim.lr_decay_style", self.lr_decay_style,
                      ("constant", "linear", "cosine"))
        check(self.clip_grad > 0, f"actor_rollout_ref.actor.optim.clip_grad={self.clip_grad} must be > 0")


@dataclass
class MegatronConfig:
    """Model parallelism of the trainer; data parallelism is what remains of the world size."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    use_distributed_optimizer: bool = True
    params_dtype: str = "float32"

    def __post_init__(self) -> None:
        check(self.tensor_model_parallel_size >= 1, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size="
                                                     f"{self.tensor_model_parallel_size} must be >= 1")
        check(self.pipeline_model_parallel_size >= 1, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="
                                                       f"{self.pipeline_model_parallel_size} must be >= 1")
        check_choice("actor_rollout_ref.actor.megatron.params_dtype", self.params_dtype,
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
        check(not unknown, f"{name}={self.save_contents} holds unknown entries {unknown}; choose from "
                            f"{list(CHECKPOINT_CONTENTS)}")
        missing = [item for item in ("model", "optimizer", "extra") if item not in self.save_contents]
        check(not missing, f"{name}={self.save_contents} leaves out {missing}: resume needs them; keep "
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
        check(self.ppo_mini_batch_size >= 1, f"{prefix}ppo_mini_batch_size={self.ppo_mini_batch_size} must be >= 1")
        check(self.ppo_micro_batch_size_per_gpu >= 1,
               f"{prefix}ppo_micro_batch_size_per_gpu={self.ppo_micro_batch_size_per_gpu} must be >= 1")
        check(self.ppo_epochs >= 1, f"{prefix}ppo_epochs={self.ppo_epochs} must be >= 1")
        check(0 <= self.clip_ratio_low < 1, f"{prefix}clip_ratio_low={self.clip_ratio_low} must be in [0, 1)")
        check(self.clip_ratio_high >= 0, f"{prefix}clip_ratio_high={self.clip_ratio_high} must be >= 0")
        check(self.clip_ratio_c > 1, f"{prefix}clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound)")
        check_choice(prefix + "loss_agg_mode", self.loss_agg_mode,
                      ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
        check_choice(prefix + "kl_loss_type", self.kl_loss_type, tuple(known_kl_kinds()))  # "+": k2's gradient
        check(self.cpo_lambda >= 1, f"{prefix}cpo_lambda={self.cpo_lambda} must be >= 1 (ratio clamp [1/lam, lam])")
        check_choice(prefix + "filter_loss_scaling", self.filter_loss_scaling, ("none", "linear", "sqrt"))
        check(0 < self.top_entropy_quantile <= 1,
               f"{prefix}top_entropy_quantile={self.top_entropy_quantile} must be in (0, 1]: the fraction of "
               "highest-entropy tokens that take part in the policy gradient (1.0 keeps all, e.g. 0.2 for the top 20%)")
        for budget in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
            check(getattr(self, budget) >= 1, f"{prefix}{budget}={getattr(self, budget)} must be >= 1 (tokens per "
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
        check_choice(prefix + "rollout_filter_strategy", self.rollout_filter_strategy,
                      ("none", "top_p", "top_k", "min_p"))
        check_choice(prefix + "rollout_filter_type", self.rollout_filter_type, ("largest", "smallest"))
        check(self.rollout_filter_metric in RAGEN_FILTER_METRICS,
               f"{prefix}rollout_filter_metric={self.rollout_filter_metric!r} is not supported; choose one of "
               f"{', '.join(map(repr, RAGEN_FILTER_METRICS))} (RAGEN's 'entropy' metrics need a trainer forward "
               "pass on every generated group and are not offered)")
        check_choice(prefix + "rollout_filter_top_p_prob_mode", self.rollout_filter_top_p_prob_mode,
                      ("linear", "softmax"))
        check(self.rollout_filter_selection_eps >= 0,
               f"{prefix}rollout_filter_selection_eps={self.rollout_filter_selection_eps} must be >= 0 (RAGEN: 0.01)")
        value, strategy = self.rollout_filter_value, self.rollout_filter_strategy
        check(strategy != "top_p" or 0 < value <= 1,
               f"{prefix}rollout_filter_value={value} must be in (0, 1] for top_p (the probability mass to keep)")
        check(strategy != "top_k" or (value >= 1 and float(value).is_integer()) or 0 < value < 1,
               f"{prefix}rollout_filter_value={value} must be a whole number >= 1 for top_k (groups to keep per "
               "generation batch of data.train_batch_size prompts) or a fraction in (0, 1) of that batch's groups")
        check(strategy != "min_p" or 0 <= value <= 1,
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
        check(self.n >= 1, f"{prefix}n={self.n} must be >= 1")
        check(self.temperature >= 0, f"{prefix}temperature={self.temperature} must be >= 0")
        check(0 < self.top_p <= 1, f"{prefix}top_p={self.top_p} must be in (0, 1]")
        check(self.top_k == -1 or self.top_k > 0, f"{prefix}top_k={self.top_k} must be -1 (off) or > 0")


ROLLOUT_MODES = ("ray", "server", "colocate", "sync", "async")
"""`rollout.mode`: where the engines run (docs/launch.md). verl's `sync` and `async` mean `ray` here: the controller
always streams groups from asynchronous engines."""


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
    forward when the actor recomputes log-probs (0: `actor.ppo_micro_batch_size_per_gpu`).
    `mode` (docs/launch.md): `ray` (default; verl's `sync`/`async` are aliases) spawns `num_engines` engines as Ray
    actors on their own devices; `server` uses running `megatron-cpo rollout` servers at `server_urls` (token in
    `server_token_file`; `server_timeout_s` bounds health checks and connecting) and never starts Ray; `colocate`
    starts one engine server per rollout-TP group of the trainer's ranks on their node, sharing their devices."""
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
    mode: str = "ray"
    server_urls: list[str] = field(default_factory=list)
    server_timeout_s: float = 30.0
    server_token_file: str = ""

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout."
        check(0 < self.gpu_memory_utilization <= 1,
               f"{prefix}gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        check(self.max_num_batched_tokens >= 1, f"{prefix}max_num_batched_tokens={self.max_num_batched_tokens} "
                                                 "must be >= 1")
        check(self.log_prob_micro_batch_size_per_gpu >= 0, f"{prefix}log_prob_micro_batch_size_per_gpu="
               f"{self.log_prob_micro_batch_size_per_gpu} must be >= 0 (0: actor.ppo_micro_batch_size_per_gpu)")
        check_choice(prefix + "weight_transport", self.weight_transport, ("auto", "shm", "collective"))
        check(self.weight_sync_timeout_s > 0,
               f"{prefix}weight_sync_timeout_s={self.weight_sync_timeout_s} must be > 0")
        check(self.n >= 1, f"{prefix}n={self.n} must be >= 1")
        check(self.temperature >= 0, f"{prefix}temperature={self.temperature} must be >= 0")
        check(0 < self.top_p <= 1, f"{prefix}top_p={self.top_p} must be in (0, 1]")
        check(self.num_engines >= 1, f"{prefix}num_engines={self.num_engines} must be >= 1")
        check(self.max_inflight_prompts >= 0, f"{prefix}max_inflight_prompts={self.max_inflight_prompts} must be "
                                               ">= 0 (0 means 2 * data.train_batch_size)")
        check_choice(prefix + "mode", self.mode, ROLLOUT_MODES)
        check(self.mode == "server" or not self.server_urls, f"{prefix}server_urls={self.server_urls} is only "
               f"used with {prefix}mode=server (mode={self.mode!r}); drop it or set mode=server")
        check(self.mode != "server" or bool(self.server_urls), f"{prefix}mode=server needs {prefix}server_urls="
               "[http://HOST:PORT, ...] (servers started with `megatron-cpo rollout`)")
        check(self.mode != "server" or bool(self.server_token_file), f"{prefix}mode=server needs "
               f"{prefix}server_token_file: the file holding the token the servers were started with (--token-file)")
        check(self.server_timeout_s > 0, f"{prefix}server_timeout_s={self.server_timeout_s} must be > 0")


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
        check(self.ref_model_sync_steps >= 1,
               f"actor_rollout_ref.ref.ref_model_sync_steps={self.ref_model_sync_steps} must be >= 1")
        check(0 <= self.ref_model_mixup_alpha <= 1,
               f"actor_rollout_ref.ref.ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1]")


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
