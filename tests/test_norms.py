"""Fused RMSNorm layers: swapped only where bit-identical, undone on request, state dict unchanged."""

from __future__ import annotations

import pytest
import torch

from specfree.adapters import as_shipped
from specfree.adapters.hf import HFAdapter
from specfree.adapters.norms import FusedRMSNorm, fuse_norms, fused_norms, own_norms, stock_norms
from specfree.kernels import load_kernels
from tests.tiny_models import FAMILIES, VOCAB, tiny_model

LLAMA_STYLE = {"llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "olmo2", "mixtral"}


def _norm_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}


def swapped_bit_for_bit(family: str, swap) -> tuple[torch.nn.Module, int]:
    """A fresh tiny ``family`` model after ``swap(model)`` (which returns how many layers it swapped),
    checked to give the same logits bit for bit and to share its state dict's tensors."""
    model = tiny_model.__wrapped__(family)  # a model of its own: swaps stay in the test
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(ids).logits
        swapped = swap(model)
        after = model(ids).logits
    assert torch.equal(before, after)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys  # shared, not copied
    return model, swapped


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_norms_give_the_same_logits_bit_for_bit(family):
    model, fused = swapped_bit_for_bit(family, fuse_norms)
    norms = _norm_layers(model)  # fused ones too: their class name ends in RMSNorm as well
    if family in LLAMA_STYLE:
        assert fused == len(norms) > 0
    if family in ("gemma", "gemma2", "gemma3_text"):  # (1 + weight): another formula, so it keeps its own
        assert fused == 0


def test_stock_norms_restore_the_very_same_layers_and_the_adapter_fuses_again():
    model = tiny_model.__wrapped__("llama")
    own = _norm_layers(model)
    HFAdapter(model, check_tree_mask=False)
    assert own and {n for n, m in model.named_modules() if isinstance(m, FusedRMSNorm)} == set(own)
    with stock_norms(model):
        assert _norm_layers(model) == own
    with as_shipped(model):
        assert _norm_layers(model) == own
    assert fuse_norms(model) == 0  # already fused: nothing to do


def test_a_borrowed_model_gets_its_own_norms_back_after_the_block():
    model = tiny_model.__wrapped__("qwen2")
    own = _norm_layers(model)
    with fused_norms(model):
        assert all(isinstance(m, FusedRMSNorm) for n, m in model.named_modules() if n in own)
    assert _norm_layers(model) == own


def test_a_replaced_weight_goes_back_with_the_original_layer():
    model = tiny_model.__wrapped__("llama")
    fuse_norms(model)
    new = torch.nn.Parameter(torch.full_like(model.model.norm.weight, 2.0))
    model.model.norm.weight = new
    with stock_norms(model):
        assert model.model.norm.weight is new


def test_norms_that_are_not_fp32_on_the_cpu_or_that_differ_are_left_alone():
    model = tiny_model.__wrapped__("llama").to(torch.bfloat16)
    assert fuse_norms(model) == 0

    class OffByOneRMSNorm(torch.nn.Module):  # the right name, another formula
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.eps = 1e-6

        def forward(self, x):
            return torch.rms_norm(x, (8,), self.weight, self.eps) + 1

    holder = torch.nn.Sequential(OffByOneRMSNorm())
    assert fuse_norms(holder) == 0


@pytest.mark.skipif(load_kernels(progress=False) is None, reason="specfree's library cannot be built here")
@pytest.mark.parametrize("n", [576, 64, 37, 2048, 1])
def test_the_row_kernel_is_rms_norm_to_float32_rounding_and_each_rows_own(n):
    """``specfree::rms_norm_rows`` (int8 models' norms): RMSNorm in float64 to a few float32
    roundings, and a row's bits are the same whatever other rows the call holds."""
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=generator) * 3
    weight = torch.randn(n, generator=generator)
    y = torch.ops.specfree.rms_norm_rows(x, weight, 1e-5)
    expected = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert (y.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
    assert torch.equal(torch.cat([torch.ops.specfree.rms_norm_rows(x[i:i + 1], weight, 1e-5) for i in range(9)]), y)
    assert torch.equal(torch.ops.specfree.rms_norm_rows(x.view(3, 3, n), weight, 1e-5).view(9, n), y)


@pytest.mark.skipif(load_kernels(progress=False) is None, reason="specfree's library cannot be built here")
def test_an_int8_model_runs_its_norms_on_the_row_kernel_and_exact_on_atens():
    model = tiny_model.__wrapped__("llama_gguf")  # float weights held as codes
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    norms = lambda: {m.own for m in model.modules() if isinstance(m, FusedRMSNorm)}  # noqa: E731
    HFAdapter(model, check_tree_mask=False, precision="int8")
    assert norms() == {True}
    with torch.no_grad():
        int8 = model(ids).logits
    HFAdapter(model, check_tree_mask=False, precision="exact")
    assert norms() == {False}
    assert own_norms(model, True) == len(_norm_layers(model)) and norms() == {True}
    with torch.no_grad():
        own_exact = model(ids).logits
    own_norms(model, False)
    with torch.no_grad():
        exact = model(ids).logits
    assert not torch.equal(own_exact, exact) and torch.allclose(own_exact, exact, atol=1e-4)
    assert not torch.equal(int8, exact)
