"""The dtype every rank of a run computes in, checked when it starts (`params_dtype: auto` resolves on each
machine, compute_dtype.py)."""
from __future__ import annotations

import logging

import torch.distributed as dist

from megatron_cpo.compute_dtype import resolve_dtype
from megatron_cpo.config_checks import ConfigError
from megatron_cpo.trainer.collectives import all_gather_object
from megatron_cpo.trainer.config import PARAMS_DTYPE_KEY

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
