"""Models whose layers keep a recurrent state: Mamba/SSM mixers, linear attention, gated delta nets.

A draft tree cannot branch such a state by masking (every row folds into the one state), so these
models verify a single chain per step: the best path of the merged tree. After the verdict a
rejected tail is rolled back: the recurrent and conv states go back to the copy taken before the
step, the attention layers' KV is cut to where the step began, and the accepted tokens are run
again as one forward, which leaves every layer exactly as a forward over only the accepted tokens
would have. A step whose whole chain is accepted needs no rollback.

The cache is the one transformers' ``generate`` builds for the model (``DynamicCache(config=...)``,
whose linear-attention layers hold the conv and recurrent states); only its plain attention
layers are swapped for ``kv.GrowingLayer``s, which grow in place. A family that ships cache layers
of its own (DeepSeek-V4's compressed attention) or a cache class of its own (MiniMax, which
builds it inside its forward) keeps them; a step's snapshot is then a deep copy of the whole
cache, which costs a copy of the KV too.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache, DummyLayer, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.cache_utils import LinearAttentionCacheLayerMixin as StateLayer

from specfree.adapters.kv import GrowingLayer, growing_cache

PLAIN_ATTENTION = (DynamicLayer, DynamicSlidingWindowLayer)


def cache_kind(model) -> str:
    """How a model's cache is kept: "growing" (attention only: ``kv.GrowingLayer`` everywhere, draft
    trees), "states" (transformers' linear-attention layers beside attention layers: chains, states
    copied), "own" (cache layers or a cache class of the family's own: chains, the cache copied)."""
    if not _default_cache_works(model):  # the family builds its own cache in its forward
        return "own"
    try:
        layers = DynamicCache(config=model.config.get_text_config(decoder=True)).layers
    except (KeyError, AttributeError, TypeError, ValueError):  # layer kinds DynamicCache does not know
        return "growing"
    kinds = {type(layer) for layer in layers}
    if kinds <= {*PLAIN_ATTENTION, DummyLayer}:
        return "growing"
    if all(k in (*PLAIN_ATTENTION, DummyLayer) or (issubclass(k, StateLayer) and k.__module__ == StateLayer.__module__)
           for k in kinds):
        return "states"
    return "own"


def new_cache(model, kind: str) -> Cache | None:
    """An empty cache of ``kind`` (None: the model makes its own on the first forward)."""
    if kind == "growing":
        return growing_cache()
    if kind == "own" and not _default_cache_works(model):
        return None
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    if kind == "states":
        cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _default_cache_works(model) -> bool:
    """generate's own test: False for families that build a cache class of their own (MiniMax)."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    return supports() if supports is not None else True


def snapshot(cache: Cache | None, kind: str, past: int):
    return StateSnapshot(cache, past) if kind == "states" else CacheCopy(cache, past)


class CacheCopy:
    """A deep copy of a whole cache of a family's own kind, to put back in its place."""

    def __init__(self, cache: Cache | None, past: int):
        self.past = past
        self.copy = copy.deepcopy(cache)

    def restore(self, cache: Cache | None) -> Cache | None:
        return self.copy


class StateSnapshot:
    """Copies of every conv and recurrent state of a cache, taken before a step, to put back."""

    FLAGS = ("has_previous_state", "is_conv_states_initialized", "is_recurrent_states_initialized")

    def __init__(self, cache: Cache, past: int):
        self.past = past  # tokens in the cache before the step
        self.states = [(layer, _copies(layer.conv_states), _copies(layer.recurrent_states),
                        {flag: dict(getattr(layer, flag)) for flag in self.FLAGS})
                       for layer in cache.layers if isinstance(layer, StateLayer)]
        # A sliding layer drops its oldest entries as it appends, assigning new tensors: keep the old ones.
        self.windows = [(layer, layer.keys, layer.values, layer.cumulative_length)
                        for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]

    def restore(self, cache: Cache) -> Cache:
        """Put the states back into ``cache`` and return it."""
        for layer, conv, recurrent, flags in self.states:
            _put_back(layer.conv_states, conv)
            _put_back(layer.recurrent_states, recurrent)
            for flag, values in flags.items():
                getattr(layer, flag).update(values)
        for layer, keys, values, length in self.windows:
            layer.keys, layer.values, layer.cumulative_length = keys, values, length
        for layer in cache.layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                continue
            if isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None:
                # keys/values [B, H, T, D]: cut back to the step's start
                layer.keys = layer.keys[:, :, : self.past]
                layer.values = layer.values[:, :, : self.past]
        return cache


def _copies(states: dict[int, torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
    return {i: None if s is None else s.clone() for i, s in states.items()}


def _put_back(states: dict[int, torch.Tensor | None], saved: dict[int, torch.Tensor | None]) -> None:
    for i, tensor in saved.items():
        current = states.get(i)
        if tensor is not None and current is not None and current.shape == tensor.shape:
            current.copy_(tensor)  # the layer keeps its tensor (static address), only the values go back
        else:
            states[i] = tensor
