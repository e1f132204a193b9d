"""KV buffers under the KV manager (``kv_manager``): a cache whose layers grow in place (eager
steps, ``GrowingBuffers``), static slots (compiled steps, ``StaticSlots``), keeping a step's accepted
rows in them, and the name a forward gives its cache.

Both kinds offer one interface, the manager's only view of them: ``cache`` (what a forward writes),
``room(entries)`` (make room; the mask's width), ``forward(runner, ids, positions, mask, prompt)``
(run ``runner`` over them: the runner is given the buffers with the call and keeps none),
``keep(keep, start)`` (move kept rows down), ``set_length(length)`` and ``reset()``.

transformers' ``DynamicLayer`` appends a step's keys and values with ``torch.cat``, which copies
the whole cache of every layer on every step. ``GrowingLayer`` keeps them in buffers with room
to spare (doubling when full) and exposes views of the filled part, so a step writes only its
own rows. The tensors attention sees hold the same values, so logits are bit-identical. On
SmolLM2-135M at 1024 tokens of context, a step took 5–10 ms less.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

MIN_CAPACITY = 256  # tokens a buffer holds at first
# What a forward calls its cache: transformers 5.24 renamed `past_key_values` (and the SSMs'
# `cache_params`) to `cache`, keeping the old names as deprecated aliases until 5.40.
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def cache_argument(model) -> str | None:
    """The name of the argument through which ``model.forward`` takes its cache; None where it takes
    none (GPT-1 reruns the whole sequence)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), None)


def cache_in(mapping) -> Cache | None:
    """The cache in a forward's output (or in its inputs), under whichever name this transformers uses."""
    return next((mapping[name] for name in CACHE_ARGUMENTS if mapping.get(name) is not None), None)


class GrowingLayer(DynamicLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # keys/values [B, H, T, D]; new states [B, H, Q, D]
        old = self.keys.shape[-2] if self.keys.numel() else 0
        new = old + key_states.shape[-2]
        if self._key_buffer is None or not self._holds_cache() or new > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, old, new)
        self._key_buffer[..., old:new, :] = key_states
        self._value_buffer[..., old:new, :] = value_states
        self.keys, self.values = self._key_buffer[..., :new, :], self._value_buffer[..., :new, :]
        return self.keys, self.values

    def _holds_cache(self) -> bool:
        """Whether the buffers still hold what keys/values show: they are views of them (cropping
        and in-place edits keep them so; a method that assigns new tensors does not), or empty."""
        if self.keys.numel() == 0:
            return True
        return (self.keys.data_ptr() == self._key_buffer.data_ptr() and self.keys.stride() == self._key_buffer.stride()
                and self.values.data_ptr() == self._value_buffer.data_ptr())

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, old: int, new: int) -> None:
        """New buffers holding the ``old`` rows: twice as large when ``new`` rows do not fit, the
        same size when the old buffers were only abandoned."""
        held = self._key_buffer.shape[-2] if self._key_buffer is not None else 0
        capacity = held if new <= held else max(new, 2 * held, MIN_CAPACITY)
        batch, heads, _, dim = key_states.shape
        key_buffer = key_states.new_empty(batch, heads, capacity, dim)
        value_buffer = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if old:
            key_buffer[..., :old, :] = self.keys
            value_buffer[..., :old, :] = self.values
        self._key_buffer, self._value_buffer = key_buffer, value_buffer


def growing_cache() -> Cache:
    """A cache of ``GrowingLayer``s, one per model layer (made as the model first writes)."""
    return Cache(layer_class_to_replicate=GrowingLayer)


class GrowingBuffers:
    """The KV of eager forwards: a cache of ``GrowingLayer``s (cache index == entry), as wide as its
    entries; prompts keep only their last row's logits."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.reset()

    def room(self, entries: int) -> int:
        return entries  # the layers grow as the forward writes

    def forward(self, runner, ids: torch.Tensor, positions: torch.Tensor, mask, prompt: bool) -> torch.Tensor:
        # ids, positions [1, B] -> logits [1, B, V] ([1, 1, V] for a prompt)
        logits, self.cache = runner(ids, positions, mask, self.cache, 1 if prompt else 0)
        return logits

    def keep(self, keep: list[int], start: int) -> None:
        keep_rows(self.cache.layers, keep, start, self.device)

    def set_length(self, length: int) -> None:
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]

    def reset(self) -> None:
        self.cache = growing_cache()


class PackageLayer(StaticLayer):
    """transformers' static layer, its buffers left unmarked as dynamo's static addresses: a package
    takes them as plain inputs, and marking them imports dynamo, most of a second, in a process that
    never compiles (a warm start)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys = key_states.new_zeros(self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim)
        self.values = value_states.new_zeros(self.batch_size, self.num_heads, self.max_cache_len, self.v_head_dim)
        with torch.inference_mode(False):  # a plain tensor: the length is set inside inference mode and out
            self.cumulative_length = self.cumulative_length.clone().to(self.device)
        self.is_initialized = True


