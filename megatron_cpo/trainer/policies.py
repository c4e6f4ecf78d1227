"""Build the trainable actor and the frozen reference from the HF model directory (every rank, after init)."""
from __future__ import annotations

import torch

from megatron_cpo.config import Config
from megatron_cpo.models import build_gpt_model, load_hf_config, load_hf_weights
from megatron_cpo.trainer.actor import MegatronPolicy, model_options
from megatron_cpo.trainer.optimizer import build_optimizer, wrap_ddp


def build_policies(config: Config, pad_token_id: int, total_updates: int
                   ) -> tuple[MegatronPolicy, MegatronPolicy | None]:
    """The actor (DDP + optimizer + schedule) and, when the run needs one (`Config.needs_reference_model`), the
    reference.

    Both start from `actor_rollout_ref.model.path`; `total_updates` sizes the learning-rate schedule.
    """
    actor_cfg, model_cfg = config.actor_rollout_ref.actor, config.actor_rollout_ref.model
    hf_config = load_hf_config(model_cfg.path)
    dtype = getattr(torch, actor_cfg.megatron.params_dtype)
    kernels = {"use_fused_kernels": model_cfg.use_fused_kernels, "use_remove_padding": model_cfg.use_remove_padding}

    model = build_gpt_model(hf_config, params_dtype=dtype, **model_options(config))
    load_hf_weights(model, model_cfg.path)
    ddp_model = wrap_ddp(model, actor_cfg.megatron.use_distributed_optimizer)
    optimizer, scheduler = build_optimizer(ddp_model, actor_cfg, total_updates)
    actor = MegatronPolicy(model, pad_token_id, actor_cfg,
                           config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu, ddp_model, optimizer,
                           scheduler, **kernels)

    reference = None
    if config.needs_reference_model:
        ref_model = build_gpt_model(hf_config, params_dtype=dtype, **model_options(config))
        load_hf_weights(ref_model, model_cfg.path)
        ref_model.requires_grad_(False)
        reference = MegatronPolicy(ref_model, pad_token_id, actor_cfg,
                                   config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu, **kernels)
    return actor, reference
