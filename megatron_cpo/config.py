"""The root of a run's configuration: the sections composed into one typed tree, the checks across sections, and the
one table of accepted spellings.

A run is described by a YAML file whose nesting follows verl's (`data.train_batch_size`,
`actor_rollout_ref.rollout.n`, `algorithm.filter_groups.enable`, ...) plus dotted overrides on the command line
(`actor_rollout_ref.actor.optim.lr=1e-5`). Each section is a dataclass declared next to the code that reads it and
handed to that code as it is (docs/architecture.md, "Where each setting lives"):

- `data.*`: `data/config.py` (`DataConfig`);
- `algorithm.*`: `algorithms/config.py` (`AlgorithmConfig`);
- `reward.*`: `rewards/config.py` (`RewardConfig`);
- `actor_rollout_ref.model.*`: `models/config.py`; `.actor.*`, `.ref.*` and `trainer.*`: `trainer/config.py`;
  `.rollout.*`: `rollout/config.py`, its `multi_turn.*`: `envs/config.py` (joined to the rollout section here, since
  `envs` sits above `rollout`).
- `async_training.*`: `trainer/config.py` (`AsyncTrainingConfig`, read by `trainer/driver/admission.py`).
- `critic.*`: `trainer/critic_config.py` (`CriticConfig`, read by `trainer/workers/critic.py`).
- `distillation.*`: `rollout/teacher_config.py` (`DistillationConfig`: the teachers), its `distillation_loss.*`:
  `algorithms/distillation_config.py` (the signal).

Every section's module is torch-free, so loading a config imports no torch (tests/trainer/test_config.py). Each
section validates itself in `__post_init__`; checks that need two sections live in `Config.__post_init__`.
Every error names the offending value and says how to fix it. Accepted spellings (the seeds' names and verl's) are
rewritten to the canonical names when the file is loaded (`ALIASES`); verl's keys that do not apply here, or must
repeat one of ours, are data in `verl_compat.py`. Parsing, coercion and building live in `config_loader.py`;
`load_config` / `build_config` are its entry points.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from megatron_cpo.algorithms.config import AlgorithmConfig
from megatron_cpo.config_checks import ConfigError, check  # noqa: F401  (ConfigError: importable from the root)
from megatron_cpo.config_loader import ConfigLoader, Resolved, known_names, parse_override  # noqa: F401
from megatron_cpo.data.config import DataConfig
from megatron_cpo.envs.config import MultiTurnConfig
from megatron_cpo.models.config import ModelConfig
from megatron_cpo.rewards.config import RewardConfig
from megatron_cpo.rollout.config import RolloutConfig
from megatron_cpo.rollout.teacher_config import DistillationConfig
from megatron_cpo.trainer.config import ActorConfig, AsyncTrainingConfig, RefConfig, TrainerConfig
from megatron_cpo.trainer.critic_config import CriticConfig
from megatron_cpo.verl_compat import VERL_MOVED_HINTS, VERL_MUST_EQUAL, VERL_NO_OP_KEYS


@dataclass
class RolloutSection(RolloutConfig):
    """`multi_turn` (`MultiTurnConfig`, envs/config.py: multi-turn episodes) is joined to the rollout section here,
    since `envs` sits above `rollout`."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class ActorRolloutRefConfig:
    """verl's `actor_rollout_ref`: the model, the actor, the rollout engines and the reference."""
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class Config:
    """The whole run."""
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)

    def __post_init__(self) -> None:
        rollout, actor, algo = self.actor_rollout_ref.rollout, self.actor_rollout_ref.actor, self.algorithm
        self.critic.take_actor_defaults(actor)  # the critic's batch settings left null are the actor's (verl's rule)
        self._check_critic()
        # verl's OPD scripts run rollout.n=1 with grpo when the distillation term replaces the task's
        grouped = algo.filter_groups.enable or (algo.estimator_needs.grouped and
                                                not self.distillation.replaces_task_reward)
        check(not grouped or rollout.n >= 2,
              f"actor_rollout_ref.rollout.n={rollout.n} cannot form groups for {algo.adv_estimator} advantages or "
              "filter_groups; set actor_rollout_ref.rollout.n >= 2")
        check(not self.distillation.has_self_teacher or not algo.shaper.needs_hint_contexts,
              f"distillation with a kind=self teacher and algorithm.adv_estimator={algo.adv_estimator} is not "
              "available yet: both build hint contexts, for different responses; use grpo (or another estimator) with "
              "the self teacher, or an engines teacher with CPO")
        megatron_teachers = [name for name, t in self.distillation.teacher_models.items() if t.kind == "megatron"]
        check(not (self.distillation.enabled and megatron_teachers and rollout.mode == "colocate"),
              f"distillation.teacher_models.{megatron_teachers[0] if megatron_teachers else ''}.kind=megatron with "
              "actor_rollout_ref.rollout.mode=colocate is not available yet (the frozen teacher is not offloaded while "
              "the engines generate); use kind=engines, or rollout.mode=ray")
        for section in ("actor_rollout_ref.actor", "critic"):
            mini_batch = (actor if section != "critic" else self.critic).ppo_mini_batch_size
            check(self.data.train_batch_size % mini_batch == 0, f"data.train_batch_size={self.data.train_batch_size}"
                  f" is not a multiple of {section}.ppo_mini_batch_size={mini_batch}; make it one")
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
        check(model_len <= 1 << 20,
              "data.max_prompt_length + data.max_response_length is implausibly large; check the units (tokens)")
        check(not (rollout.multi_turn.enable and algo.shaper.needs_hint_contexts),
              f"algorithm.adv_estimator={algo.adv_estimator} puts a hint before one sampled answer, which a multi-turn "
              "episode does not have; use grpo with actor_rollout_ref.rollout.multi_turn.enable=true, or turn it off")
        staleness = self.async_training.max_staleness
        check(staleness == 0 or rollout.mode != "colocate", f"async_training.max_staleness={staleness} needs engines "
              "that generate while the trainer updates; colocated engines share its devices (rollout.mode=colocate), "
              "so use mode ray or server, or max_staleness=0")
        check(not (algo.rollout_correction.explicit_is and actor.tis is not None),
              f"algorithm.rollout_correction.rollout_is={algo.rollout_correction.rollout_is!r} and "
              f"actor_rollout_ref.actor.tis_imp_ratio_cap={actor.tis_imp_ratio_cap} both weight the loss by the "
              "engine's log-probs; keep one (tis_imp_ratio_cap=-1, or rollout_is=null)")
        check(not (self.actor_rollout_ref.model.lora.enabled and self.actor_rollout_ref.ref.sync_ref_model),
              "actor_rollout_ref.ref.sync_ref_model=true mixes the actor into a copy of the reference, and with LoRA "
              "(actor_rollout_ref.model.lora.rank > 0) the reference is the base model with the adapters off, not a "
              "copy; set sync_ref_model=false or lora.rank=0")
        check(not (algo.estimator_needs.greedy_baseline and staleness > 0),
              f"algorithm.adv_estimator={algo.adv_estimator} with async_training.max_staleness={staleness}: the greedy "
              "baseline answers are generated with the synchronous loop's batches only; set max_staleness=0 or use "
              "another estimator (e.g. rloo)")

    def _check_critic(self) -> None:
        """A critic exactly when the estimator reads its values (gae): one without the other is refused."""
        algo, critic = self.algorithm, self.critic
        needs = algo.estimator_needs.critic
        check(not (needs and critic.enable is False), f"algorithm.adv_estimator={algo.adv_estimator} needs a critic's "
              "values, and critic.enable=false turns the critic off; set critic.enable=true (or leave it null), or "
              "choose a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...; docs/algorithms.md)")
        asked = "critic.enable=true" if critic.enable else (f"critic.model.path={critic.model.path!r}"
                                                            if critic.model.path else None)
        check(needs or asked is None, f"{asked} sets up a critic, but algorithm.adv_estimator={algo.adv_estimator} "
              "does not read its values (only gae does); set algorithm.adv_estimator=gae, or remove the critic's "
              "settings (critic.enable=null)")
        warmup, steps = self.trainer.critic_warmup, self.trainer.total_training_steps
        check(needs or warmup == 0, f"trainer.critic_warmup={warmup} trains only a critic in the first steps, and "
              f"algorithm.adv_estimator={algo.adv_estimator} has none; set it to 0 (or use gae)")
        check(not steps or warmup < steps, f"trainer.critic_warmup={warmup} leaves no step of "
              f"trainer.total_training_steps={steps} to update the actor in; lower it")

    @property
    def critic_enabled(self) -> bool:
        """Whether the run trains a critic: exactly when the estimator reads values (`algorithm.adv_estimator=gae`;
        `critic.enable` may only confirm it)."""
        return self.algorithm.estimator_needs.critic

    def total_steps(self, prompts: int) -> int:
        """Steps of the run on `prompts` training prompts: `trainer.total_training_steps`, or (when 0)
        `trainer.total_epochs` x the batches of `data.train_batch_size` prompts one epoch makes, rounded up."""
        trainer = self.trainer
        return trainer.total_training_steps or trainer.total_epochs * math.ceil(prompts / self.data.train_batch_size)

    @property
    def needs_reference_model(self) -> bool:
        """Whether the run keeps a frozen reference policy: for the KL loss (`actor.use_kl_loss`), KL in the reward
        (`algorithm.use_kl_in_reward`) or verl's reference sync (`ref.sync_ref_model`)."""
        actor, ref = self.actor_rollout_ref.actor, self.actor_rollout_ref.ref
        return actor.use_kl_loss or self.algorithm.use_kl_in_reward or ref.sync_ref_model


