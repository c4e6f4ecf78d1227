"""Multi-turn episodes: environments, tools and verl's interactions, run token in and token out (docs/multi_turn.md).

Above `rollout`, `rewards` and `data`, below `trainer`: `EpisodeRunner` (runner.py) is the group generator of a run
with `actor_rollout_ref.rollout.multi_turn.enable` (`MultiTurnConfig`, config.py). The interfaces: an environment
(base.py), tools (tools.py, parsed by tool_calls.py, run by tool_agent.py), interactions (interactions.py); the
environment of a row comes from registry.py; templates.py turns observations into ids; metrics.py sums episodes up.
"""
from megatron_cpo.envs.base import Environment, SingleTurnEnvironment, StepResult, TextEnvironment
from megatron_cpo.envs.config import MultiTurnConfig
from megatron_cpo.envs.registry import BUILTIN_AGENTS, EnvironmentRegistry
from megatron_cpo.envs.runner import EpisodeRunner
from megatron_cpo.envs.tools import Tool, ToolContext, ToolOutput

__all__ = ["BUILTIN_AGENTS", "Environment", "EnvironmentRegistry", "EpisodeRunner", "MultiTurnConfig",
           "SingleTurnEnvironment", "StepResult", "TextEnvironment", "Tool", "ToolContext", "ToolOutput"]
