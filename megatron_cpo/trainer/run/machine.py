"""What a run takes of the machine when it starts: the dtype every rank computes in (`params_dtype: auto` resolves
on each machine, compute_dtype.py), and on a CPU the trainer's threads beside engines that generate while it trains
(rollout/cpu_resources.py)."""
from __future__ import annotations

import logging
import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.compute_dtype import resolve_dtype
from megatron_cpo.config_checks import ConfigError
from megatron_cpo.rollout.cpu_resources import trainer_threads, usable_cores
from megatron_cpo.trainer.config import PARAMS_DTYPE_KEY
from megatron_cpo.trainer.workers.collectives import all_gather_object

logger = logging.getLogger(__name__)


def check_dtype(params_dtype: str) -> None:
    """Collective: every rank computes in the same dtype (`auto` resolves on each machine: machines that differ in
    bf16 support would disagree); rank 0 says which dtype and why, and warns of an explicit bf16 that is slow here."""
    chosen = resolve_dtype(params_dtype)
    if params_dtype == "auto" and len(set(all_gather_object(chosen.name))) > 1:
        raise ConfigError(f"{PARAMS_DTYPE_KEY}=auto chose different dtypes on different ranks (their machines differ "
                          "in bf16 support); set it to bfloat16 or float32")
    if dist.get_rank() == 0:
        chosen.announce(logger, "the actor and the engines", PARAMS_DTYPE_KEY)


def leave_cores_to_engines(max_staleness: int, rollout_mode: str) -> None:
    """A one-process CPU run whose engines generate while it trains (asynchronous training, engines on this
    machine) trains on the cores the engines leave, so the two do not fight for every core
    (rollout/cpu_resources.py); with several ranks torchrun already gives each one thread. `Trainer.close` restores
    the thread count."""
    if platform.has_cuda() or max_staleness == 0 or dist.get_world_size() > 1 or rollout_mode == "server":
        return
    threads = trainer_threads(len(usable_cores()))
    torch.set_num_threads(threads)
    logger.info("training on %d torch thread(s): the engines generate beside it on the other cores (asynchronous)",
                threads)
