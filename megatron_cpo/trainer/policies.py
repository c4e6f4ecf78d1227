"""Build the trainable actor and the frozen reference from the HF model directory (every rank, after init)."""
from __future__ import annotations

from dataclasses import replace

import torch

from megatron_cpo.config import Config
from megatron_cpo.models import build_gpt_model, load_hf_config, load_hf_weights
from megatron_cpo.trainer.actor import MegatronPolicy, model_options
from megatron_cpo.trainer.micro_batches import MicroBatching
from megatron_cpo.trainer.optimizer import build_optimizer, wrap_ddp


def build_policies(config: Config, pad_token_id: int, total_updates: int
                   ) -> tuple[MegatronPolicy, MegatronPolicy | None]:
    """The actor (DDP + optimizer + schedule) and, when a KL loss, KL in the reward or reference sync needs it, the
    reference.

    Both start from `actor_rollout_ref.model.path`; `total_updates` sizes the learning-rate schedule.
    """
    actor_cfg, ref_cfg = config.actor_rollout_ref.actor, config.actor_rollout_ref.ref
    model_dir = config.actor_rollout_ref.model.path
    hf_config = load_hf_config(model_dir)
    dtype = getattr(torch, actor_cfg.megatron.params_dtype)
    dynamic = actor_cfg.use_dynamic_bsz
    batching = MicroBatching(actor_cfg.ppo_micro_batch_size_per_gpu,
                             actor_cfg.ppo_max_token_len_per_gpu if dynamic else 0,
                             actor_cfg.log_prob_max_token_len_per_gpu if dynamic else 0,
                             config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu)
    fused = config.actor_rollout_ref.model.use_fused_kernels

    model = build_gpt_model(hf_config, params_dtype=dtype, **model_options(config))
    load_hf_weights(model, model_dir)
    ddp_model = wrap_ddp(model, actor_cfg.megatron.use_distributed_optimizer)
    optimizer, scheduler = build_optimizer(ddp_model, actor_cfg, total_updates)
    remove_padding = config.actor_rollout_ref.model.use_remove_padding
    actor = MegatronPolicy(model, pad_token_id, batching, ddp_model, optimizer, scheduler, use_fused_kernels=fused,
                           use_remove_padding=remove_padding)

    reference = None
    if actor_cfg.use_kl_loss or ref_cfg.sync_ref_model or config.algorithm.use_kl_in_reward:
        ref_model = build_gpt_model(hf_config, params_dtype=dtype, **model_options(config))
        load_hf_weights(ref_model, model_dir)
        ref_model.requires_grad_(False)
        reference = MegatronPolicy(ref_model, pad_token_id,
                                   replace(batching, log_prob_micro_batch_size=ref_cfg.log_prob_micro_batch_size_per_gpu),
                                   use_fused_kernels=fused, use_remove_padding=remove_padding)
    return actor, reference
