"""From a YAML file and dotted command-line overrides to a validated, typed config tree.

The loader knows nothing of the run's settings: it walks whatever dataclass tree it is given (`megatron_cpo.config`
passes `Config`, its one alias table and verl_compat.py's data). It flattens the YAML to dotted names, applies the
overrides after it, rewrites accepted aliases to their canonical names (two names of one setting given different
values is an error), sets aside verl keys that do not apply here (one warning names them all, with why), coerces every
value to its field's declared type (a scalar given for a list becomes a one-element list) and builds the
dataclasses, whose `__post_init__` validate them.

Every problem of a command is reported at once: unknown keys (with a hint that matches the last path components
first), values of the wrong type, and failed validations, in one `ConfigError`.
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_cpo.config_checks import ConfigError
from megatron_cpo.verl_compat import NoOpKey

logger = logging.getLogger(__name__)
REFERENCE_PAGE = "docs/config_reference.md"


def _flatten(tree: dict, prefix: str = "", mappings: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Dotted name -> value; the value of a dict-typed field (`mappings`) stays one dict, its keys being data."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name not in mappings:
            flat.update(_flatten(value, name + ".", mappings))
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


def entry_type(tp: Any) -> type | None:
    """The dataclass of a `dict[str, SomeDataclass]` field's entries (a table of named sections, e.g.
    `distillation.teacher_models`), else None."""
    args = typing.get_args(tp)
    return args[1] if typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]) else None


def entry_tables(cls: type, prefix: str = "") -> dict[str, type]:
    """Dotted name -> entry dataclass of every table of named sections in the tree."""
    tables = {}
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            tables.update(entry_tables(tp, f"{prefix}{name}."))
        elif entry_type(tp) is not None:
            tables[prefix + name] = entry_type(tp)
    return tables


def expand_entries(flat: dict[str, Any], tables: dict[str, type], errors: list[str]) -> list[str]:
    """Spread each table's folded value (`{entry: {...}}` from a file, `{"entry.key": value}` from overrides) back
    into dotted names `table.entry.key`; returns every such entry's accepted names (for the unknown-key check)."""
    known = []
    for table, cls in tables.items():
        value = flat.pop(table, None)
        if value is None:
            continue
        if not isinstance(value, dict):
            errors.append(f"{table}={value!r} is not a mapping; give {table}.<name>.<key>=value")
            continue
        for key, item in value.items():
            entry, _, rest = str(key).partition(".")
            if rest:
                flat[f"{table}.{entry}.{rest}"] = item
            elif isinstance(item, dict):
                flat.update({f"{table}.{entry}.{name}": v for name, v in _flatten(item).items()})
            else:
                errors.append(f"{table}.{entry}={item!r} is not a mapping; give {table}.{entry}.<key>=value")
                continue
            known += known_names(cls, f"{table}.{entry}.")
    return sorted(set(known))


def mapping_fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of the dict-typed fields (e.g. `reward.custom_graders`)."""
    names = []
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            names.extend(mapping_fields(tp, f"{prefix}{name}."))
        elif typing.get_origin(tp) is dict:
            names.append(prefix + name)
    return names


def fold_mappings(flat: dict[str, Any], mappings: list[str], errors: list[str]) -> None:
    """Put `reward.custom_graders.<source>` entries (a YAML mapping, flattened, or overrides) back into one dict
    value; the key after the field name is the source, dots and slashes included."""
    for mapping in mappings:
        entries = {name[len(mapping) + 1:]: flat.pop(name) for name in list(flat) if name.startswith(mapping + ".")}
        if entries:
            current = flat.get(mapping) or {}
            if not isinstance(current, dict):
                errors.append(f"{mapping}={current!r} is not a mapping; give {{source: 'pkg.module:fn'}}")
                continue
            flat[mapping] = {**current, **entries}


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _coerce_scalar(value: Any, tp: Any) -> Any:
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
    return value


def coerce(name: str, value: Any, tp: Any) -> Any:
    """Convert a YAML value to the field's declared type, or raise a `ConfigError` saying what was expected.

    A scalar given for a list becomes a one-element list (`trainer.logger=jsonl`); a tuple must have its length."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple and args and args[-1] is not Ellipsis:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(items) != len(args):
            raise ConfigError(f"{name}={items} must hold {len(args)} values "
                              f"({', '.join(_type_name(t) for t in args)}); give a list of {len(args)}")
    try:
        if origin is dict:
            if not isinstance(value, dict):
                raise TypeError
            return {str(key): item for key, item in value.items()}
        if origin in (list, tuple):
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            converted = [_coerce_scalar(item, args[0] if args else Any) for item in items]
            return converted if origin is list else tuple(converted)
        return _coerce_scalar(value, tp)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a valid {_type_name(tp)}; give a value of that type") from None


