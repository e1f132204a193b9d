"""Models whose layers keep a recurrent state: Mamba/SSM mixers, linear attention, gated delta nets.

A draft tree cannot branch such a state by masking (every row folds into the one state), so these
models verify a single chain per step: the best path of the merged tree. After the verdict a
rejected tail is rolled back: the recurrent and conv states go back to the copy taken before the
step, the attention layers' KV is cut to where the step began, and the accepted tokens are run
again as one forward, which leaves every layer exactly as a forward over only the accepted tokens
would have. A step whose whole chain is accepted needs no rollback.

The cache is the one transformers' ``generate`` builds for the model (``DynamicCache(config=...)``,
whose linear-attention layers hold the conv and recurrent states); only its plain attention
layers are swapped for ``kv.GrowingLayer``s, which grow in place.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.cache_utils import LinearAttentionCacheLayerMixin as StateLayer

from specfree.adapters.kv import GrowingLayer


def recurrent_cache(config) -> Cache | None:
    """The cache ``generate`` would build for a model of ``config``, with growing attention layers;
    None when no layer keeps a recurrent state (or the config names layer kinds this cache lacks)."""
    try:
        cache = DynamicCache(config=config.get_text_config(decoder=True))
    except (KeyError, AttributeError, TypeError, ValueError):  # a layer kind DynamicCache does not know
        return None
    if not any(isinstance(layer, StateLayer) for layer in cache.layers):
        return None
    # Whole-window KV is kept for sliding layers too (the adapter caps the context at the window
    # for such hybrids), so a rollback is a plain cut.
    cache.layers = [GrowingLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


class StateSnapshot:
    """Copies of every conv and recurrent state of a cache, taken before a step, to put back."""

    FLAGS = ("has_previous_state", "is_conv_states_initialized", "is_recurrent_states_initialized")

    def __init__(self, cache: Cache, past: int):
        self.past = past  # tokens in the cache before the step
        self.states = [(layer, _copies(layer.conv_states), _copies(layer.recurrent_states),
                        {flag: dict(getattr(layer, flag)) for flag in self.FLAGS})
                       for layer in cache.layers if isinstance(layer, StateLayer)]

    def restore(self, cache: Cache) -> None:
        for layer, conv, recurrent, flags in self.states:
            _put_back(layer.conv_states, conv)
            _put_back(layer.recurrent_states, recurrent)
            for flag, values in flags.items():
                getattr(layer, flag).update(values)
        for layer in cache.layers:
            if isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None:
                # keys/values [B, H, T, D]: cut back to the step's start
                layer.keys = layer.keys[:, :, : self.past]
                layer.values = layer.values[:, :, : self.past]


def _copies(states: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
    return {i: None if s is None else s.clone() for i, s in states.items()}


def _put_back(states: dict[int, torch.Tensor | None], saved: dict[int, torch.Tensor | None]) -> None:
    for i, tensor in saved.items():
        current = states.get(i)
        if tensor is not None and current is not None and current.shape == tensor.shape:
            current.copy_(tensor)  # the layer keeps its tensor (static address), only the values go back
        else:
            states[i] = tensor
