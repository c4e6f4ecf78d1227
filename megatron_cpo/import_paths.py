"""The one reader of settings that name a Python object: environments, tools and interactions (`envs/`), graders
and reward functions (`rewards/`), a remote reward server's scorer.

Accepted forms: `pkg.module:Name`, `pkg.module.Name` and `path/to/file.py:name` (a Python file by path, as verl's
`custom_reward_function.path`). Errors are one line: the setting and its value, what is wrong, how to fix it.
"""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

FORMS = "'pkg.module:Name', 'pkg.module.Name' or 'path/to/file.py:name'"


def import_object(path: str, where: str) -> Any:
    """The object `path` names; `where` is the setting that named it (errors start with `where=path`)."""
    module_name, separator, name = path.rpartition(":") if ".py:" in path else path.partition(":")
    if not separator:
        module_name, _, name = path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{where}={path!r} must look like {FORMS}")
    load = _file_module if module_name.endswith(".py") else _module
    module = load(module_name, path, where)
    if not hasattr(module, name):
        raise ValueError(f"{where}={path!r}: module {module_name!r} has no {name!r}; name one it defines")
    return getattr(module, name)


def import_callable(path: str, where: str) -> Callable:
    """`import_object`, which must be callable (a function, or a class to instantiate)."""
    found = import_object(path, where)
    if not callable(found):
        raise ValueError(f"{where}={path!r}: {type(found).__name__} {found!r} is not callable; name a function")
    return found


def _module(module_name: str, path: str, where: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{where}={path!r}: cannot import module {module_name!r} ({error}); make sure it is on "
                         "PYTHONPATH") from error


def _file_module(file_name: str, path: str, where: str) -> Any:
    """A Python file imported by path, under a name derived from its location (one module per file)."""
    file = Path(file_name).expanduser()
    if not file.is_file():
        raise ValueError(f"{where}={path!r}: the file {file_name!r} does not exist; give the path of a .py file")
    spec = importlib.util.spec_from_file_location(f"megatron_cpo_file_{abs(hash(str(file.resolve())))}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise ValueError(f"{where}={path!r}: cannot import the file {file_name!r} ({type(error).__name__}: "
                         f"{error}); fix the file") from error
    return module
