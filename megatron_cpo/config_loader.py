"""From a YAML file and dotted command-line overrides to a validated, typed config tree.

The loader knows nothing of the run's settings: it walks whatever dataclass tree it is given (`megatron_cpo.config`
passes `Config` and its alias tables). It flattens the YAML to dotted names, applies the overrides after it,
rewrites accepted aliases to their canonical names, coerces every value to its field's declared type and builds the
dataclasses (whose `__post_init__` validate them).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which value and how to fix it."""


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """Parse one `dotted.name=value` command-line override; the value is read as YAML (numbers, lists, bools)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} has no '='; write it as dotted.name=value, e.g. data.train_batch_size=8")
    name, raw = text.split("=", 1)
    name = name.strip().lstrip("+")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: value {raw!r} is not valid YAML ({err}); quote it") from err
    return name, value


def field_types(cls: type) -> dict[str, Any]:
    """The declared (resolved) type of each field of a dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def known_names(cls: type, prefix: str = "") -> list[str]:
    """Every dotted leaf name of the dataclass tree rooted at `cls`."""
    names = []
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            names.extend(known_names(tp, f"{prefix}{name}."))
        else:
            names.append(prefix + name)
    return names


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Convert a YAML value to the field's declared type, or explain what was expected."""
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if not isinstance(value, bool):
                raise TypeError
            return value
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if tp is str:
            if isinstance(value, (dict, list)):
                raise TypeError
            return "" if value is None else str(value)
        if origin in (list, tuple):
            return list(value) if origin is list else tuple(float(v) for v in value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(f"{name}={value!r} is not a valid {getattr(tp, '__name__', tp)}; give a value of that type")


class ConfigLoader:
    """Builds the dataclass tree `root` from dotted names; `aliases` maps accepted spellings to canonical names and
    `alias_implies` sets a canonical value whenever an alias is used (unless that value is given explicitly)."""

    def __init__(self, root: type, aliases: dict[str, str], alias_implies: dict[str, tuple[str, Any]]) -> None:
        self.root = root
        self.aliases = aliases
        self.alias_implies = alias_implies

    def _build(self, cls: type, flat: dict[str, Any], prefix: str = "") -> Any:
        kwargs = {}
        for name, tp in field_types(cls).items():
            dotted = prefix + name
            if dataclasses.is_dataclass(tp):
                kwargs[name] = self._build(tp, flat, dotted + ".")
            elif dotted in flat:
                kwargs[name] = _coerce(dotted, flat[dotted], tp)
        return cls(**kwargs)

    def build(self, tree: dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
        """Build and validate the config from a nested dict (a parsed YAML file) and dotted overrides after it."""
        flat = _flatten(tree or {})
        for text in overrides:
            name, value = parse_override(text)
            flat[name] = value
        for alias, implied in self.alias_implies.items():
            if alias in flat and implied[0] not in flat:
                flat[implied[0]] = implied[1]
        for alias, canonical in self.aliases.items():
            if alias in flat:
                value = flat.pop(alias)
                flat.setdefault(canonical, value)
        known = known_names(self.root)
        for name in flat:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else "; see megatron_cpo/config.py for the accepted names"
                raise ConfigError(f"unknown config key {name!r}{hint}")
        return self._build(self.root, flat)

    def load(self, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
        """Read a YAML config file (optional) and apply dotted `name=value` overrides; validate the result."""
        tree: dict = {}
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --config")
            tree = yaml.safe_load(path.read_text()) or {}
            if not isinstance(tree, dict):
                raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        return self.build(tree, overrides)
