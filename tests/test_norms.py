"""Fused RMSNorm layers: swapped only where bit-identical, undone on request, state dict unchanged."""

from __future__ import annotations

import pytest
import torch

from specfree.adapters import as_shipped
from specfree.adapters.hf import HFAdapter
from specfree.adapters.norms import FusedRMSNorm, fuse_norms, fused_norms, stock_norms
from tests.tiny_models import FAMILIES, VOCAB, tiny_model

LLAMA_STYLE = {"llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "olmo2", "mixtral"}


def _norm_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_norms_give_the_same_logits_bit_for_bit(family):
    model = tiny_model.__wrapped__(family)  # a model of its own: swaps stay in this test
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
    norms = _norm_layers(model)
    with torch.no_grad():
        before = model(ids).logits
        fused = fuse_norms(model)
        after = model(ids).logits
    assert torch.equal(before, after)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys  # shared, not copied
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