def hint_for(name: str, known: list[str], moved: dict[str, str]) -> str:
    """The accepted name closest to an unknown `name`: a known verl move first, then the names ending in the most
    of its last path components (the first declared of several: the actor's `optim.betas` before the critic's), then
    names whose last component is spelled alike; "" when nothing is close."""
    if name in moved:
        return moved[name]
    parts = name.split(".")
    for count in range(len(parts) - 1, 0, -1):
        suffix = ".".join(parts[-count:])
        matches = [k for k in known if k.endswith("." + suffix)]
        if matches:
            return matches[0]
        moved_matches = [target for source, target in moved.items() if source.endswith("." + suffix)]
        if moved_matches:
            return max(moved_matches, key=lambda k: difflib.SequenceMatcher(None, name, k).ratio())
    last = parts[-1]
    alike = [k for k in known if difflib.SequenceMatcher(None, last, k.rsplit(".", 1)[-1]).ratio() >= 0.75]
    if alike:
        return max(alike, key=lambda k: difflib.SequenceMatcher(None, name, k).ratio())
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return close[0] if close else ""


@dataclass
class Resolved:
    """A built config and the verl keys that were accepted without effect: name -> (value, why)."""
    config: Any
    ignored: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def ignored_warning(self) -> str:
        """One line naming every ignored key and why it does not apply ("" when none)."""
        if not self.ignored:
            return ""
        items = "; ".join(f"{name}={value!r} ({why})" for name, (value, why) in self.ignored.items())
        return f"{len(self.ignored)} verl setting(s) accepted but not used here: {items}"


def _matches_allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    normal = value.lower() if isinstance(value, str) else value
    return any(normal == (a.lower() if isinstance(a, str) else a) for a in allowed)


