"""Multi-turn episodes: environments, tools and verl's interactions, run token in and token out (docs/multi_turn.md).

Above `rollout`, `rewards` and `data`, below `trainer`: `EpisodeRunner` (runner.py) is the group generator of a run
with `actor_rollout_ref.rollout.multi_turn.enable` (`MultiTurnConfig`, config.py). The interfaces: an environment
(base.py), tools (tools.py, parsed by tool_calls.py, run by tool_agent.py), interactions (interactions.py); the
environment of a row comes from registry.py; templates.py turns observations into ids; metrics.py sums episodes up.
Names load on first use, so that loading a config (which reads `config.py` here) imports no torch.
"""

import importlib

_LAZY = {
    **dict.fromkeys(("Environment", "SingleTurnEnvironment", "StepResult", "TextEnvironment"),
                    "megatron_cpo.envs.base"),
    "MultiTurnConfig": "megatron_cpo.envs.config",
    **dict.fromkeys(("BUILTIN_AGENTS", "EnvironmentRegistry"), "megatron_cpo.envs.registry"),
    "EpisodeRunner": "megatron_cpo.envs.runner",
    **dict.fromkeys(("Tool", "ToolContext", "ToolOutput"), "megatron_cpo.envs.tools"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
