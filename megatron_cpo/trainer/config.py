"""The trainer's sections: `actor_rollout_ref.actor.*` (loss, optimizer, Megatron layout, batch sizes,
checkpoint contents), `actor_rollout_ref.ref.*` (the frozen reference), `trainer.*` (run length, evaluation,
checkpoints, logging, early stop) and `async_training.*` (bounded staleness: driver/admission.py), under verl's
names."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_cpo.algorithms.config import FILTER_LOSS_SCALING_MODES
from megatron_cpo.algorithms.early_stop import EarlyStopConfig
from megatron_cpo.algorithms.loss_config import PolicyLossConfig
from megatron_cpo.compute_dtype import PARAMS_DTYPES, resolve_dtype
from megatron_cpo.config_checks import check, check_choice
from megatron_cpo.models.config import ATTENTION_BACKENDS

PARAMS_DTYPE_KEY = "actor_rollout_ref.actor.megatron.params_dtype"


@dataclass
class OptimConfig:
    """Adam with linear warm-up then constant / linear / cosine decay, and global-norm gradient clipping.
    `SECTION` is where the settings live, for the messages (the critic's optimizer extends this class)."""
    SECTION: ClassVar[str] = "actor_rollout_ref.actor.optim"
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        prefix = self.SECTION + "."
        self.betas = tuple(self.betas)
        check(len(self.betas) == 2, f"{prefix}betas={list(self.betas)} must hold two numbers (Adam's beta1, beta2), "
                                     "e.g. [0.9,0.999]")
        check(self.lr > 0, f"{prefix}lr={self.lr} must be > 0")
        check(0 <= self.min_lr <= self.lr, f"{prefix}min_lr={self.min_lr} must be in [0, lr]")
        check(self.lr_warmup_steps >= 0, f"{prefix}lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        check_choice(prefix + "lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))
        check(self.clip_grad > 0, f"{prefix}clip_grad={self.clip_grad} must be > 0")


LOAD_BALANCING_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                         "global_aux_loss": "global_load_balancing_loss"}  # Megatron's type -> its logged name