class ConfigLoader:
    """Builds the dataclass tree `root` from dotted names.

    `aliases` maps accepted spellings to canonical names; `alias_implies` sets a canonical value whenever an alias is
    used (unless that value is given explicitly); `no_op_keys` are accepted without effect (see `NoOpKey`);
    `must_equal` maps a key to the canonical name whose value it must repeat, and why; `moved_hints` are names that
    moved, used only for hints."""

    def __init__(self, root: type, aliases: dict[str, str], alias_implies: dict[str, tuple[str, Any]],
                 no_op_keys: tuple[NoOpKey, ...] = (), must_equal: dict[str, tuple[str, str]] | None = None,
                 moved_hints: dict[str, str] | None = None) -> None:
        self.root = root
        self.aliases = aliases
        self.alias_implies = alias_implies
        self.no_op_keys = no_op_keys
        self.must_equal = must_equal or {}
        self.moved_hints = moved_hints or {}

    def _build(self, cls: type, flat: dict[str, Any], errors: list[str], prefix: str = "") -> Any:
        """Build `cls` from `flat`, appending every problem to `errors`; a nested part that fails is replaced by its
        defaults so the other parts are still checked."""
        kwargs = {}
        for name, tp in field_types(cls).items():
            dotted = prefix + name
            if dataclasses.is_dataclass(tp):
                kwargs[name] = self._build(tp, flat, errors, dotted + ".")
            elif entry_type(tp) is not None:
                inside = [n[len(dotted) + 1:] for n in flat if n.startswith(dotted + ".")]
                entries = dict.fromkeys(n.split(".", 1)[0] for n in inside)
                kwargs[name] = {entry: self._build(entry_type(tp), flat, errors, f"{dotted}.{entry}.")
                                for entry in entries}
            elif dotted in flat:
                try:
                    kwargs[name] = coerce(dotted, flat[dotted], tp)
                except ConfigError as err:
                    errors.append(str(err))
        if errors and cls is self.root:
            return None  # cross-field checks on a partly defaulted tree would only add confusing errors
        try:
            return cls(**kwargs)
        except ValueError as err:  # ConfigError, or the ValueError of a component's own config dataclass
            errors.append(str(err))
            return cls()

    def _set_aside(self, flat: dict[str, Any], errors: list[str]) -> tuple[dict, dict]:
        """Pop the verl keys that do not apply (-> ignored) and those that must repeat another value."""
        ignored, repeated = {}, {}
        for name in list(flat):
            rule = next((r for r in self.no_op_keys if fnmatch.fnmatchcase(name, r.pattern)), None)
            if rule is not None:
                value = flat.pop(name)
                if rule.allowed is not None and not _matches_allowed(value, rule.allowed):
                    errors.append(f"{name}={value!r} cannot be honoured here: {rule.reason}; use "
                                  f"{' or '.join(map(repr, rule.allowed))} or remove it")
                else:
                    ignored[name] = (value, rule.reason)
            elif name in self.must_equal:
                repeated[name] = flat.pop(name)
        return ignored, repeated

    def _canonical(self, flat: dict[str, Any], errors: list[str], given_before: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
        """`flat` with aliases rewritten and implied values set unless given here or in `given_before`. Two names
        of one setting given different values (an alias and its canonical name, or two aliases) is an error."""
        for alias, implied in self.alias_implies.items():
            if alias in flat and implied[0] not in flat and implied[0] not in (given_before or {}):
                flat[implied[0]] = implied[1]
        given_as = {name: name for name in flat}
        for alias, canonical in self.aliases.items():
            if alias not in flat:
                continue
            value = flat.pop(alias)
            if canonical in flat and flat[canonical] != value:
                errors.append(f"{alias}={value!r} and {given_as[canonical]}={flat[canonical]!r} set the same "
                              f"setting ({canonical}) to different values; keep one")
            flat.setdefault(canonical, value)
            given_as.setdefault(canonical, alias)
        return flat

    def resolve(self, tree: dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Resolved:
        """Build and validate the config from a nested dict (a parsed YAML file) and dotted overrides after it;
        raise one `ConfigError` listing every problem."""
        errors: list[str] = []
        flat = self._canonical(_flatten(tree or {}, mappings=frozenset(mapping_fields(self.root))), errors)
        given = {}
        for text in overrides:
            try:
                name, value = parse_override(text)
            except ConfigError as err:
                errors.append(str(err))
                continue
            given[name] = value
        flat.update(self._canonical(given, errors, flat))  # an override wins over the file under either name
        fold_mappings(flat, mapping_fields(self.root), errors)
        entry_names = expand_entries(flat, entry_tables(self.root), errors)
        ignored, repeated = self._set_aside(flat, errors)
        known = known_names(self.root) + entry_names
        for name in [n for n in flat if n not in known]:
            flat.pop(name)
            close = hint_for(name, known, {**self.aliases, **self.moved_hints})
            errors.append(f"unknown config key {name!r}" + (f"; did you mean {close!r}?" if close else
                                                             f"; see {REFERENCE_PAGE} for the accepted names"))
        config = self._build(self.root, flat, errors)
        if config is not None:
            for name, value in repeated.items():
                target, why = self.must_equal[name]
                actual = config
                for part in target.split("."):
                    actual = getattr(actual, part)
                if value != actual:
                    errors.append(f"{name}={value!r} differs from {target}={actual!r}: {why}; set them equal or "
                                  f"remove {name}")
                else:
                    ignored[name] = (value, f"{why} (equal to {target})")
        if len(errors) == 1:
            raise ConfigError(errors[0])
        if errors:
            listed = "\n".join(f"  - {e}" for e in errors)
            raise ConfigError(f"{len(errors)} problems in the config (names and types: {REFERENCE_PAGE}):\n{listed}")
        return Resolved(config, ignored)

    def build(self, tree: dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
        """`resolve(...).config`, logging one warning that lists the verl keys accepted without effect."""
        resolved = self.resolve(tree, overrides)
        if resolved.ignored:
            logger.warning("%s", resolved.ignored_warning())
        return resolved.config

    @staticmethod
    def read_tree(path: str | Path | None) -> dict:
        """The mapping a YAML config file holds ({} without a file)."""
        if path is None:
            return {}
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --config")
        tree = yaml.safe_load(path.read_text()) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        return tree

    def load(self, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
        """Read a YAML config file (optional) and apply dotted `name=value` overrides; validate the result."""
        return self.build(self.read_tree(path), overrides)

    def resolve_file(self, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Resolved:
        """`load` that also returns the ignored verl keys instead of logging them."""
        return self.resolve(self.read_tree(path), overrides)
