"""Rotary embeddings and activations through specfree's ops (adapters/pinned.py): swapped only where
bit-identical, every family's logits unchanged, undone on request. That a compiled step then
computes the eager step's bits is tested in tests/test_compiled.py and tests/test_int8.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specfree.adapters import as_shipped
from specfree.adapters.pinned import PinnedActivation, PinnedRotary, pin_math, stock_math
from specfree.kernels import load_kernels
from tests.test_norms import swapped_bit_for_bit
from tests.tiny_models import FAMILIES, tiny_model

pytestmark = pytest.mark.skipif(load_kernels(progress=False) is None, reason="specfree's library cannot be built here")


def _pinned(model) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (PinnedRotary, PinnedActivation))}


@pytest.mark.parametrize("family", FAMILIES)
def test_pinned_layers_give_the_same_logits_bit_for_bit(family):
    model, pinned = swapped_bit_for_bit(family, pin_math)
    assert pinned == len(_pinned(model))
    if family in ("llama", "qwen2", "mistral"):  # default rotary, SiLU: one rotary and one activation a layer
        kinds = [type(m) for m in _pinned(model).values()]
        assert kinds.count(PinnedRotary) == 1 and kinds.count(PinnedActivation) == model.config.num_hidden_layers


def test_stock_math_restores_the_very_same_layers():
    model = tiny_model.__wrapped__("llama")
    own = {name: m for name, m in model.named_modules() if name.endswith(("rotary_emb", "act_fn"))}
    assert pin_math(model) == len(own) and pin_math(model) == 0  # twice changes nothing
    assert all(isinstance(model.get_submodule(name), (PinnedRotary, PinnedActivation)) for name in own)
    with stock_math(model):
        assert all(model.get_submodule(name) is layer for name, layer in own.items())
    with as_shipped(model):
        assert all(model.get_submodule(name) is layer for name, layer in own.items())
    assert isinstance(model.model.rotary_emb, PinnedRotary)


def test_layers_of_another_formula_keep_their_own():
    class HalfSiLU(nn.Module):  # an activation of transformers' kind, computing something else
        def forward(self, x):
            return torch.nn.functional.silu(x) / 2

    HalfSiLU.__module__ = "transformers.activations"
    gelu_formula = nn.Module()
    gelu_formula.act = nn.GELU(approximate="tanh")
    gelu_formula.other = HalfSiLU()
    assert pin_math(gelu_formula) == 1 and isinstance(gelu_formula.act, PinnedActivation)
    assert gelu_formula.act.name == "gelu_tanh" and isinstance(gelu_formula.other, HalfSiLU)

    model = tiny_model.__wrapped__("llama")
    model.model.rotary_emb.rope_type = "dynamic"  # inv_freq follows the sequence length: not a fixed formula
    pin_math(model)
    assert not isinstance(model.model.rotary_emb, PinnedRotary)


def test_an_unknown_activation_name_is_one_clear_error():
    with pytest.raises(RuntimeError, match="no activation named 'swish'"):
        torch.ops.specfree.activation(torch.ones(3), "swish")
