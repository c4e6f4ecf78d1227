"""Multi-turn episodes: environments, tools and verl's interactions, run token in and token out (docs/multi_turn.md).

Above `rollout`, `rewards` and `data`, below `trainer`: `EpisodeRunner` (runner.py) is the group generator of a run
with `multi_turn.enable`; environments (base.py, registry.py), tools (tools.py, tool_calls.py, tool_agent.py),
interactions, observation ids (templates.py), metrics. Names load on first use, so a config loads without torch.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "base": ("Environment", "SingleTurnEnvironment", "StepResult", "TextEnvironment"),
    "config": ("MultiTurnConfig",),
    "registry": ("BUILTIN_AGENTS", "EnvironmentRegistry"),
    "runner": ("EpisodeRunner",),
    "tools": ("Tool", "ToolContext", "ToolOutput"),
})
