"""specfree: training-free, lossless speculative decoding for transformers causal LMs.

The names below load on first use (PEP 562), so ``import specfree`` and a command that needs
none of them (``specfree compare``, ``specfree plugins``) do not pay for torch and transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specfree.lazy_names import lazy_names

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
__getattr__, __dir__ = lazy_names(globals(), _HOMES)
