"""verl's interactions, duck-typed: an object with ``BaseInteraction``'s methods answers the model between turns.

Loaded from verl's interaction-config YAML without verl; sync or ``async def`` methods (coroutines run on one
private event-loop thread). The interface and YAML: docs/multi_turn.md, "Interactions".
"""
from __future__ import annotations

import asyncio
import inspect
import threading
from pathlib import Path
from typing import Any

from megatron_cpo.envs.base import Message, yaml_entries
from megatron_cpo.import_paths import import_object


class AsyncCalls:
    """Runs the coroutines that interactions return on one private event loop (started on first use)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def result(self, value: Any) -> Any:
        """`value` itself, or what it evaluates to when it is awaitable."""
        if not inspect.isawaitable(value):
            return value
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="megatron-cpo-interactions", daemon=True).start()

        async def wait() -> Any:
            return await value
        return asyncio.run_coroutine_threadsafe(wait(), self._loop).result()

    def close(self) -> None:
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None


class Interaction:
    """One configured interaction (`name`), called through verl's method names."""

    def __init__(self, name: str, target: Any, calls: AsyncCalls) -> None:
        if not callable(getattr(target, "generate_response", None)):
            raise ValueError(f"interaction {name!r} ({type(target).__name__}) has no generate_response(instance_id, "
                             "messages, **kwargs) method")
        self.name, self.target, self.calls = name, target, calls

    def _optional(self, method: str, *args: Any, **kwargs: Any) -> Any:
        function = getattr(self.target, method, None)
        return self.calls.result(function(*args, **kwargs)) if callable(function) else None

    def start(self, instance_id: str, kwargs: dict[str, Any]) -> None:
        self._optional("start_interaction", instance_id, **kwargs)

    def respond(self, instance_id: str, messages: list[Message], kwargs: dict[str, Any]
                ) -> tuple[bool, str, float, dict]:
        answer = self.calls.result(self.target.generate_response(instance_id, messages, **kwargs))
        if not (isinstance(answer, tuple) and len(answer) == 4):
            raise ValueError(f"interaction {self.name!r}: generate_response returned {answer!r}; it must return "
                             "(should_terminate, response, score, metadata)")
        done, text, score, metadata = answer
        return bool(done), str(text), float(score or 0.0), dict(metadata or {})

    def has_score(self) -> bool:
        return callable(getattr(self.target, "calculate_score", None))

    def score(self, instance_id: str, kwargs: dict[str, Any]) -> float | None:
        value = self._optional("calculate_score", instance_id, **kwargs)
        return None if value is None else float(value)

    def finalize(self, instance_id: str, kwargs: dict[str, Any]) -> None:
        self._optional("finalize_interaction", instance_id, **kwargs)


def load_interactions(path: str | Path, calls: AsyncCalls) -> dict[str, Interaction]:
    """The interactions of a verl interaction-config YAML file by name (verl's default name: the class name without
    its `Interaction` suffix, lower case)."""
    where, entries = yaml_entries(path, "interaction_config_path", "interaction", "name, class_name, config")
    interactions: dict[str, Interaction] = {}
    for index, entry in enumerate(entries):
        class_name = str(entry["class_name"])
        cls = import_object(class_name, f"{where}: interaction[{index}].class_name")
        simple = class_name.replace(":", ".").rsplit(".", 1)[-1]
        name = entry.get("name") or (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if name in interactions:
            raise ValueError(f"{where}: two interactions are named {name!r}; names must be unique")
        interactions[name] = Interaction(name, cls(config={**(entry.get("config") or {}), "name": name}), calls)
    return interactions