# Accepted spellings -> canonical dotted name: the seeds' names, then verl's. Values given under an alias are moved,
# never duplicated; an alias and its canonical name given different values in one place is an error.
ALIASES: dict[str, str] = {
    # the seeds
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
    # verl
    "custom_reward_function.path": "reward.custom_reward_function",
    "custom_reward_function.name": "reward.custom_reward_function_name",
    "actor_rollout_ref.actor.grad_clip": "actor_rollout_ref.actor.optim.clip_grad",
    # verl sets the forward-only token budget on the rollout (actor log-probs) and the reference separately; here
    # one budget serves both passes (the reference's must repeat it, VERL_MUST_EQUAL).
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu":
        "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu",
    # verl's agent-loop default (rows without an agent_name column)
    "actor_rollout_ref.rollout.agent.default_agent_loop": "actor_rollout_ref.rollout.multi_turn.default_agent",
    # vLLM's and TRL's name for verl's free_cache_engine (sleep the colocated engines while the actor trains)
    "actor_rollout_ref.rollout.enable_sleep_mode": "actor_rollout_ref.rollout.free_cache_engine",
    **{f"reward_model.reward_kwargs.overlong_buffer_cfg.{key}": f"reward.overlong_buffer.{key}"
       for key in ("enable", "len", "penalty_factor", "log")},
    # verl's FSDP spellings of LoRA (model.lora_rank, ...) mean its Megatron keys (model.lora.*)
    **{f"{section}.model.{key}": f"{section}.model.lora.{canonical}"
       for section in ("actor_rollout_ref", "critic")
       for key, canonical in (("lora_rank", "rank"), ("lora_alpha", "alpha"), ("target_modules", "target_modules"),
                              ("exclude_modules", "exclude_modules"), ("lora_adapter_path", "adapter_path"))},
    # verl passes Megatron's recompute and attention settings through override_transformer_config
    **{f"actor_rollout_ref.actor.megatron.override_transformer_config.{key}": f"actor_rollout_ref.actor.megatron.{key}"
       for key in ("recompute_granularity", "recompute_method", "recompute_num_layers", "attention_backend")},
}
# Seed 001 trained on the partial batch when its limit was reached; its alias keeps that unless on_limit is given.
ALIAS_IMPLIES: dict[str, tuple[str, Any]] = {
    "algorithm.dynamic_sample_max_gen_batches": ("algorithm.filter_groups.on_limit", "use_partial"),
}


# The loader (YAML + dotted overrides -> typed tree) lives in config_loader.py; these names stay importable from here.
_LOADER = ConfigLoader(Config, ALIASES, ALIAS_IMPLIES, VERL_NO_OP_KEYS, VERL_MUST_EQUAL, VERL_MOVED_HINTS)
build_config = _LOADER.build
load_config = _LOADER.load
resolve_config = _LOADER.resolve_file


def config_to_dict(config: Config) -> dict:
    """The config as plain nested dicts (for logging and checkpoints)."""
    return dataclasses.asdict(config)
