"""specfree: training-free, lossless speculative decoding for transformers causal LMs."""

from specfree.engine import Chunk, Engine
from specfree.errors import ConfigError, ModelLoadError, SpecfreeError, UnsupportedModelError
from specfree.types import Generation, StepRecord

__all__ = ["Chunk", "ConfigError", "Engine", "Generation", "ModelLoadError", "SpecfreeError", "StepRecord",
           "UnsupportedModelError"]
__version__ = "0.1.0"
