"""The environment interface: one instance per episode, Gym-shaped, on chat messages.

``reset`` gives the starting conversation, ``step`` takes the model's turn text and returns observation messages,
a reward and done, ``score`` the final score (None: the grader grades the last answer). Calls run on a worker
thread with a timeout (envs/runner.py), never two at once per episode; docs/multi_turn.md, "Environments".
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml

Message = dict[str, Any]


@dataclass
class StepResult:
    """What one `step` returns: messages to append (user or tool turns), the turn's reward, done, and extra info
    (`info["tool_calls"]` / `info["tool_failures"]`: counts by tool name / failure kind, read by the runner)."""
    messages: list[Message]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (see the module docstring). `tool_schemas` (OpenAI function schemas) are given to
    the chat template with the first prompt; `error_role` is the role of the error observation the runner appends
    when `step` raises."""

    tool_schemas: list[dict]
    error_role: str

    def reset(self, record: Any, seed: int) -> list[Message]:
        """The conversation the episode starts from."""

    def step(self, action_text: str) -> StepResult:
        """Apply the model's turn; the observation, reward, done and info."""

    def score(self) -> float | None:
        """The final score added to the step rewards, or None to let the data source's grader grade the last
        answer."""

    def close(self) -> None:
        """Release what the episode held."""


class TextEnvironment(ABC):
    """A base for environments: no tools, user observations, no final score (the grader grades the last answer
    unless a subclass returns one), nothing to release."""

    tool_schemas: list[dict] = []
    error_role = "user"

    def reset(self, record: Any, seed: int) -> list[Message]:
        return [dict(message) for message in record.messages]

    @abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply the model's turn; the observation, reward, done and info."""

    def score(self) -> float | None:
        return None

    def close(self) -> None:
        return None


class SingleTurnEnvironment(TextEnvironment):
    """verl's `single_turn_agent`: the row's prompt, one answer, graded by the data source's grader."""

    def step(self, action_text: str) -> StepResult:
        return StepResult(messages=[], done=True)


def scores_itself(environment_class: type) -> bool:
    """Whether an environment class defines its own final score (so its rows need no grader)."""
    score = getattr(environment_class, "score", None)
    return score is not None and score is not TextEnvironment.score


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def yaml_entries(path: str | Path, setting: str, key: str, fields: str) -> tuple[str, list[dict]]:
    """The `key:` list of one of verl's YAML config files (tools, interactions), each entry with a `class_name`; and
    how errors name the file (`setting=path`). `fields` is the entries' shape, for the error message."""
    where = f"actor_rollout_ref.rollout.multi_turn.{setting}={str(path)!r}"
    try:
        document = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"{where} cannot be read ({err}); point it at verl's YAML file") from None
    entries = document.get(key) if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where} has no `{key}:` list (verl's format: {key}: [{{{fields}}}])")
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry.get("class_name"):
            raise ValueError(f"{where}: {key}[{index}] has no class_name")
    return where, entries
