"""Model adapters: run a step's rows through a transformers model and keep the accepted KV."""

from specfree.adapters.hf import HFAdapter
from specfree.adapters.loading import load_model

__all__ = ["HFAdapter", "load_model"]
