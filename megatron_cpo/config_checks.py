"""The error a bad setting raises, and the two checks every config section uses to raise it.

A leaf module (it imports nothing of the package), so that each section's dataclass can live next to the code that
reads it, in any layer, and still report a bad value the same way: the message names the value and the fix.
"""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which value and how to fix it."""


def check(condition: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `condition`."""
    if not condition:
        raise ConfigError(message)


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """Raise a `ConfigError` naming `name=value` and the accepted `choices` unless `value` is one of them."""
    check(value in choices, f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}")
