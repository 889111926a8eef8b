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
    ``package``) that defines ``name``, ``"module:attr"`` when it is defined there under another
    name, or ``name`` itself for the submodule of that name. The value is cached in the package
    after the first read."""

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        mod, _, attr = where[name].partition(":")
        module = importlib.import_module(f"{package}.{mod}")
        value = module if mod == name and not attr else getattr(module, attr or name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
