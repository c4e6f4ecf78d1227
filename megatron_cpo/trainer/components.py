"""What the composition root builds once for a run from several sections of the `Config`: the engines' launch
settings, the actor and reference, the critic, distillation's teacher in the trainer, the settings steps 3-5 read
and the loop's `RunSettings`.

`trainer/assemble.py` calls these while it builds the `Trainer`; tests and benchmarks call them to build the same
parts without a run. Every other module receives its own section (docs/architecture.md, "Where each setting lives").
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_cpo.config import Config
from megatron_cpo.rollout.types import EngineLaunchConfig
from megatron_cpo.trainer.workers.actor import MegatronPolicy
from megatron_cpo.trainer.workers.critic import MegatronCritic, build_critic
from megatron_cpo.trainer.workers.distillation_step import TrainerTeacher
from megatron_cpo.trainer.workers.megatron_teacher import build_megatron_teacher, self_teacher
from megatron_cpo.trainer.workers.policies import build_policies
from megatron_cpo.trainer.workers.policy_update import PolicyUpdateConfig


def engine_launch_config(config: Config) -> EngineLaunchConfig:
    """The engines' launch settings, built once for the run: the user's `actor_rollout_ref.rollout` as given, plus
    the model, dtype, lengths and seed; colocated GPU engines start able to sleep when `rollout.free_cache_engine`."""
    data, rollout = config.data, config.actor_rollout_ref.rollout
    return EngineLaunchConfig(
        model_path=config.actor_rollout_ref.model.path, engines=rollout,
        dtype=config.actor_rollout_ref.actor.megatron.compute_dtype,
        max_model_len=data.max_prompt_length + data.max_response_length, seed=config.trainer.seed,
        enable_sleep_mode=rollout.mode == "colocate" and rollout.free_cache_engine)


def policies_for(config: Config, pad_token_id: int, total_updates: int
                 ) -> tuple[MegatronPolicy, MegatronPolicy | None]:
    """The run's actor and, when it needs one, its reference (`workers/policies.py`), from the model, actor, rollout
    and reference sections."""
    parts = config.actor_rollout_ref
    return build_policies(parts.model, parts.actor, pad_token_id, total_updates,
                          parts.rollout.log_prob_micro_batch_size_per_gpu,
                          parts.ref if config.needs_reference_model else None, seed=config.trainer.seed)


def critic_for(config: Config, pad_token_id: int, total_steps: int) -> MegatronCritic | None:
    """The run's critic when it trains one (`Config.critic_enabled`: GAE), from the model, actor and critic
    sections (`workers/critic.py`); `total_steps` sizes its learning-rate schedule."""
    if not config.critic_enabled:
        return None
    critic = config.critic
    updates = total_steps * critic.ppo_epochs * (config.data.train_batch_size // critic.ppo_mini_batch_size)
    parts = config.actor_rollout_ref
    return build_critic(parts.model, parts.actor, critic, pad_token_id, updates, seed=config.trainer.seed)


def trainer_teacher(config: Config, actor: MegatronPolicy, pad_token_id: int) -> TrainerTeacher | None:
    """Distillation's teacher in the trainer, on every rank (trainer/workers/megatron_teacher.py): a frozen Megatron
    model (`kind: megatron`, in the actor's layout) or the actor's own model given the gold solution (`kind: self`);
    None when no teacher of those kinds is configured. Its micro-batches are the reference's (verl's
    `ref.log_prob_micro_batch_size_per_gpu`)."""
    distillation = config.distillation
    kinds = {name: teacher for name, teacher in distillation.teacher_models.items()
             if distillation.enabled and teacher.kind in ("megatron", "self")}
    if not kinds:
        return None
    (name, teacher), = kinds.items()  # the config allows one teacher in the trainer
    parts = config.actor_rollout_ref
    topk, micro = distillation.distillation_loss.teacher_topk, parts.ref.log_prob_micro_batch_size_per_gpu
    remove_padding = parts.model.use_remove_padding
    if teacher.kind == "self":
        return TrainerTeacher(self_teacher(actor.model, parts.actor, pad_token_id, topk, micro, remove_padding), True)
    return TrainerTeacher(build_megatron_teacher(name, teacher, parts.actor, pad_token_id, topk, micro,
                                                 remove_padding), False)


def policy_update_config(config: Config) -> PolicyUpdateConfig:
    """What steps 3-5 read (`PolicyUpdateConfig`), built once for the run."""
    rollout = config.actor_rollout_ref.rollout
    return PolicyUpdateConfig(actor=config.actor_rollout_ref.actor, algorithm=config.algorithm,
                              response_width=config.data.max_response_length,
                              temperature=rollout.log_prob_temperature, samples_per_prompt=rollout.n,
                              train_batch_size=config.data.train_batch_size,
                              max_staleness=config.async_training.max_staleness,
                              critic=config.critic if config.critic_enabled else None,
                              critic_warmup=config.trainer.critic_warmup,
                              distillation=config.distillation if config.distillation.enabled else None)


@dataclass(frozen=True)
class RunSettings:
    """Everything the step loop reads while it runs, built once: the run's length (`total_steps`, from the training
    prompts), `trainer.*`'s frequencies (0 or less: never), validation before training and resume, the reference's
    sync (`reference_sync_steps` 0: off), the push's in-flight policy (`async_training`), the batch size its errors
    name, and steps 3-5's settings (`update`)."""
    total_steps: int
    update: PolicyUpdateConfig
    save_freq: int
    test_freq: int
    val_before_train: bool
    resume: str
    reference_sync_steps: int
    reference_sync_alpha: float
    in_flight: str
    train_batch_size: int


def run_settings(config: Config, total_steps: int) -> RunSettings:
    """The loop's settings for a run of `total_steps` steps."""
    trainer, ref = config.trainer, config.actor_rollout_ref.ref
    return RunSettings(total_steps=total_steps, update=policy_update_config(config), save_freq=trainer.save_freq,
                       test_freq=trainer.test_freq, val_before_train=trainer.val_before_train, resume=trainer.resume,
                       reference_sync_steps=ref.ref_model_sync_steps if ref.sync_ref_model else 0,
                       reference_sync_alpha=ref.ref_model_mixup_alpha, in_flight=config.async_training.in_flight,
                       train_batch_size=config.data.train_batch_size)