class StaticSlots:
    """The KV store of compiled steps: preallocated slots (transformers' ``StaticLayer``) that never
    move, so a graph or a package compiled against them stays valid.

    Slots come in tiers: ``min_slots`` doubled as often as needed (``tier_step=None``: a
    torch.compile graph per tier), or the next multiple of ``tier_step`` (packages take any slot
    count; every step attends over all slots, so fewer is faster: on SmolLM2 at 256 tokens of
    context, 8 rows cost 35.8 ms over 512 slots and 49.2 ms over 2048). Keeping a step's accepted
    rows moves their KV down inside the buffers and sets the fill length.
    """

    def __init__(self, layer_shapes: list[tuple[torch.Size, torch.Size]], dtype: torch.dtype, device: torch.device,
                 min_slots: int, tier_step: int | None = None):
        self.layer_shapes, self.dtype, self.device = layer_shapes, dtype, device
        self.min_slots, self.tier_step = min_slots, tier_step
        self.cache: Cache | None = None  # made on first use (``room``)
        self.buffers: list[torch.Tensor] = []  # every layer's keys and values, in order
        self.past = 0

    @property
    def capacity(self) -> int:
        """The slots allocated now (0 before the first step)."""
        return self.cache.layers[0].max_cache_len if self.cache is not None else 0

    def tier(self, needed: int) -> int:
        """The slots of the smallest tier that holds ``needed``."""
        if self.tier_step is not None:
            return max(self.min_slots, -(-needed // self.tier_step) * self.tier_step)
        slots = self.min_slots
        while slots < needed:
            slots *= 2
        return slots

    def room(self, needed: int) -> int:
        """Room for ``needed`` slots: a larger tier when they do not fit (new graphs follow); returns
        the slots a mask spans (every step attends over all of them)."""
        if needed <= self.capacity:
            return self.capacity
        slots, layers = self.tier(needed), []
        # torch.compile's graphs (tier_step None) need the static addresses; a package does not
        layer_class = StaticLayer if self.tier_step is None else PackageLayer
        for index, (key_shape, value_shape) in enumerate(self.layer_shapes):
            layer = layer_class(max_cache_len=slots)
            # lazy_initialization allocates [B, H, slots, D] buffers from the shapes of one token's states
            layer.lazy_initialization(torch.empty(key_shape, dtype=self.dtype, device=self.device),
                                      torch.empty(value_shape, dtype=self.dtype, device=self.device))
            if self.cache is not None and self.past:
                old = self.cache.layers[index]
                layer.keys[:, :, : self.past] = old.keys[:, :, : self.past]
                layer.values[:, :, : self.past] = old.values[:, :, : self.past]
            layers.append(layer)
        self.cache = Cache(layers=layers)
        self.buffers = [t for layer in layers for t in (layer.keys, layer.values)]
        self.set_length(self.past)
        return self.capacity

    def set_length(self, length: int) -> None:
        self.past = length
        if self.cache is not None:
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(length)

    def reset(self) -> None:
        """Empty; packages (any tier) start small again, while torch.compile's graphs hold on to
        the buffers they were traced with."""
        if self.tier_step is not None and self.capacity > self.min_slots:
            self.cache, self.buffers = None, []
        self.set_length(0)

    def forward(self, runner, ids: torch.Tensor, positions: torch.Tensor, mask, prompt: bool) -> torch.Tensor | None:
        """A step through the compiled ``runner`` (logits [1, B, V]); a prompt eagerly (a graph per
        prompt length would never be reused; logits [1, 1, V]); ``mask=None``: a first prompt, plainly
        causal from slot 0 (``_first_prompt``; no logits)."""
        past, rows = self.past, ids.shape[1]
        self.room(past + rows)
        if mask is None:
            self._first_prompt(runner, ids, positions)
            self.set_length(rows)
            return None
        if prompt:
            logits = runner.eager(ids, positions, mask, self, logits_to_keep=1)
            self.set_length(past + rows)
            return logits
        # Fresh inference tensors: a graph's guards tell them from tensors made outside inference mode.
        logits, _ = runner(ids.clone(), positions.clone(), mask, self)
        self.past = past + rows
        return logits

    def _first_prompt(self, runner, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Run over a cache exactly the prompt's length, where attention is plainly causal (no mask
        over the empty slots after it; a long prompt takes SDPA's causal path, which skips the
        hidden half), then copy its keys and values into the slots."""
        cache = growing_cache()
        runner.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                     **{runner.cache_name: cache})
        q = ids.shape[1]
        for grown, slot in zip(cache.layers, self.cache.layers, strict=True):
            slot.keys[:, :, :q] = grown.keys
            slot.values[:, :, :q] = grown.values

    def keep(self, keep: list[int], start: int) -> None:
        keep_rows(self.cache.layers, keep, start, self.device)


def keep_rows(layers, keep: list[int], start: int, device: torch.device) -> None:
    """Move the KV of the rows ``keep`` (ascending, keep[0] == 0) of a step that began at ``start``
    down to start..start+len(keep), in place (a kept prefix stays where it is)."""
    n = len(keep)
    if keep[-1] == n - 1:
        return
    index = torch.tensor(keep, device=device) + start
    for layer in layers:
        # index_select copies first, so the in-place write cannot read moved rows.
        layer.keys[:, :, start : start + n] = layer.keys.index_select(2, index)
        layer.values[:, :, start : start + n] = layer.values.index_select(2, index)
