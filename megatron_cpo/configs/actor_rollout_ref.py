"""`actor_rollout_ref.*`: the model, the actor (optimizer, Megatron layout, loss), the rollout engines (sampling,
RAGEN's rollout filter, validation sampling) and the reference, under verl's names."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.algorithms.filters import FILTER_LOSS_SCALINGS, RolloutFilterConfig
from megatron_cpo.algorithms.losses import PolicyLossConfig
from megatron_cpo.configs.checks import check, check_choice
from megatron_cpo.rollout.sync_check import SyncCheckConfig
from megatron_cpo.rollout.types import RolloutEngineConfig


@dataclass
class ModelConfig:
    """The HF model directory the actor, the reference and the rollout engines start from.

    `use_fused_kernels` (verl's name) computes the actor's and the reference's log-probs and entropy from the final
    hidden states and the vocab-parallel lm-head weight in one kernel, so the `[tokens, vocab]` logits are never
    materialised (the memory that dominates at long responses and a 152k vocabulary); the results are the same.
    `use_remove_padding` (verl's name) packs several sequences into each row of a micro-batch, position ids restarting
    and attention confined per sequence (THD packed sequences with Transformer Engine, a per-sequence mask on the local
    attention without it), so no compute is spent on padding; with `actor.use_dynamic_bsz` the token budgets then count
    real tokens. `enable_gradient_checkpointing` recomputes activations in the backward (Megatron's recompute, as
    `actor.megatron.recompute_*` say): less memory, one more forward; the results are the same.
    """
    path: str = ""
    use_fused_kernels: bool = False
    use_remove_padding: bool = False
    enable_gradient_checkpointing: bool = False


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
    """Model parallelism of the trainer; data parallelism is what remains of the world size.

    `sequence_parallel` (needs TP > 1) splits the activations outside attention and the MLP along the sequence over the
    TP ranks (Megatron's sequence parallelism: less activation memory, same results). `recompute_granularity` (`full`:
    whole layers, `selective`: the core attention), `recompute_method` (`uniform`: every `recompute_num_layers` layers
    form one checkpoint; `block`: only the first `recompute_num_layers` layers of a stage are recomputed) and
    `recompute_num_layers` are Megatron's names and apply when `actor_rollout_ref.model.enable_gradient_checkpointing`.
    `context_parallel_size` splits every row over that many ranks (ring attention): Transformer Engine only, padded rows
    only (not with `use_remove_padding`); data parallelism is then world / (TP x PP x CP).
    `param_offload` / `grad_offload` / `optimizer_offload` (verl's names) move the actor's parameters, gradients
    (DDP's grad buffers) and optimizer state (Adam's moments, fp32 main parameters) to host memory while colocated
    engines generate (`rollout.mode=colocate`), and back before training; they do nothing when the engines have
    GPUs of their own (trainer/offload.py)."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    use_distributed_optimizer: bool = True
    params_dtype: str = "float32"
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    sequence_parallel: bool = False
    recompute_granularity: str = "full"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        check(self.tensor_model_parallel_size >= 1, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size="
                                                     f"{self.tensor_model_parallel_size} must be >= 1")
        check(self.pipeline_model_parallel_size >= 1, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="
                                                       f"{self.pipeline_model_parallel_size} must be >= 1")
        check_choice("actor_rollout_ref.actor.megatron.params_dtype", self.params_dtype,
                      ("float32", "bfloat16", "float16"))
        check(not self.sequence_parallel or self.tensor_model_parallel_size > 1,
              "actor_rollout_ref.actor.megatron.sequence_parallel=true needs tensor_model_parallel_size > 1 (it splits "
              "activations over the TP ranks); set it false or raise tensor_model_parallel_size")
        check_choice("actor_rollout_ref.actor.megatron.recompute_granularity", self.recompute_granularity,
                     ("full", "selective"))
        check_choice("actor_rollout_ref.actor.megatron.recompute_method", self.recompute_method, ("uniform", "block"))
        check(self.recompute_num_layers >= 1, "actor_rollout_ref.actor.megatron.recompute_num_layers="
                                              f"{self.recompute_num_layers} must be >= 1")
        check(self.context_parallel_size >= 1, "actor_rollout_ref.actor.megatron.context_parallel_size="
                                               f"{self.context_parallel_size} must be >= 1")


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
class ActorConfig(PolicyLossConfig):
    """The policy update: the loss settings of `PolicyLossConfig` (PPO clipping with clip-higher and dual-clip, loss
    aggregation, entropy bonus and mask, KL loss, TIS; algorithms/losses.py) plus the optimizer, layout and batch sizes
    (CPO's weights are `algorithm.cpo.*`). The trainer passes this config to the loss as is.

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
    filter_loss_scaling: str = "none"
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    log_prob_max_token_len_per_gpu: int = 16384

    def __post_init__(self) -> None:
        super().__post_init__()  # the loss settings (PolicyLossConfig)
        prefix = "actor_rollout_ref.actor."
        check(self.ppo_mini_batch_size >= 1, f"{prefix}ppo_mini_batch_size={self.ppo_mini_batch_size} must be >= 1")
        check(self.ppo_micro_batch_size_per_gpu >= 1,
               f"{prefix}ppo_micro_batch_size_per_gpu={self.ppo_micro_batch_size_per_gpu} must be >= 1")
        check(self.ppo_epochs >= 1, f"{prefix}ppo_epochs={self.ppo_epochs} must be >= 1")
        check_choice(prefix + "filter_loss_scaling", self.filter_loss_scaling, tuple(FILTER_LOSS_SCALINGS))
        for budget in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
            check(getattr(self, budget) >= 1, f"{prefix}{budget}={getattr(self, budget)} must be >= 1 (tokens per "
                                               "micro-batch; at least the longest prompt + response)")


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
class RolloutConfig(RolloutFilterConfig, RolloutEngineConfig):
    """`actor_rollout_ref.rollout`: the engines' settings (`RolloutEngineConfig` of rollout/types.py: count, layout,
    memory, Ray address, weight transport), RAGEN's rollout filter (`RolloutFilterConfig` of algorithms/filters.py,
    the `rollout_filter_*` keys, off by default; docs/filters.md) and the sampling the trainer asks for. This class
    extends both, so the engines and the filter receive this object as is.
    `n` responses per prompt at `temperature` / `top_p` / `top_k`; `val_kwargs` is how validation samples.
    `max_inflight_prompts` caps the prompts the controller keeps in flight (0: 2 * data.train_batch_size).
    `log_prob_micro_batch_size_per_gpu`: responses per forward when the actor recomputes log-probs
    (0: `actor.ppo_micro_batch_size_per_gpu`).
    `free_cache_engine` (verl's name; `enable_sleep_mode` is accepted for it) puts colocated engines to sleep while
    the actor trains (`rollout.mode=colocate`, GPU engines only) and wakes them before rollout: `sleep_level` 1 frees
    the KV cache and moves the weights to host memory, 2 discards the weights too (new ones are pushed before the
    next rollout anyway, so 2 saves the copy and the host memory).
    `mode` (docs/launch.md): `ray` (default; verl's `sync`/`async` are aliases) spawns `num_engines` engines as Ray
    actors on their own devices; `server` uses running `megatron-cpo rollout` servers at `server_urls` (token in
    `server_token_file`; `server_timeout_s` bounds health checks and connecting) and never starts Ray; `colocate`
    starts one engine server per rollout-TP group of the trainer's ranks on their node, sharing their devices."""
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_inflight_prompts: int = 0
    log_prob_micro_batch_size_per_gpu: int = 0
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    free_cache_engine: bool = True
    sleep_level: int = 1
    mode: str = "ray"
    server_urls: list[str] = field(default_factory=list)
    server_timeout_s: float = 30.0
    server_token_file: str = ""
    sync_check: SyncCheckConfig = field(default_factory=SyncCheckConfig)

    def __post_init__(self) -> None:
        RolloutEngineConfig.__post_init__(self)
        RolloutFilterConfig.__post_init__(self)
        prefix = "actor_rollout_ref.rollout."
        check(self.log_prob_micro_batch_size_per_gpu >= 0, f"{prefix}log_prob_micro_batch_size_per_gpu="
               f"{self.log_prob_micro_batch_size_per_gpu} must be >= 0 (0: actor.ppo_micro_batch_size_per_gpu)")
        check(self.sleep_level in (1, 2), f"{prefix}sleep_level={self.sleep_level} must be 1 (free the KV cache, "
               "move the engine's weights to host memory) or 2 (discard the weights too)")
        check(self.n >= 1, f"{prefix}n={self.n} must be >= 1")
        check(self.temperature >= 0, f"{prefix}temperature={self.temperature} must be >= 0")
        check(0 < self.top_p <= 1, f"{prefix}top_p={self.top_p} must be in (0, 1]")
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
