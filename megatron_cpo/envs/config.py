"""`actor_rollout_ref.rollout.multi_turn.*`: multi-turn episodes (verl's names, plus the few settings verl lacks).

Read by the episode runner (`envs/runner.py`) and the environment registry (`envs/registry.py`); docs/multi_turn.md
shows every interface these settings load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_cpo.config_checks import check, check_choice

TRUNCATE_SIDES = ("left", "middle", "right")
SANITY_CHECK_MODES = ("strict", "warn", "off", "disable", "ignore_strippable")
TOOL_CALL_FORMATS = ("hermes",)


@dataclass
class MultiTurnConfig:
    """Multi-turn episodes: each of a prompt's `rollout.n` samples is an episode in which the model's turns alternate
    with an environment's observations, token in and token out. The environment of each row (`agent_name`, else
    `default_agent`, with `agent_kwargs`), verl's tool and interaction YAML, the turn and length limits, the worker
    threads and timeouts and verl's `tokenization_sanity_check_mode`: docs/multi_turn.md.
    """
    enable: bool = False
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_tokens_per_turn: int = 0
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_config_path: str = ""
    interaction_config_path: str = ""
    tokenization_sanity_check_mode: str = "strict"
    format: str = "hermes"
    default_agent: str = "tool_agent"
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    call_timeout_s: float = 30.0
    env_workers: int = 8

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout.multi_turn."
        for name in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and value >= 1),
                  f"{prefix}{name}={value!r} must be >= 1, or null for no limit")
        check(self.max_tokens_per_turn >= 0, f"{prefix}max_tokens_per_turn={self.max_tokens_per_turn} must be >= 0 "
              "(0: a turn may use what is left of data.max_response_length)")
        check(self.max_parallel_calls >= 1, f"{prefix}max_parallel_calls={self.max_parallel_calls} must be >= 1")
        check(self.max_tool_response_length >= 1,
              f"{prefix}max_tool_response_length={self.max_tool_response_length} must be >= 1 (characters)")
        check_choice(prefix + "tool_response_truncate_side", self.tool_response_truncate_side, TRUNCATE_SIDES)
        check_choice(prefix + "tokenization_sanity_check_mode", self.tokenization_sanity_check_mode,
                     SANITY_CHECK_MODES)
        check_choice(prefix + "format", self.format, TOOL_CALL_FORMATS)
        check(self.call_timeout_s > 0, f"{prefix}call_timeout_s={self.call_timeout_s} must be > 0 (seconds)")
        check(self.env_workers >= 1, f"{prefix}env_workers={self.env_workers} must be >= 1")
        check(bool(self.default_agent), f"{prefix}default_agent is empty; name the environment of rows without an "
              "agent_name (tool_agent, single_turn_agent, frozen_lake, arith_retry or pkg.module:Class)")
        for agent, kwargs in self.agent_kwargs.items():
            check(isinstance(kwargs, dict), f"{prefix}agent_kwargs.{agent}={kwargs!r} must be a mapping of keyword "
                  "arguments of that environment's constructor")

    @property
    def check_mode(self) -> str:
        """The sanity check's mode with verl's spellings resolved: strict, warn, off or ignore_strippable."""
        return "off" if self.tokenization_sanity_check_mode == "disable" else self.tokenization_sanity_check_mode

    def turn_limit_reached(self, assistant_turns: int, user_turns: int) -> str | None:
        """The turn limit an episode has reached, if any (`max_assistant_turns` first)."""
        if self.max_assistant_turns is not None and assistant_turns >= self.max_assistant_turns:
            return "max_assistant_turns"
        if self.max_user_turns is not None and user_turns >= self.max_user_turns:
            return "max_user_turns"
        return None
