"""Validation helpers shared by the config sections: an error names the value and says how to fix it."""
from __future__ import annotations

from typing import Any

from megatron_cpo.config_loader import ConfigError


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_choice(name: str, value: Any, choices: tuple) -> None:
    check(value in choices, f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}")
