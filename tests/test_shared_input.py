"""One coded call for q, k, v and for gate, up (``kernels.shared_input``): each sibling's columns of the
shared call are the bits of its own call, on every GGUF type, ISA path and precision; a model's
logits are the same shared or not; a sibling asked with another input, twice, or first, still gets
its own product; a state dict loads into the shared tensors; the model's state dict is the stock one."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.adapters.hf import HFAdapter
from specfree.kernels import load_kernels
from specfree.kernels.codes import CodedLinear, from_blocks
from specfree.kernels.gguf_blocks import GGUF_TYPES, block_codes
from specfree.kernels.panels import LANES
from specfree.kernels.shared_input import SharingLinear, concatenated, separate_calls, share
from specfree.loading import load_model
from tests.test_gguf import random_blocks, tiny_file
from tests.test_tree_attention import CONTEXT, CONTINUATION, chain_and_tree_against_one_row

ISA = load_kernels(progress=False)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")
PATHS = ["avx2", "avx512", "avx512_novnni"] if ISA == "avx512" else ["avx2"]  # every path this CPU runs


def coded_layer(qtype: T, n: int, k: int, seed: int, lanes: int, bias: bool) -> CodedLinear:
    codes = block_codes(random_blocks(qtype, n, k // GGML_QUANT_SIZES[qtype][0], seed), qtype, n, k)
    linear = torch.nn.Linear(k, n, bias=bias)
    return CodedLinear(linear, from_blocks(codes, lanes))


def siblings(qtype: T, sizes: list[int], k: int, seed: int, lanes: int, bias: bool) -> list[CodedLinear]:
    return [coded_layer(qtype, n, k, seed + i, lanes, bias) for i, n in enumerate(sizes)]


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(sorted(GGUF_TYPES)), panels=st.lists(st.integers(1, 3), min_size=2, max_size=3),
       last=st.integers(1, 40), rows=st.integers(1, 20), blocks=st.integers(1, 2), bias=st.booleans(),
       seed=st.integers(0, 10**6))
def test_each_siblings_columns_of_the_shared_call_are_its_own_calls_bits(qtype, panels, last, rows, blocks, bias,
                                                                         seed):
    """Every type, both precisions, every ISA path; full panels then a short last layer (padded columns)."""
    k = GGML_QUANT_SIZES[qtype][0] * blocks
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    for path in PATHS:
        lanes = LANES["avx2" if path == "avx2" else "avx512"]
        sizes = [p * lanes for p in panels[:-1]] + [last]
        layers = siblings(qtype, sizes, k, seed, lanes, bias)
        codes, shared_bias = concatenated(layers)
        for precision in ("exact", "int8"):
            parts = codes.linear(x, shared_bias, sum(sizes), path, precision).split(sizes, dim=-1)
            for layer, part in zip(layers, parts):
                assert torch.equal(part, layer.coded.linear(x, layer.bias, layer.out_features, path, precision)), \
                    (path, precision)


def quantized_layer(n: int, k: int, seed: int, lanes: int) -> CodedLinear:
    """A Q4_1 layer of random weights as the gguf package quantizes them (codes a state dict can load)."""
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(weights, T.Q4_1).reshape(n * k // 32, -1)
    linear = torch.nn.Linear(k, n)
    return CodedLinear(linear, from_blocks(block_codes(raw, T.Q4_1, n, k), lanes))


def shared_group(bias: bool = True, precision: str = "int8", seed: int = 3) -> tuple[list[CodedLinear],
                                                                                  list[SharingLinear]]:
    lanes = LANES[ISA]
    layers = [quantized_layer(n, 64, seed + i, lanes) for i, n in enumerate([2 * lanes, lanes, lanes])]
    for layer in layers:
        layer.precision = precision
        if not bias:
            layer.bias = None
    originals = [copy.deepcopy(layer) for layer in layers]
    return originals, share(layers)


@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_siblings_asked_in_any_order_with_any_input_get_their_own_products(precision):
    originals, members = shared_group(precision=precision)
    x, other = torch.randn(3, 64), torch.randn(3, 64)
    own = lambda i, t: originals[i](t)  # noqa: E731
    with torch.no_grad():
        assert torch.equal(members[1](x), own(1, x))  # the middle one first
        assert torch.equal(members[0](x), own(0, x))
        assert torch.equal(members[0](x), own(0, x))  # twice: computed again
        assert torch.equal(members[2](other), own(2, other))  # another input: not the cached one
        assert torch.equal(members[2](x), own(2, x))
        x.mul_(2)  # changed in place (version counted): another input
        assert torch.equal(members[0](x), own(0, x)) and torch.equal(members[1](x), own(1, x))
    with torch.inference_mode():
        y = torch.randn(2, 64)
        assert all(torch.equal(m(y), o(y)) for m, o in zip(members, originals))
    call = members[0].call
    assert call._input is None and not call._outputs  # every sibling took its columns: nothing held


def test_a_state_dict_loads_into_the_shared_tensors_and_the_keys_are_the_stock_ones():
    originals, members = shared_group()
    donors = shared_group(seed=11)[0]  # other codes, other biases
    x = torch.randn(4, 64)
    for member, donor, original in zip(members, donors, originals):
        assert set(member.state_dict()) == set(original.state_dict()) == {"weight", "bias"}
        assert not member.load_state_dict(donor.state_dict()).missing_keys
    with torch.no_grad():
        assert all(torch.equal(m(x), d(x)) for m, d in zip(members, donors))
        twin = copy.deepcopy(members)  # a copy shares nothing it could hold between calls
        assert twin[0].call is not members[0].call and twin[1].call is twin[0].call
        assert all(torch.equal(t(x), d(x)) for t, d in zip(twin, donors))


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-shared")


@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_a_models_verify_rows_are_the_same_bits_shared_or_separate(precision, gguf_dir, tmp_path):
    model, _ = load_model(str(tiny_file(gguf_dir, T.Q4_K)), cache_dir=tmp_path)
    adapter = HFAdapter(model, check_tree_mask=False, precision=precision)
    groups = {id(m.call) for m in model.modules() if isinstance(m, SharingLinear)}
    assert len(groups) == 2 * 2  # two layers: q, k, v and gate, up
    shared = chain_and_tree_against_one_row(adapter, CONTEXT, CONTINUATION)
    with separate_calls(model):
        assert not any(isinstance(m, SharingLinear) for m in model.modules())
        separate = chain_and_tree_against_one_row(adapter, CONTEXT, CONTINUATION)
    assert all(torch.equal(a, b) for a, b in zip(shared, separate))
    assert torch.equal(shared[0], shared[2]) and torch.equal(shared[1], shared[2])