@dataclass
class MoeTransformerConfig:
    """verl's `actor_rollout_ref.actor.megatron.override_transformer_config`: the `TransformerConfig` fields of a
    mixture of experts a run may set (Megatron's names; read only for MoE models). None of them changes which function
    the model computes, so the engine still samples from the policy the trainer scores.

    No load-balancing loss by default (`moe_router_load_balancing_type="none"`, `moe_aux_loss_coeff=0`), as verl,
    slime and NeMo-RL train RL: the pretrained router already balances, and an auxiliary loss pulls the routing, and
    with it the trainer's log-probs, away from what the engine samples with (NeMo-RL saw a sequence-level auxiliary
    loss make them drift). Turn it on (`aux_loss`, `seq_aux_loss` or `global_aux_loss` with a coefficient > 0) when
    expert imbalance under EP slows training (verl PR #4103); `moe_z_loss_coeff` adds the router z-loss. Both are
    added to the update's loss and logged (`actor/moe_*`). `moe_token_dispatcher_type`: `alltoall` sends each token
    only to the EP ranks of its experts; `allgather` gathers every token on every EP rank (simpler, more traffic).
    `moe_router_dtype`: the router's logits and softmax in `fp32` (as transformers computes them) or `fp64`."""
    moe_router_load_balancing_type: str = "none"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_token_dispatcher_type: str = "alltoall"
    moe_router_dtype: str = "fp32"

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.actor.megatron.override_transformer_config."
        check_choice(prefix + "moe_router_load_balancing_type", self.moe_router_load_balancing_type,
                     ("none", *LOAD_BALANCING_LOSSES))
        check(self.moe_aux_loss_coeff >= 0, f"{prefix}moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0")
        balanced = self.moe_router_load_balancing_type != "none"
        check(balanced == (self.moe_aux_loss_coeff > 0),
              f"{prefix}moe_router_load_balancing_type={self.moe_router_load_balancing_type!r} with "
              f"moe_aux_loss_coeff={self.moe_aux_loss_coeff} adds no loss; set both (e.g. aux_loss and 0.001) or "
              "neither")
        check(self.moe_z_loss_coeff is None or self.moe_z_loss_coeff >= 0,
              f"{prefix}moe_z_loss_coeff={self.moe_z_loss_coeff} must be >= 0 (or null: no z-loss)")
        check_choice(prefix + "moe_token_dispatcher_type", self.moe_token_dispatcher_type, ("alltoall", "allgather"))
        check_choice(prefix + "moe_router_dtype", self.moe_router_dtype, ("fp32", "fp64"))

    def aux_loss_names(self) -> list[str]:
        """The names Megatron logs the configured auxiliary losses under."""
        names = [LOAD_BALANCING_LOSSES[self.moe_router_load_balancing_type]] if self.moe_aux_loss_coeff > 0 else []
        return names + (["z_loss"] if self.moe_z_loss_coeff else [])


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
    GPUs of their own (trainer/workers/offload.py).
    A mixture of experts splits its experts over `expert_model_parallel_size` (EP) ranks and each expert over
    `expert_tensor_parallel_size` (ETP, null: the same as TP) ranks, inside each pipeline stage: world / PP must be a
    multiple of EP x ETP, and the expert-data-parallel size is world / (PP x EP x ETP) (docs/moe.md).
    `freeze_moe_router` (NeMo-RL's name) keeps every router's weights as loaded; `override_transformer_config` holds
    the MoE knobs (`MoeTransformerConfig`).
    `attention_backend` (Megatron's values; verl's `override_transformer_config.attention_backend` is an alias): `auto`
    (the default), `flash` or `fused` run Transformer Engine's attention when it is importable and torch's fused
    attention (no score matrix) otherwise; `unfused` is Transformer Engine's unfused one; `local` is Megatron-Core's
    own, which materialises every row's scores (megatron_cpo/models/attention.py; measurements:
    benchmarks/attention/README.md). The reference and the critic compute as the actor does.
    `params_dtype` is the actor's and the engines' compute dtype (the optimizer keeps float32 main weights for a 16-bit
    one); `auto` takes bfloat16 where the machine multiplies it natively and float32 elsewhere
    (megatron_cpo/compute_dtype.py): on a CPU without bf16 instructions a bf16 forward ran 2-4x slower than float32."""
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
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    freeze_moe_router: bool = False
    attention_backend: str = "auto"
    override_transformer_config: MoeTransformerConfig = field(default_factory=MoeTransformerConfig)

    def __post_init__(self) -> None:
        check(self.tensor_model_parallel_size >= 1, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size="
                                                     f"{self.tensor_model_parallel_size} must be >= 1")
        check(self.pipeline_model_parallel_size >= 1, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="
                                                       f"{self.pipeline_model_parallel_size} must be >= 1")
        check_choice(PARAMS_DTYPE_KEY, self.params_dtype, PARAMS_DTYPES)
        check(not self.sequence_parallel or self.tensor_model_parallel_size > 1,
              "actor_rollout_ref.actor.megatron.sequence_parallel=true needs tensor_model_parallel_size > 1 (it splits "
              "activations over the TP ranks); set it false or raise tensor_model_parallel_size")
        check_choice("actor_rollout_ref.actor.megatron.recompute_granularity", self.recompute_granularity,
                     ("full", "selective"))
        check_choice("actor_rollout_ref.actor.megatron.recompute_method", self.recompute_method, ("uniform", "block"))
        check(self.recompute_num_layers >= 1, "actor_rollout_ref.actor.megatron.recompute_num_layers="
                                              f"{self.recompute_num_layers} must be >= 1")
        check_choice("actor_rollout_ref.actor.megatron.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check(self.context_parallel_size >= 1, "actor_rollout_ref.actor.megatron.context_parallel_size="
                                               f"{self.context_parallel_size} must be >= 1")
        check(isinstance(self.expert_model_parallel_size, int) and self.expert_model_parallel_size >= 1,
              "actor_rollout_ref.actor.megatron.expert_model_parallel_size="
              f"{self.expert_model_parallel_size!r} must be an integer >= 1")
        check(self.expert_tensor_parallel_size is None or (isinstance(self.expert_tensor_parallel_size, int)
                                                           and self.expert_tensor_parallel_size >= 1),
              "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size="
              f"{self.expert_tensor_parallel_size!r} must be an integer >= 1, or null (the same as TP)")

    @property
    def compute_dtype(self) -> str:
        """`params_dtype` as this machine runs it (`auto` resolved): float32, bfloat16 or float16."""
        return resolve_dtype(self.params_dtype).name

    @property
    def expert_tensor_parallel(self) -> int:
        """ETP as the trainer runs it (null means TP)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass
