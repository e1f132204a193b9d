"""The in-place KV layer holds exactly what transformers' DynamicLayer holds, step after step."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from specfree.adapters.kv_buffers import GrowingLayer

OPS = st.lists(st.one_of(st.tuples(st.just("append"), st.integers(1, 300)),
                         st.tuples(st.just("crop"), st.integers(1, 40)),
                         st.tuples(st.just("keep"), st.integers(1, 8)),  # an adapter commit: rows moved down
                         st.tuples(st.just("replace"), st.just(0)),  # a method assigning new tensors
                         st.tuples(st.just("reset"), st.just(0))), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, seed=st.integers(0, 1000))
def test_growing_layer_matches_dynamic_layer(ops, seed):
    generator = torch.Generator().manual_seed(seed)
    layers = [DynamicLayer(), GrowingLayer()]
    longest = 0
    for op, n in ops:
        length = layers[0].get_seq_length()
        if op == "append":
            keys, values = torch.randn(2, 1, 3, n, 4, generator=generator)
            outs = [layer.update(keys, values) for layer in layers]
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        elif op == "crop" and length:
            for layer in layers:
                layer.crop(-min(n, length))
        elif op == "keep" and length > n:
            rows = torch.arange(length - n, length, 2)
            kept = length - n + len(rows)
            for layer in layers:  # as HFAdapter.commit does: write the kept rows down, cut the tail
                layer.keys[:, :, length - n : kept] = layer.keys.index_select(2, rows)
                layer.values[:, :, length - n : kept] = layer.values.index_select(2, rows)
                layer.keys, layer.values = layer.keys[:, :, :kept], layer.values[:, :, :kept]
        elif op == "replace" and length:
            for layer in layers:
                layer.keys, layer.values = layer.keys.clone() * 2, layer.values.clone() * 2
        elif op == "reset":
            for layer in layers:
                layer.reset()
        assert layers[0].get_seq_length() == layers[1].get_seq_length()
        longest = max(longest, layers[0].get_seq_length())
        buffer = getattr(layers[1], "_key_buffer", None)
        assert buffer is None or buffer.shape[-2] <= max(256, 2 * longest)  # crops and resets do not inflate it
        if layers[0].get_seq_length():
            assert torch.equal(layers[0].keys, layers[1].keys) and torch.equal(layers[0].values, layers[1].values)
