"""Multi-turn episodes: environments, tools and verl's interactions, run token in and token out (docs/multi_turn.md).

Above `rollout`, `rewards` and `data`, below `trainer`: `EpisodeRunner` (runner.py) is the group generator of a run
with `actor_rollout_ref.rollout.multi_turn.enable` (`MultiTurnConfig`, config.py). The interfaces: an environment
(base.py), tools (tools.py, parsed by tool_calls.py, run by tool_agent.py), interactions (interactions.py); the
environment of a row comes from registry.py; templates.py turns observations into ids; metrics.py sums episodes up.
Names load on first use, so that loading a config (which reads `config.py` here) imports no torch.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "base": ("Environment", "SingleTurnEnvironment", "StepResult", "TextEnvironment"),
    "config": ("MultiTurnConfig",),
    "registry": ("BUILTIN_AGENTS", "EnvironmentRegistry"),
    "runner": ("EpisodeRunner",),
    "tools": ("Tool", "ToolContext", "ToolOutput"),
})
