"""The critic's section, `critic.*` under verl's names: PPO's value model (trainer/workers/critic.py), read by
`MegatronCritic` and the critic's update (trainer/workers/policy_update.py).

The critic is the actor's architecture with a scalar value head, built in the actor's process groups (its TP, PP,
CP, EP and ETP; verl's `critic.megatron.*` layout keys must repeat the actor's), with the actor's dtype, packing and
activation recompute. What is its own: where it starts from (`model.path`, default the actor's model), its optimizer
(`optim`, verl's critic defaults: lr 1e-5, weight decay 0.01), the PPO value loss (`cliprange_value`,
`loss_agg_mode`), how its updates split the batch (`ppo_epochs`, `ppo_mini_batch_size`, micro-batches or token
budgets), which of its parts are offloaded while colocated engines generate, and what its checkpoints hold. The batch
settings left unset (null) take the actor's values when the config loads, as verl's interpolations do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_cpo.algorithms.config import LOSS_AGGREGATION_MODES
from megatron_cpo.config_checks import check, check_choice
from megatron_cpo.models.config import LoraConfig
from megatron_cpo.trainer.config import ActorConfig, CheckpointContentsConfig, OptimConfig


@dataclass
class CriticOptimConfig(OptimConfig):
    """The critic's Adam (the actor's settings and schedule, `OptimConfig`), with verl's critic defaults."""
    SECTION: ClassVar[str] = "critic.optim"
    lr: float = 1e-5
    weight_decay: float = 0.01


@dataclass
class CriticCheckpointConfig(CheckpointContentsConfig):
    """verl's `critic.checkpoint.save_contents`: `model`, `optimizer` and `extra` are always saved (resume restores
    the critic with the actor, from the same files); `hf_model` also writes the critic as a Hugging Face token
    classification model with one label (`step_<k>/critic_huggingface`, verl's value-model layout)."""
    SECTION: ClassVar[str] = "critic.checkpoint"
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])


@dataclass
class CriticLoraConfig(LoraConfig):
    """verl's `critic.model.lora.*`: the critic trains LoRA adapters (and its value head) instead of its whole
    decoder; the same settings as the actor's (`LoraConfig`)."""
    SECTION: ClassVar[str] = "critic.model.lora"


@dataclass
class CriticModelConfig:
    """`path`: the Hugging Face directory the critic starts from ("": the actor's `actor_rollout_ref.model.path`). A
    causal LM gets a fresh value head (its `lm_head` is not used); a token-classification model with one label (a
    critic exported by this trainer or verl) keeps its `score` head. Either must be the actor's architecture.
    `lora`: train adapters and the value head only (`CriticLoraConfig`)."""
    path: str = ""
    lora: CriticLoraConfig = field(default_factory=CriticLoraConfig)


@dataclass
class CriticMegatronConfig:
    """The critic's own Megatron settings: the distributed optimizer, and (verl's names) which parts of its training
    state go to host memory while colocated engines generate (`rollout.mode=colocate`; trainer/workers/offload.py).
    Its layout is the actor's."""
    use_distributed_optimizer: bool = True
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class CriticConfig:
    """PPO's critic (verl's `critic` section).

    `enable`: null (the default) trains a critic exactly when `algorithm.adv_estimator=gae` (verl's rule); true with
    another estimator and false with gae are refused (nothing else reads the values). The value loss is verl's
    clipped one, `0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))` with `c = cliprange_value`,
    aggregated by `loss_agg_mode` (null: the actor's); the returns R are GAE's (`algorithm.gamma`, `algorithm.lam`).
    `ppo_epochs` passes over the batch, in mini-batches of `ppo_mini_batch_size` prompts (one optimizer step each),
    each cut into `ppo_micro_batch_size_per_gpu` responses, or with `use_dynamic_bsz` into micro-batches of at most
    `ppo_max_token_len_per_gpu` tokens (`forward_max_token_len_per_gpu` when only scoring; 0: the same); null takes
    the actor's value. An optimizer step whose loss or gradient norm is not finite is skipped on every rank
    (`critic/update_skipped`); `max_consecutive_skipped_updates` in a row stop the run, checkpointed.
    """
    enable: bool | None = None
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    megatron: CriticMegatronConfig = field(default_factory=CriticMegatronConfig)
    checkpoint: CriticCheckpointConfig = field(default_factory=CriticCheckpointConfig)
    ppo_epochs: int | None = None
    ppo_mini_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool | None = None
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = 0
    cliprange_value: float = 0.5
    loss_agg_mode: str | None = None
    max_consecutive_skipped_updates: int = 3

    def __post_init__(self) -> None:
        prefix = "critic."
        for name in ("ppo_epochs", "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and value >= 1),
                  f"{prefix}{name}={value!r} must be an integer >= 1, or null (the actor's)")
        check(self.ppo_max_token_len_per_gpu >= 1, f"{prefix}ppo_max_token_len_per_gpu="
              f"{self.ppo_max_token_len_per_gpu} must be >= 1 (tokens per micro-batch)")
        check(self.forward_max_token_len_per_gpu >= 0, f"{prefix}forward_max_token_len_per_gpu="
              f"{self.forward_max_token_len_per_gpu} must be >= 0 (0: ppo_max_token_len_per_gpu)")
        check(self.cliprange_value > 0, f"{prefix}cliprange_value={self.cliprange_value} must be > 0 (verl: 0.5; a "
              "large value turns the clipping off)")
        if self.loss_agg_mode is not None:
            check_choice(prefix + "loss_agg_mode", self.loss_agg_mode, LOSS_AGGREGATION_MODES)
        check(self.max_consecutive_skipped_updates >= 1, f"{prefix}max_consecutive_skipped_updates="
              f"{self.max_consecutive_skipped_updates} must be >= 1")

    def take_actor_defaults(self, actor: ActorConfig) -> None:
        """Fill the batch settings left null with the actor's (`actor_rollout_ref.actor`), as verl's `${...}`
        interpolations do when its config loads."""
        for name in ("ppo_epochs", "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
                     "loss_agg_mode"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(actor, name))

    @property
    def scoring_token_budget(self) -> int:
        """Tokens per micro-batch of the value pass with `use_dynamic_bsz` (verl's `forward_max_token_len_per_gpu`)."""
        return self.forward_max_token_len_per_gpu or self.ppo_max_token_len_per_gpu
