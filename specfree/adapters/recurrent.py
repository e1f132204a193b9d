"""Models whose layers keep a recurrent state: Mamba/SSM mixers, linear attention, gated delta nets.

A draft tree cannot branch such a state by masking (every row folds into the one state), so these
models verify a single chain per step: the best path of the merged tree. After the verdict a
rejected tail is rolled back: the recurrent and conv states go back to the copy taken before the
step, the attention layers' KV is cut to where the step began, and the accepted tokens are run
again as one forward, which leaves every layer exactly as a forward over only the accepted tokens
would have. A step whose whole chain is accepted needs no rollback.

The cache is the one transformers' ``generate`` builds for the model (``DynamicCache(config=...)``,
whose linear-attention layers hold the conv and recurrent states); only its plain attention
layers are swapped for ``kv_buffers.GrowingLayer``s, which grow in place. A family that ships cache layers
of its own (DeepSeek-V4's compressed attention) or a cache class of its own (MiniMax, which
builds it inside its forward) keeps them; a step's snapshot is then a deep copy of the whole
cache, which costs a copy of the KV too.
"""

from __future__ import annotations

import copy

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.cache_utils import LinearAttentionCacheLayerMixin as StateLayer

from specfree.adapters.kv_buffers import GrowingLayer, growing_cache

PLAIN_ATTENTION = (DynamicLayer, DynamicSlidingWindowLayer)
# A layer that keeps nothing, new in transformers 5.20; vLLM's environment has 5.19 (docs/vllm.md).
DummyLayer = getattr(cache_utils, "DummyLayer", DynamicLayer)


def cache_kind(model) -> str:
    """How a model's cache is kept: "growing" (attention only: ``kv_buffers.GrowingLayer`` everywhere, draft
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


def generate_cache(model) -> Cache | None:
    """An empty cache of the kind ``generate`` builds for ``model`` (None: the model makes its own in its
    forward), for probes that check what transformers itself computes."""
    if not _default_cache_works(model):
        return None
    try:
        return DynamicCache(config=model.config.get_text_config(decoder=True))
    except (KeyError, AttributeError, TypeError, ValueError):  # layer kinds DynamicCache does not know
        return DynamicCache()


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

    def keeps_rows(self, rows: int) -> bool:
        """Whether every sliding layer still holds all of a step's ``rows`` rows."""
        return all(layer.sliding_window - 1 >= rows for layer, *_ in self.windows)

    def restore(self, cache: Cache, kept: int = 0, rows: int = 0) -> Cache:
        """Put the states back into ``cache`` and return it; attention layers keep the KV of the
        step's first ``kept`` of ``rows`` rows (0: none, for a re-run of the kept rows)."""
        for layer, conv, recurrent, flags in self.states:
            _put_back(layer.conv_states, conv)
            _put_back(layer.recurrent_states, recurrent)
            for flag, values in flags.items():
                getattr(layer, flag).update(values)
        for layer, keys, values, length in self.windows:
            # keys/values [B, H, T, D]; the step's rows are the newest `rows` entries
            if kept:
                window = layer.sliding_window - 1
                new_keys, new_values = layer.keys[:, :, -rows:][:, :, :kept], layer.values[:, :, -rows:][:, :, :kept]
                keys = new_keys if keys is None else torch.cat([keys, new_keys], dim=2)[:, :, -window:]
                values = new_values if values is None else torch.cat([values, new_values], dim=2)[:, :, -window:]
            layer.keys, layer.values, layer.cumulative_length = keys, values, length + kept
        for layer in cache.layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                continue
            if isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None:
                layer.keys = layer.keys[:, :, : self.past + kept]
                layer.values = layer.values[:, :, : self.past + kept]
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


class MixerReplay:
    """Rolls the states forward over the kept rows by re-running only the modules that write them.

    After ``StateSnapshot.restore`` the attention layers are already right (their KV is cut to
    the kept rows); only the recurrent and conv states need the kept rows again. The modules that
    write them (the Mamba or delta-net mixers) are found once, by watching which innermost module's
    forward changes a state; during a chain's forward their inputs are recorded, and a rollback
    calls them again on the first ``kept`` rows of those inputs, skipping the rest of the model
    (attention, MLPs, the LM head). A row's input to a mixer depends only on the rows before it, so
    the states come out as a forward over the kept rows would leave them.
    """

    def __init__(self, mixers: list[torch.nn.Module]):
        self.mixers = mixers
        self.calls: list[tuple[torch.nn.Module, tuple, dict]] = []

    @classmethod
    def find(cls, model, cache: Cache, run) -> "MixerReplay | None":
        """Watch ``run()`` (a forward on ``cache``) for the modules that write its states."""
        # A negative index marks a block shared by several layers (Zamba2's attention), not a layer of its own.
        modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and m.layer_idx >= 0]
        before: dict[torch.nn.Module, tuple] = {}
        writers: list[torch.nn.Module] = []

        def state_of(module) -> tuple | None:
            layer = cache.layers[module.layer_idx] if module.layer_idx < len(cache.layers) else None
            if not isinstance(layer, StateLayer):
                return None
            tensors = [t for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
            flags = tuple(tuple(getattr(layer, flag).values()) for flag in StateSnapshot.FLAGS)
            return flags, [t.clone() for t in tensors]  # inference tensors keep no version counter

        def changed(old, new) -> bool:
            return old[0] != new[0] or len(old[1]) != len(new[1]) or not all(
                a.shape == b.shape and torch.equal(a, b) for a, b in zip(old[1], new[1]))

        def pre(module, args):
            before[module] = state_of(module)

        def post(module, args, output):
            old, new = before.pop(module, None), state_of(module)
            if new is not None and (old is None or changed(old, new)):
                writers.append(module)

        handles = [m.register_forward_pre_hook(pre) for m in modules] + [m.register_forward_hook(post) for m in modules]
        try:
            run()
        finally:
            for handle in handles:
                handle.remove()
        inner = [m for m in writers if not any(other is not m and _contains(m, other) for other in writers)]
        state_layers = {i for i, layer in enumerate(cache.layers) if isinstance(layer, StateLayer)}
        if sorted(m.layer_idx for m in inner) != sorted(state_layers):  # one writer per state layer, or none
            return None
        return cls(inner)

    def record(self):
        """Hooks that keep each mixer's inputs during one forward (remove them after it)."""
        self.calls = []

        def keep(module, args, kwargs):
            self.calls.append((module, args, kwargs))

        return [m.register_forward_pre_hook(keep, with_kwargs=True) for m in self.mixers]

    def replay(self, kept: int, rows: int) -> bool:
        """Run the recorded calls on their first ``kept`` rows; False if an input cannot be cut so."""
        calls = []
        for module, args, kwargs in self.calls:
            cut_args = [_cut(a, kept, rows) for a in args]
            cut_kwargs = {k: _cut(v, kept, rows) for k, v in kwargs.items()}
            if any(x is _UNCUT for x in (*cut_args, *cut_kwargs.values())):
                return False
            calls.append((module, cut_args, cut_kwargs))
        for module, args, kwargs in calls:
            module(*args, **kwargs)
        self.calls = []
        return True


_UNCUT = object()


def _cut(value, kept: int, rows: int):
    """A mixer input cut to its first ``kept`` rows: hidden states [B, Q, H] and 2D padding masks
    [B, Q] along dim 1; anything else that has a dimension of ``rows`` cannot be cut safely."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() in (2, 3) and value.shape[1] == rows:
        return value[:, :kept]
    return _UNCUT if rows in value.shape else value


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())
