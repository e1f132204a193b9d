"""specfree: training-free, lossless speculative decoding for transformers causal LMs.

The names below load on first use (PEP 562), so ``import specfree`` and a command that needs
none of them (``specfree compare``, ``specfree plugins``) do not pay for torch and transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specfree.engine import Chunk, Engine
    from specfree.errors import ConfigError, ModelLoadError, SpecfreeError, UnsupportedModelError
    from specfree.integrations.transformers import speculative_generate
    from specfree.types import Generation, StepRecord

_HOMES = {"Chunk": "specfree.engine", "Engine": "specfree.engine", "ConfigError": "specfree.errors",
          "ModelLoadError": "specfree.errors", "SpecfreeError": "specfree.errors",
          "UnsupportedModelError": "specfree.errors", "speculative_generate": "specfree.integrations.transformers",
          "Generation": "specfree.types", "StepRecord": "specfree.types"}
__all__ = sorted(_HOMES)
__version__ = "0.1.0"


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'specfree' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
