"""Public names of a package that load on first use (PEP 562): the package's ``import`` then costs
nothing for the modules behind them (torch, transformers, numba)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_names(namespace: dict, homes: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose globals are ``namespace``: each name of
    ``homes`` (name -> its module) imported from its home on first use and kept, listed before that."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value  # looked up once
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *homes])

    return __getattr__, __dir__
