"""Verifiable rewards: graders, the ``compute_score`` registry, the parallel reward manager, the remote reward model.

Every name loads on first use: a config loads the ``reward.*`` section (config.py) without the graders or torch, and
grading worker processes, which import this package, stay free of torch.
"""
import importlib

_REGISTRY = "megatron_cpo.rewards.registry"
_LAZY = {
    **dict.fromkeys(("ARITH_DATA_SOURCE", "Grader", "compute_score", "get_grader", "known_sources", "missing_graders",
                     "register_custom_graders", "register_grader"), _REGISTRY),
    "RewardConfig": "megatron_cpo.rewards.config",
    "RemoteRewardConfig": "megatron_cpo.rewards.config",
    "RewardManager": "megatron_cpo.rewards.manager",
    "RewardResult": "megatron_cpo.rewards.manager",
    "token_level_rewards": "megatron_cpo.rewards.manager",
    "RemoteRewardModel": "megatron_cpo.rewards.remote",
    "RemoteRewardError": "megatron_cpo.rewards.remote",
    "RewardServer": "megatron_cpo.rewards.reward_server",
    "SandboxLimits": "megatron_cpo.rewards.sandbox_types",
    "run_python": "megatron_cpo.rewards.sandbox",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_cpo.rewards' has no attribute {name!r}")
