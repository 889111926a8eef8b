"""Package façades that import on first use: ``import nowdl`` stays light, and no façade makes a circle.

A package ``__init__`` names its public names in ``__all__``, imports them for type checkers
under ``TYPE_CHECKING``, and sets ``__getattr__ = lazy_exports(__name__, {...})``: the module
holding a name is imported the first time the name is read.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``where[name]`` is the submodule (relative to
    ``package``) that defines ``name``; the value is cached in the package after the first read."""

    def __getattr__(name: str) -> object:
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
