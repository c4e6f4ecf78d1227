"""Verifiable rewards: graders, the ``compute_score`` registry, the parallel reward manager, the remote reward model.

Every name loads on first use: a config loads the ``reward.*`` section (config.py) without the graders or torch, and
grading worker processes, which import this package, stay free of torch.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "registry": ("ARITH_DATA_SOURCE", "Grader", "compute_score", "get_grader", "known_sources", "missing_graders",
                 "register_custom_graders", "register_grader"),
    "config": ("RewardConfig", "RemoteRewardConfig"),
    "manager": ("RewardManager", "RewardResult", "token_level_rewards"),
    "remote": ("RemoteRewardModel", "RemoteRewardError"),
    "reward_server": ("RewardServer",),
    "sandbox_types": ("SandboxLimits",),
    "sandbox": ("run_python",),
})