class CheckpointContentsConfig:
    """verl's `actor_rollout_ref.actor.checkpoint.save_contents`: what each checkpoint holds. `model`, `optimizer`
    and `extra` (schedule, RNG, data position, run controls) are what `trainer.resume=auto` restores, so they are
    always saved; `hf_model` also writes the actor as a Hugging Face model directory (`step_<k>/huggingface`).
    `SECTION` names the section for the messages (the critic's checkpoint contents extend this class)."""
    SECTION: ClassVar[str] = "actor_rollout_ref.actor.checkpoint"
    save_contents: list[str] = field(default_factory=lambda: list(CHECKPOINT_CONTENTS))

    def __post_init__(self) -> None:
        name = self.SECTION + ".save_contents"
        unknown = [item for item in self.save_contents if item not in CHECKPOINT_CONTENTS]
        check(not unknown, f"{name}={self.save_contents} holds unknown entries {unknown}; choose from "
                            f"{list(CHECKPOINT_CONTENTS)}")
        missing = [item for item in ("model", "optimizer", "extra") if item not in self.save_contents]
        check(not missing, f"{name}={self.save_contents} leaves out {missing}: resume needs them; keep "
                            "['model', 'optimizer', 'extra'] and add 'hf_model' to also write a Hugging Face model")

    @property
    def hf_model(self) -> bool:
        return "hf_model" in self.save_contents


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclass
class RouterReplayConfig:
    """verl's `actor_rollout_ref.actor.router_replay`: make the update route every token of a mixture of experts as
    an earlier pass did (trainer/workers/routing.py). `R2` records each token's top-k experts in the old-log-prob pass
    and replays them in the update's forward passes (recomputed ones included), so the PPO ratio compares the same
    experts (Megatron's `moe_enable_routing_replay`; docs/moe.md). `R3` would replay the rollout engine's routing; vLLM
    returns routed experts only on GPUs (its V2 model runner) and the rollout samples do not carry them here, so it is
    refused."""
    mode: str = "disabled"

    def __post_init__(self) -> None:
        check_choice("actor_rollout_ref.actor.router_replay.mode", self.mode, ROUTER_REPLAY_MODES)
        check(self.mode != "R3", "actor_rollout_ref.actor.router_replay.mode=R3 (replay the engine's routing) is not "
                                 "available: vLLM returns routed experts only on GPUs (enable_return_routed_experts, "
                                 "model runner V2) and the rollout samples here do not carry them; use R2 (replay the "
                                 "old-log-prob pass's routing) or disabled")

    @property
    def replays(self) -> bool:
        return self.mode != "disabled"


