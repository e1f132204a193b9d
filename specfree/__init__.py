"""specfree: training-free, lossless speculative decoding for transformers causal LMs."""

from specfree.engine import Chunk, Engine
from specfree.errors import ConfigError, ModelLoadError, SpecfreeError, UnsupportedModelError
from specfree.integrations.transformers import speculative_generate
from specfree.types import Generation, StepRecord

__all__ = ["Chunk", "ConfigError", "Engine", "Generation", "ModelLoadError", "SpecfreeError", "StepRecord",
           "UnsupportedModelError", "speculative_generate"]
__version__ = "0.1.0"
