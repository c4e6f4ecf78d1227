"""verl's configuration names that are not ours: the ones that cannot apply here, the ones that must agree with another
setting, and the ones that moved (for hints). Data only; `config_loader` applies it (docs/verl_compat.md). verl's
spellings of our own settings are aliases, in `megatron_cpo/config.py`'s one table (`ALIASES`).

A key listed in `VERL_NO_OP_KEYS` is accepted, and reported in one warning with the reason it does not apply. It is
listed only when it changes how fast or where verl computes, never what: a value that would change the algorithm
(e.g. `rollout.name=sglang`) is in its `allowed` set's complement and refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NoOpKey:
    """A verl key (fnmatch pattern) accepted without effect; `allowed` (when set) are the only values that mean
    the same here, any other value is refused with `reason`."""
    pattern: str
    reason: str
    allowed: tuple[Any, ...] | None = None


_REF_OFFLOAD = ("the reference's weights stay on the device in every rollout mode; only the actor's state is "
                "offloaded (actor_rollout_ref.actor.megatron.{param,grad,optimizer}_offload)")

VERL_NO_OP_KEYS: tuple[NoOpKey, ...] = (
    NoOpKey("actor_rollout_ref.*.fsdp_config.*", "FSDP settings; the trainer is Megatron-Core"),
    NoOpKey("actor_rollout_ref.*.ulysses_sequence_parallel_size", "Ulysses sequence parallelism is FSDP's; the "
            "Megatron trainer splits the model with TP/PP"),
    NoOpKey("actor_rollout_ref.ref.megatron.param_offload", _REF_OFFLOAD),
    NoOpKey("actor_rollout_ref.rollout.name", "rollouts always run on vLLM", ("vllm",)),
    NoOpKey("actor_rollout_ref.rollout.calculate_log_probs", "the engines always return their log-probs", (True,)),
    NoOpKey("algorithm.rollout_correction.bypass_mode", "the PPO ratio's old log-probs are the trainer's (verl's "
            "decoupled mode) and the engine's serve the importance weights; bypass mode (the engine's as the old ones) "
            "is not built: it would skip the old-log-prob pass, which CPO's shaping, KL in the reward and routing "
            "replay read", (False,)),
    NoOpKey("algorithm.rollout_correction.loss_type", "bypass mode's loss; the decoupled mode here trains with "
            "actor_rollout_ref.actor.policy_loss.loss_mode", ("ppo_clip",)),
    NoOpKey("algorithm.rollout_correction.use_policy_gradient", "bypass mode's loss (verl's older name of loss_type); "
            "the decoupled mode here trains with actor_rollout_ref.actor.policy_loss.loss_mode", (False,)),
    NoOpKey("algorithm.rollout_correction.rollout_is_batch_normalize", "importance weights are not normalised to "
            "mean 1: that needs every weight of the batch before the update, and here they are computed per "
            "micro-batch, from the update's own forward when it is on-policy", (False,)),
    NoOpKey("data.return_raw_chat", "records always keep their chat messages"),
    NoOpKey("critic.strategy", "the critic is a Megatron model like the actor", ("megatron",)),
    NoOpKey("critic.model.tokenizer_path", "the critic reads the token ids the actor's tokenizer made"),
    NoOpKey("reward_model.reward_manager", "responses are graded per data source like verl's naive/dapo "
            "managers; DAPO's overlong penalty is reward.overlong_buffer", ("naive", "dapo")),
    NoOpKey("trainer.log_val_generations", "validation generations are not logged (trainer.log_completions logs "
            "training ones)"),
    NoOpKey("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", "episodes are trained on the ids "
            "the model sampled (token in, token out), never on a re-rendered conversation", (False,)),
    NoOpKey("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", "each of rollout.n samples is its own "
            "episode", (None,)),
    NoOpKey("actor_rollout_ref.rollout.agent.num_workers", "episodes run on rank 0's threads "
            "(actor_rollout_ref.rollout.multi_turn.env_workers)"),
    *(NoOpKey(f"actor_rollout_ref.*.megatron.override_transformer_config.{key}",
              "kernel fusions are chosen by the platform (Transformer Engine's when importable)")
      for key in ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                  "gradient_accumulation_fusion", "persist_layer_norm", "deallocate_pipeline_outputs",
                  "moe_grouped_gemm", "moe_permute_fusion")),
    NoOpKey("trainer.balance_batch", "verl reorders a batch's rows to even the tokens of its data-parallel ranks; "
            "here the micro-batch planner spreads them (by tokens with use_dynamic_bsz) and the loss is aggregated "
            "over the whole mini-batch either way"),
    NoOpKey("actor_rollout_ref.rollout.enforce_eager", "the engines capture CUDA graphs on GPUs and run eagerly on "
            "CPUs (rollout/engine.py); vLLM computes the same either way"),
    NoOpKey("*.model.lora.type", "one adapter per Megatron layer (Megatron-Bridge's lora: fused q/k/v and gate/up "
            "share one) is what is built; canonical_lora, vlm_lora and dora are not", ("lora",)),
    NoOpKey("*.model.lora.lora_B_init_method", "B starts at zero, so the adapted model starts as its base",
            ("zero",)),
    NoOpKey("*.model.lora.dtype", "the adapters take the model's dtype (actor_rollout_ref.actor.megatron."
            "params_dtype); the optimizer keeps float32 copies of 16-bit ones", (None,)),
    NoOpKey("*.model.lora.a2a_experimental", "an all-to-all instead of the gather / scatter of sequence-parallel "
            "adapters; the adapters compute the same either way"),
    NoOpKey("*.model.lora.fully_sharded_loras", "vLLM's sharding of served adapters; the engines receive merged "
            "weights (docs/lora.md)"),
    NoOpKey("*.model.lora.freeze_vision_*", "vision towers; the models here are text-only"),
    NoOpKey("*.model.lora.freeze_language_model", "vision-language models; the models here are text-only", (False,)),
    NoOpKey("actor_rollout_ref.*.megatron.override_transformer_config.moe_enable_deepep", "DeepEP's dispatcher "
            "(moe_token_dispatcher_type=flex) is not offered; alltoall or allgather dispatch the tokens", (False,)),
    NoOpKey("model_engine", "the trainer is Megatron-Core whichever engine verl's script names (the model and the "
            "loss are the same)", ("megatron", "fsdp", "veomni")),
    NoOpKey("actor_rollout_ref.*.veomni.*", "VeOmni (FSDP2) settings; the trainer is Megatron-Core"),
    NoOpKey("actor_rollout_ref.actor.use_torch_compile", "torch.compile of verl's FSDP actor; the Megatron trainer "
            "runs its own kernels"),
    NoOpKey("actor_rollout_ref.rollout.max_model_len", "the engines hold data.max_prompt_length + "
            "data.max_response_length tokens per sequence"),
    NoOpKey("trainer.balance_batch", "verl's reordering of the batch over its data-parallel ranks; here the rows are "
            "cut into micro-batches by token budget (actor.use_dynamic_bsz)"),
    NoOpKey("ray_kwargs.*", "verl's Ray runtime for its workers; the engines' Ray cluster is "
            "actor_rollout_ref.rollout.ray_address"),
    *(NoOpKey(f"distillation.teacher_models.*.inference.{key}", "an engine setting of verl's that changes how fast "
              "its teacher runs, not what it scores") for key in (
        "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine", "load_format", "engine_kwargs.*",
        "disable_log_stats", "skip_tokenizer_init", "limit_images")),
    NoOpKey("distillation.teacher_models.*.inference.expert_parallel_size", "a teacher engine is one vLLM engine "
            "without expert parallelism", (1,)),
    NoOpKey("distillation.teacher_models.*.inference.temperature", "the teacher scores at temperature 1 (verl forces "
            "it too)"),
    *(NoOpKey(f"distillation.distillation_loss.{key}", "verl's memory switch for the top-k loss over its "
              "materialised logits; the student's log-probs at the teacher's ids come from the fused lm-head "
              "(actor_rollout_ref.model.use_fused_kernels) in bounded tiles") for key in (
        "use_chunked_topk", "chunked_topk_chunk_size")),
    *(NoOpKey(f"distillation.teacher_models.*.inference.{key}", "the teacher's context is data.max_prompt_length + "
              "data.max_response_length (+1), as verl derives it") for key in ("prompt_length", "response_length")),
    *(NoOpKey(f"{section}.megatron.{key}", "verl's choice of weight converter, mbridge or Megatron-Bridge; the "
              "trainer converts HF <-> Megatron weights itself, models/weight_mapping.py")
      for section in ("actor_rollout_ref.*", "critic") for key in ("use_mbridge", "vanilla_mbridge")),
    *(NoOpKey(f"actor_rollout_ref.rollout.{key}", f"vLLM's {kind} parallelism inside one engine; here each engine is "
              "one vLLM instance on rollout.tensor_model_parallel_size GPUs, and rollout.num_engines sets how many")
      for key, kind in (("data_parallel_size", "data"), ("expert_parallel_size", "expert"))),
)

# verl keys accepted only when they agree with one of our settings (same meaning, one source of truth).
VERL_MUST_EQUAL: dict[str, tuple[str, str]] = {
    **{f"actor_rollout_ref.{part}.log_prob_use_dynamic_bsz": (
        "actor_rollout_ref.actor.use_dynamic_bsz", "one switch sets token-budget micro-batches for every pass")
       for part in ("rollout", "ref")},
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": (
        "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu", "the reference is scored with the actor's budget"),
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": (
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "the reference runs in the actor's layout"),
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size": (
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", "the reference runs in the actor's layout"),
    "actor_rollout_ref.ref.megatron.sequence_parallel": (
        "actor_rollout_ref.actor.megatron.sequence_parallel", "the reference runs in the actor's layout"),
    **{f"actor_rollout_ref.ref.megatron.{key}": (f"actor_rollout_ref.actor.megatron.{key}",
                                                  "the reference runs in the actor's layout")
       for key in ("expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size")},
    "reward_model.reward_kwargs.max_resp_len": (
        "data.max_response_length", "the overlong penalty is measured against data.max_response_length"),
    # the critic is built in the actor's process groups, with its packing and activation recompute
    **{f"critic.megatron.{key}": (f"actor_rollout_ref.actor.megatron.{key}", "the critic runs in the actor's layout")
       for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                   "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")},
    **{f"critic.megatron.override_transformer_config.{key}": (
        f"actor_rollout_ref.actor.megatron.{key}", "the critic recomputes activations as the actor does")
       for key in ("recompute_granularity", "recompute_method", "recompute_num_layers")},
    "critic.megatron.override_transformer_config.attention_backend": (
        "actor_rollout_ref.actor.megatron.attention_backend", "the critic computes as the actor does"),
    **{f"critic.model.{key}": (f"actor_rollout_ref.model.{key}", "the critic computes as the actor does")
       for key in ("enable_gradient_checkpointing", "use_remove_padding")},
    "critic.rollout_n": ("actor_rollout_ref.rollout.n", "the critic trains on the actor's batch"),
}

# verl names that moved or have another name here, for "did you mean" hints (not accepted silently).
VERL_MOVED_HINTS: dict[str, str] = {
    "actor_rollout_ref.actor.optim.grad_clip": "actor_rollout_ref.actor.optim.clip_grad",
    "actor_rollout_ref.actor.clip_grad": "actor_rollout_ref.actor.optim.clip_grad",
    "actor_rollout_ref.actor.lr": "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.warmup_style": "actor_rollout_ref.actor.optim.lr_decay_style",
    "actor_rollout_ref.rollout.tensor_parallel_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.tensor_parallel_size":
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "trainer.resume_from_path": "trainer.resume",
    "async_training.staleness_threshold": "async_training.max_staleness",
    "async_training.trigger_parameter_sync_step": "async_training.max_staleness",
    "critic.optim.lr_warmup_steps_ratio": "critic.optim.lr_warmup_steps",
    "critic.optim.warmup_style": "critic.optim.lr_decay_style",
}