@dataclass
class ActorConfig(PolicyLossConfig):
    """The policy update: the loss settings of `PolicyLossConfig` (PPO clipping with clip-higher and dual-clip, loss
    aggregation, entropy bonus and mask, KL loss, TIS; algorithms/config.py, applied by algorithms/losses.py) plus the
    optimizer, layout and batch sizes (CPO's weights are `algorithm.cpo.*`). The trainer passes this config to the
    loss as is.

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
    `router_replay` (mixtures of experts): route the update as the old-log-prob pass did (`RouterReplayConfig`).
    An optimizer step whose loss or gradient norm is NaN or infinite on any rank is skipped on every rank, whatever
    the dtype (`actor/update_skipped`; trainer/workers/update_guard.py); `max_consecutive_skipped_updates` such steps
    in a row stop the run, checkpointed, with one line naming where the first non-finite value appeared (rewards,
    log-probs, advantages, loss or gradients).
    """
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 8
    ppo_epochs: int = 1
    filter_loss_scaling: str = "none"
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    log_prob_max_token_len_per_gpu: int = 16384
    max_consecutive_skipped_updates: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()  # the loss settings (PolicyLossConfig)
        prefix = "actor_rollout_ref.actor."
        check(self.max_consecutive_skipped_updates >= 1,
              f"{prefix}max_consecutive_skipped_updates={self.max_consecutive_skipped_updates} must be >= 1 (optimizer "
              "steps skipped in a row for non-finite values before the run stops)")
        check(self.ppo_mini_batch_size >= 1, f"{prefix}ppo_mini_batch_size={self.ppo_mini_batch_size} must be >= 1")
        check(self.ppo_micro_batch_size_per_gpu >= 1,
               f"{prefix}ppo_micro_batch_size_per_gpu={self.ppo_micro_batch_size_per_gpu} must be >= 1")
        check(self.ppo_epochs >= 1, f"{prefix}ppo_epochs={self.ppo_epochs} must be >= 1")
        check_choice(prefix + "filter_loss_scaling", self.filter_loss_scaling, FILTER_LOSS_SCALING_MODES)
        for budget in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
            check(getattr(self, budget) >= 1, f"{prefix}{budget}={getattr(self, budget)} must be >= 1 (tokens per "
                                               "micro-batch; at least the longest prompt + response)")


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
class TrainerConfig:
    """Run length, evaluation, checkpoints, logging.

    `resume="auto"` continues from the newest checkpoint under `default_local_dir` when there is one;
    `early_stop` ends the run when the reward variance collapses. `nnodes` x `n_gpus_per_node` (verl), when set,
    must equal the trainer's world size (torchrun's); 0 leaves it unchecked. `log_verl_metric_names` also logs each
    metric under verl's name (`critic/score/mean`, `response_length/mean`, ...) so verl dashboards keep working.
    `resume="disable"` refuses a `default_local_dir` that holds an earlier run unless `overwrite=true`, which first
    moves that run aside to `<default_local_dir>.archived-<UTC time>` (nothing is deleted). The last step is always
    checkpointed; `max_actor_ckpt_to_keep` (verl's name; None: all) keeps only the newest k checkpoints.
    `critic_warmup` (verl's name; PPO with a critic): the first that many steps train only the critic, the actor's
    update starts at step `critic_warmup + 1`.

    `total_rollout_samples` (0: off) ends the run, checkpointed and validated, after the step at which the samples
    generated so far reach it, counting every finished sample, kept or dropped by a group filter (so arms that
    generate differently per step, e.g. GRPO and DAPO's filter-groups, compare at an equal budget); the steps
    (`total_training_steps` / `total_epochs`) still cap the run, and a learning-rate decay spans them, not the budget.
    `test_freq_samples` (0: off) validates after each step that crosses a multiple of it, besides `test_freq`.
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
    max_actor_ckpt_to_keep: int | None = None
    total_rollout_samples: int = 0
    test_freq_samples: int = 0
    critic_warmup: int = 0

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
        check(self.max_actor_ckpt_to_keep is None or self.max_actor_ckpt_to_keep >= 1,
              f"trainer.max_actor_ckpt_to_keep={self.max_actor_ckpt_to_keep} must be >= 1 (or null: keep every "
              "checkpoint)")
        for name in ("total_rollout_samples", "test_freq_samples"):
            check(getattr(self, name) >= 0, f"trainer.{name}={getattr(self, name)} must be >= 0 (0: off)")
        check(self.critic_warmup >= 0, f"trainer.critic_warmup={self.critic_warmup} must be >= 0 (steps that train "
                                       "only the critic)")


@dataclass
class AsyncTrainingConfig:
    """`async_training` (verl's section; NeMo-RL calls `max_staleness` `max_trajectory_age_steps`).

    max_staleness: k, the most weight versions a trained sample may lag behind the trainer (0: synchronous).
    partial_rollout (verl's name): what a weight push does with requests still generating: true keeps what they
        generated so far and continues them on the new weights, so a sample may carry tokens of two versions; false
        lets them finish on the old weights first (the push waits for the longest).
    in_flight_weight_updates (NeMo-RL's name; needs partial_rollout): continue them inside the engine, paused in its
        scheduler during the reload (vLLM's pause_generation(mode="keep")), instead of aborting and resubmitting
        prompt + partial output. Both recompute the prefix's KV cache under the new weights.
    """
    max_staleness: int = 0
    partial_rollout: bool = True
    in_flight_weight_updates: bool = False

    def __post_init__(self) -> None:
        check(self.max_staleness >= 0, f"async_training.max_staleness={self.max_staleness} must be >= 0 (0: "
                                       "synchronous training, k: samples at most k weight versions old)")
        check(self.partial_rollout or not self.in_flight_weight_updates,
              "async_training.in_flight_weight_updates=true continues requests across a push, which "
              "async_training.partial_rollout=false forbids; set partial_rollout=true or "
              "in_flight_weight_updates=false")

    @property
    def enabled(self) -> bool:
        return self.max_staleness > 0

    @property
    def in_flight(self) -> str:
        """What a weight push does with requests in flight (rollout/types.py IN_FLIGHT_POLICIES)."""
        if not self.enabled:
            return "none"
        if not self.partial_rollout:
            return "finish"
        return "keep" if self.in_flight_weight_updates else "partial"
