"""MKL-packed linear layers: same parameters and state dict, the same products to rounding,
never stale, and undone for baselines that must run transformers as shipped."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.adapters import as_shipped
from specfree.adapters.hf import HFAdapter
from specfree.adapters.packed import PackedLinear, mkl_packing_available, pack_linears, unpack_linears
from tests.tiny_models import FAMILIES, tiny_model

pytestmark = pytest.mark.skipif(not mkl_packing_available(), reason="this torch build has no MKL")


def linear(bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(48, 80, bias=bias)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), bias=st.booleans(), seed=st.integers(0, 1000))
def test_packed_products_match_the_stock_layer(rows, bias, seed):
    stock = linear(bias, seed)
    packed = PackedLinear(stock)
    x = torch.randn(1, rows, 48, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        out, ref = packed(x), stock(x)
    assert out.shape == ref.shape == (1, rows, 80)
    if rows == 1 or rows >= 16:
        assert torch.equal(out, ref)  # one-row steps (plain decoding) and wide ones keep the stock kernel
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_packed_layer_shares_the_original_parameters_and_state_dict():
    stock = linear()
    packed = PackedLinear(stock)
    assert packed.weight is stock.weight and packed.bias is stock.bias
    assert packed.state_dict().keys() == stock.state_dict().keys()
    back = packed.to_linear()
    assert type(back) is torch.nn.Linear and back.weight is stock.weight


def test_a_weight_changed_in_place_is_repacked():
    packed = PackedLinear(linear())
    x = torch.randn(4, 48)
    with torch.inference_mode():
        before = packed(x)
    with torch.no_grad():
        packed.weight.mul_(2)
    with torch.inference_mode():
        after = packed(x)
    torch.testing.assert_close(after - packed.bias, 2 * (before - packed.bias), rtol=1e-5, atol=1e-5)


def test_a_packed_layer_deep_copies_and_pickles():
    packed = PackedLinear(linear())
    x = torch.randn(4, 48)
    for copy_ in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        with torch.inference_mode():
            assert torch.equal(copy_(x), packed(x))
        assert copy_.weight is not packed.weight


def test_a_layer_made_under_inference_mode_packs():
    with torch.inference_mode():  # its parameters are inference tensors: no version counter
        stock = linear()
        packed = PackedLinear(stock)
        inside = packed(torch.ones(4, 48))
    torch.testing.assert_close(inside, stock(torch.ones(4, 48)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(torch.ones(4, 48)), inside, rtol=0, atol=0)


def test_gradients_still_flow_through_a_packed_layer():
    packed = PackedLinear(linear())
    packed(torch.randn(4, 48)).sum().backward()
    assert packed.weight.grad is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_packs_every_plain_linear_and_keeps_tied_weights(family):
    model = tiny_model(family)
    unpack_linears(model)  # other tests' adapters may have packed the shared model already
    plain = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    keys = set(model.state_dict())
    HFAdapter(model, check_tree_mask=False)
    packed = {name for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert packed == set(plain)
    assert set(model.state_dict()) == keys
    head = model.get_output_embeddings()
    if model.config.tie_word_embeddings and isinstance(head, PackedLinear):
        assert head.weight is model.get_input_embeddings().weight
    with as_shipped(model):
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert {name for name, m in model.named_modules() if isinstance(m, PackedLinear)} == packed


def test_packing_can_be_declined_and_skips_other_dtypes():
    model = tiny_model("llama")
    HFAdapter(model, check_tree_mask=False, packed_linears=False)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    half = tiny_model.__wrapped__("llama").to(torch.bfloat16)  # a fresh copy: the cached one stays fp32
    assert pack_linears(half) == 0
    assert pack_linears(model) > 0
    assert unpack_linears(model) > 0
