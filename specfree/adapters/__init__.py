"""Model adapters: run a step's rows through a transformers model and keep the accepted KV."""

import contextlib

from specfree.adapters.attention import stock_attention
from specfree.adapters.hf import HFAdapter
from specfree.adapters.norms import stock_norms
from specfree.adapters.pinned import stock_math
from specfree.kernels import stock_linears


@contextlib.contextmanager
def as_shipped(model):
    """transformers' own attention, linear, norm, rotary and activation layers inside the block (for
    baselines that must be stock), though an adapter switched the model to specfree's CPU kernels;
    theirs after."""
    with stock_attention(model), stock_linears(model), stock_norms(model), stock_math(model):
        yield model


__all__ = ["HFAdapter", "as_shipped"]
