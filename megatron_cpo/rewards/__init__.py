"""Verifiable rewards: graders, the ``compute_score`` registry, the parallel reward manager, the remote reward model.

Torch-dependent names (``RewardManager``, ``token_level_rewards``, ...) load on first use so that grading worker
processes, which import this package, stay free of torch.
"""
import importlib

from megatron_cpo.rewards.registry import (
    ARITH_DATA_SOURCE,
    Grader,
    compute_score,
    get_grader,
    known_sources,
    load_callable,
    missing_graders,
    register_custom_graders,
    register_grader,
)

_LAZY = {
    "RewardConfig": "megatron_cpo.rewards.manager",
    "RewardManager": "megatron_cpo.rewards.manager",
    "RewardResult": "megatron_cpo.rewards.manager",
    "token_level_rewards": "megatron_cpo.rewards.manager",
    "RemoteRewardConfig": "megatron_cpo.rewards.remote",
    "RemoteRewardModel": "megatron_cpo.rewards.remote",
    "RemoteRewardError": "megatron_cpo.rewards.remote",
    "RewardServer": "megatron_cpo.rewards.reward_server",
    "SandboxLimits": "megatron_cpo.rewards.sandbox_types",
    "run_python": "megatron_cpo.rewards.sandbox",
}

__all__ = ["ARITH_DATA_SOURCE", "Grader", "compute_score", "get_grader", "known_sources", "load_callable",
           "missing_graders", "register_custom_graders", "register_grader", *_LAZY]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_cpo.rewards' has no attribute {name!r}")
