"""The Megatron optimizers of the actor and the critic: DDP wrapper, (distributed) Adam, warm-up + decay schedule,
gradient clipping.

On a machine without CUDA, `platform.apply_cpu_optimizer_adaptation` lets Megatron-Core's optimizers accept CPU
parameters (they check legacy CUDA type strings).
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_cpo import platform
from megatron_cpo.trainer.config import ActorConfig, OptimConfig


def wrap_ddp(model: Any, use_distributed_optimizer: bool) -> Any:
    """Megatron DDP around a trainable model (the actor, the critic): contiguous fp32 grad buffers, reduce-scatter
    for the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                               grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    wrapped = DistributedDataParallel(model.config, ddp_config, model)
    model.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(ddp_model: Any, actor: ActorConfig, total_updates: int) -> tuple[Any, Any]:
    """The actor's optimizer and schedule (`actor.optim`, its dtype and distributed optimizer): `megatron_optimizer`."""
    return megatron_optimizer(ddp_model, actor.optim, actor.megatron.compute_dtype,
                              actor.megatron.use_distributed_optimizer, total_updates)


def megatron_optimizer(ddp_model: Any, optim: OptimConfig, params_dtype: str, use_distributed_optimizer: bool,
                       total_updates: int) -> tuple[Any, Any]:
    """Adam (decoupled weight decay) over the DDP model and its schedule: linear warm-up then `lr_decay_style`.

    `total_updates` is the number of optimizer steps of the whole run (steps x PPO epochs x mini-batches); the
    schedule is advanced before each update, so the first update already uses a non-zero learning rate.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    platform.apply_cpu_optimizer_adaptation()
    dtype = getattr(torch, params_dtype)
    config = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], clip_grad=optim.clip_grad,
        use_distributed_optimizer=use_distributed_optimizer,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype)
    optimizer = get_megatron_optimizer(config, [ddp_model])
    warmup = min(optim.lr_warmup_steps, max(total_updates - 1, 0))
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(total_updates, 1), lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=max(total_updates, 1),
        wd_incr_style="constant")
    return optimizer, scheduler
