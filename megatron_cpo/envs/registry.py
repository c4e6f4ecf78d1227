"""Which environment runs a row's episodes: its `agent_name` column (verl's), else `multi_turn.default_agent`.

Built in: `tool_agent` (the tools of `tool_config_path` and the interaction of `interaction_config_path`; verl's
agent of that name), `single_turn_agent` (one answer), `frozen_lake`, `arith_retry`; any other name is an import path
("pkg.module:Class") of a class with the `Environment` interface. `multi_turn.agent_kwargs.<name>` are the keyword
arguments its constructor gets. One registry serves a run: tools and interactions are loaded once and shared.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_cpo.envs.arith_retry import ArithmeticRetryEnvironment
from megatron_cpo.envs.base import SingleTurnEnvironment, scores_itself
from megatron_cpo.envs.config import MultiTurnConfig
from megatron_cpo.envs.frozen_lake import FrozenLakeEnvironment
from megatron_cpo.envs.interactions import AsyncCalls, Interaction, load_interactions
from megatron_cpo.envs.threads import DaemonThreads
from megatron_cpo.envs.tool_agent import ToolAgentEnvironment
from megatron_cpo.envs.tools import Tool, load_tools
from megatron_cpo.import_paths import import_object
from megatron_cpo.rewards.sandbox import SandboxConfig

BUILTIN_AGENTS: dict[str, type] = {
    "tool_agent": ToolAgentEnvironment,
    "single_turn_agent": SingleTurnEnvironment,
    "frozen_lake": FrozenLakeEnvironment,
    "arith_retry": ArithmeticRetryEnvironment,
}


def agent_of(record: Any, default: str) -> str:
    """The environment name of a row (a `PromptRecord` or a parquet row): its `agent_name` (verl's column), else the
    default."""
    name = record.get("agent_name") if isinstance(record, dict) else getattr(record, "agent_name", "")
    return str(name or "") or default


class EnvironmentRegistry:
    """Makes the environment of each episode; holds the run's tools, interactions and the tool-call threads."""

    def __init__(self, config: MultiTurnConfig, sandbox: SandboxConfig | None = None) -> None:
        self.config = config
        self.calls = AsyncCalls()
        self.tools: dict[str, Tool] = load_tools(config.tool_config_path, sandbox) if config.tool_config_path else {}
        self.interactions: dict[str, Interaction] = (load_interactions(config.interaction_config_path, self.calls)
                                                     if config.interaction_config_path else {})
        self.tool_pool = DaemonThreads(config.env_workers, "megatron-cpo-tool")
        self._classes: dict[str, type] = {}

    def environment_class(self, agent: str) -> type:
        """The class of an environment name (built in, or imported once); errors name the setting to fix."""
        if agent not in self._classes:
            cls = BUILTIN_AGENTS.get(agent) or import_object(
                agent, "the row's agent_name / actor_rollout_ref.rollout.multi_turn.default_agent")
            if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
                raise ValueError(f"environment {agent!r} is not a class with reset/step (docs/multi_turn.md); use one "
                                 f"of {sorted(BUILTIN_AGENTS)} or 'pkg.module:Class'")
            self._classes[agent] = cls
        return self._classes[agent]

    def factory(self, agent: str) -> Callable[[], Any]:
        """A function making one episode's environment of `agent`."""
        cls = self.environment_class(agent)
        kwargs = dict(self.config.agent_kwargs.get(agent) or {})
        if cls is ToolAgentEnvironment:
            return lambda: ToolAgentEnvironment(self.tools, self.interactions, self.config, self.tool_pool)
        return lambda: cls(**kwargs)

    def scores_itself(self, agent: str) -> bool:
        """Whether `agent`'s episodes get their final score from the environment (no grader needed)."""
        return scores_itself(self.environment_class(agent))

    def close(self) -> None:
        self.tool_pool.shutdown()
        self.calls.close()


def check_rows(config: MultiTurnConfig, rows: list[dict], sandbox: SandboxConfig | None = None
               ) -> tuple[list[str], set[str]]:
    """What can be known about multi-turn rows before anything starts: the tool and interaction configs load, every
    row's environment exists, every interaction a row names is configured. Also returns the data sources whose rows'
    environments all score themselves (they need no grader)."""
    try:
        registry = EnvironmentRegistry(config, sandbox)
    except (ValueError, TypeError) as err:
        return [str(err)], set()
    problems: list[str] = []
    scoring: dict[str, bool] = {}
    try:
        known = set()
        for agent in sorted({agent_of(row, config.default_agent) for row in rows}):
            try:
                registry.environment_class(agent)
                known.add(agent)
            except ValueError as err:
                problems.append(str(err))
        for row in rows:
            agent = agent_of(row, config.default_agent)
            if agent in known:
                source = row.get("data_source")
                scoring[source] = scoring.get(source, True) and registry.scores_itself(agent)
        named = {str(((row.get("extra_info") or {}).get("interaction_kwargs") or {}).get("name") or "")
                 for row in rows} - {""}
        unknown = sorted(named - set(registry.interactions)) if registry.interactions else []
        if unknown:
            problems.append(f"rows name the interactions {unknown} (extra_info.interaction_kwargs.name), which "
                            f"actor_rollout_ref.rollout.multi_turn.interaction_config_path does not configure")
    finally:
        registry.close()
    return problems, {source for source, itself in scoring.items() if itself}
