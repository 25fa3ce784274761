"""Public names imported on first use (PEP 562), for the package roots.

A package root lists where each public name lives; importing the package then
loads nothing until a name is used, so ``import celery_fair`` stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ("lazy_exports",)


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` and caches the value."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this function
        return value

    return __getattr__
