"""Build the trainable actor and the frozen reference from the HF model directory (every rank, after init).

With LoRA (`model.lora.rank` > 0) the actor's base stays frozen in its dtype and only its adapters train (so DDP's
buffers, the optimizer's state and gradient clipping see only them), and the reference is the actor's own model with
its adapters off: no second copy of the weights is loaded."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from megatron_cpo.models.builder import build_gpt_model, load_hf_config
from megatron_cpo.models.config import LoraConfig, ModelConfig
from megatron_cpo.models.families import family_of
from megatron_cpo.models.lora.apply import apply_lora
from megatron_cpo.models.lora.layers import adapters_disabled
from megatron_cpo.models.lora.peft_format import load_peft_adapter
from megatron_cpo.models.weight_mapping import load_hf_weights
from megatron_cpo.trainer.config import ActorConfig, MegatronConfig, RefConfig
from megatron_cpo.trainer.workers.actor import MegatronPolicy
from megatron_cpo.trainer.workers.optimizer import build_optimizer, wrap_ddp
from megatron_cpo.trainer.workers.routing import RouterTracker, freeze_routers

logger = logging.getLogger(__name__)


def model_options(megatron: MegatronConfig, gradient_checkpointing: bool, moe: bool, replay_routing: bool = False
                  ) -> dict[str, Any]:
    """The `build_gpt_model` options the trainer config selects for the actor and the reference: the core attention
    (`megatron.attention_backend`), sequence parallelism, (`model.enable_gradient_checkpointing`) Megatron's
    activation recompute and, for a mixture of experts, `megatron.override_transformer_config`'s MoE knobs and (the
    actor with `router_replay.mode=R2`) Megatron's routing replay."""
    options: dict[str, Any] = {"attention_backend": megatron.attention_backend,
                               "sequence_parallel": megatron.sequence_parallel}
    if megatron.context_parallel_size > 1:
        options["context_parallel_size"] = megatron.context_parallel_size
    if gradient_checkpointing:
        options["recompute_granularity"] = megatron.recompute_granularity
        if megatron.recompute_granularity == "full":
            options.update(recompute_method=megatron.recompute_method,
                           recompute_num_layers=megatron.recompute_num_layers)
    if moe:
        options.update(dataclasses.asdict(megatron.override_transformer_config),
                       moe_enable_routing_replay=replay_routing)
    return options


def add_adapters(model: Any, lora: LoraConfig, seed: int, keep_trainable: tuple[str, ...] = ()) -> None:
    """LoRA adapters on the loaded `model` (models/lora/apply.py), started from `lora.adapter_path` when set; every
    other parameter frozen but `keep_trainable`'s."""
    count = apply_lora(model, lora, seed, keep_trainable)
    if lora.adapter_path:
        load_peft_adapter(model, lora.adapter_path)
    logger.info("LoRA rank %d (alpha %g) on %d layer(s) of this stage%s; the base is frozen", lora.rank, lora.alpha,
                count, f", from {lora.adapter_path}" if lora.adapter_path else "")


class AdapterFreeReference(MegatronPolicy):
    """The reference of a LoRA actor: the actor's own model, scored with its adapters off (the base policy)."""

    def _forward(self, stage_model: Any, layout: Any) -> torch.Tensor:
        with adapters_disabled(self.model):
            return super()._forward(stage_model, layout)


def build_policies(model_cfg: ModelConfig, actor_cfg: ActorConfig, pad_token_id: int, total_updates: int,
                   log_prob_micro_batch_size: int = 0, reference: RefConfig | None = None, seed: int = 0
                   ) -> tuple[MegatronPolicy, MegatronPolicy | None]:
    """The actor (DDP + optimizer + schedule) and, given the `reference` section (a run that needs one,
    `Config.needs_reference_model`), the reference, in the same layout (TP/PP/CP/EP/ETP).

    Both start from `actor_rollout_ref.model.path`; `total_updates` sizes the learning-rate schedule;
    `log_prob_micro_batch_size` is the actor's scoring micro-batch (`rollout.log_prob_micro_batch_size_per_gpu`). A
    mixture of experts' actor tracks its routing (`RouterTracker`) and, with `megatron.freeze_moe_router`, keeps its
    routers frozen. With `model.lora` the actor trains adapters (initialised from `seed`, `trainer.seed`) and the
    reference is its base (`AdapterFreeReference`).
    """
    hf_config = load_hf_config(model_cfg.path)
    moe = family_of(hf_config).moe(hf_config) is not None
    dtype = getattr(torch, actor_cfg.megatron.compute_dtype)
    kernels = {"use_fused_kernels": model_cfg.use_fused_kernels, "use_remove_padding": model_cfg.use_remove_padding}

    checkpointing = model_cfg.enable_gradient_checkpointing
    model = build_gpt_model(hf_config, params_dtype=dtype, **model_options(
        actor_cfg.megatron, checkpointing, moe, replay_routing=actor_cfg.router_replay.replays))
    load_hf_weights(model, model_cfg.path)
    if model_cfg.lora.enabled:
        add_adapters(model, model_cfg.lora, seed)
    if moe and actor_cfg.megatron.freeze_moe_router:
        logger.info("froze %d MoE router(s) on this stage (megatron.freeze_moe_router)", freeze_routers(model))
    ddp_model = wrap_ddp(model, actor_cfg.megatron.use_distributed_optimizer)
    optimizer, scheduler = build_optimizer(ddp_model, actor_cfg, total_updates)
    # the routing of a MoE model is tracked (recorded, replayed or compared) except under context parallelism,
    # whose chunked rows the tracker does not map (preflight refuses replay there)
    routing = RouterTracker(model, actor_cfg.router_replay.replays) if (
        moe and actor_cfg.megatron.context_parallel_size == 1) else None
    actor = MegatronPolicy(model, pad_token_id, actor_cfg, log_prob_micro_batch_size, ddp_model, optimizer,
                           scheduler, routing=routing, **kernels)
    if reference is None:
        return actor, None
    if model_cfg.lora.enabled:
        return actor, AdapterFreeReference(model, pad_token_id, actor_cfg, reference.log_prob_micro_batch_size_per_gpu,
                                           **kernels)
    ref_model = build_gpt_model(hf_config, params_dtype=dtype, **model_options(actor_cfg.megatron, checkpointing, moe))
    load_hf_weights(ref_model, model_cfg.path)
    ref_model.requires_grad_(False)
    return actor, MegatronPolicy(ref_model, pad_token_id, actor_cfg, reference.log_prob_micro_batch_size_per_gpu,
                                 **kernels)
