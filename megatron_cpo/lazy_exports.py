"""Lazy package exports (PEP 562): a package's public names load their module on first use, so that loading a
config (which reads only the torch-free `config.py` of each package) imports no torch (tests/trainer/test_config.py).

    __all__, __getattr__, __dir__ = lazy_exports(__name__, {"manager": ("RolloutManager",), ...})
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable


def lazy_exports(package: str, modules: dict[str, Iterable[str]]
                 ) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """`__all__`, `__getattr__` and `__dir__` for `package`, whose public names are those of `modules` (a submodule
    of the package -> the names it exports): each name is imported from its submodule when first read."""
    owner = {name: f"{package}.{module}" for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> object:
        if name in owner:
            return getattr(importlib.import_module(owner[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(owner))

    return sorted(owner), __getattr__, __dir__
