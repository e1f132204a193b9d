"""16-bit checkpoints stay 16 bits (kernels/panels.py ``WidePanelLinear``, loading.py): a bfloat16 or
float16 model asked for in float32 holds its linear weights at 2 bytes and computes in float32, so
its logits are the float32 model's of the same values, bit for bit, and the op matches float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.adapters.hf import HFAdapter
from specfree.kernels import load_kernels
from specfree.kernels.panels import LANES, WidePanelLinear, pack
from specfree.loading import load_model
from tests.tiny_models import reference_greedy, tiny_model, tiny_tokenizer

ISA = load_kernels(progress=False)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")
ISAS = ["avx2", "avx512"] if ISA == "avx512" else ["avx2"]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(1, 90), dtype=st.sampled_from(["bf16", "fp16"]),
       with_bias=st.booleans(), isa=st.sampled_from(ISAS), seed=st.integers(0, 999))
def test_16bit_panels_compute_the_float32_product_of_their_values(rows, n, k, dtype, with_bias, isa, seed):
    generator = torch.Generator().manual_seed(seed)
    narrow = torch.randn(n, k, generator=generator).to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    x = torch.randn(rows, k, generator=generator)
    bias = torch.randn(n, generator=generator) if with_bias else None  # float32: the model's own
    out = torch.ops.specfree.panel_linear(x, pack(narrow, LANES[isa]), bias, n, isa)
    wide = torch.ops.specfree.panel_linear(x, pack(narrow.float(), LANES[isa]), bias, n, isa)
    assert torch.equal(out, wide)  # widening is exact: the same float32 sums
    expected = x.double() @ narrow.double().T + (0 if bias is None else bias.double())
    assert (out.double() - expected).abs().max().item() <= 1e-5 * (k ** 0.5) * (x.abs().max().item() * 4 + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_16bit_checkpoint_keeps_16_bits_and_the_float32_models_outputs(dtype, tmp_path):
    model = tiny_model.__wrapped__("llama", seed=7).to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    held, _ = load_model(str(tmp_path / "model"), cache_dir=tmp_path / "cache")
    layers = [m for m in held.modules() if isinstance(m, WidePanelLinear)]
    assert layers and all(m.panels.dtype == dtype for m in layers)
    assert all(p.dtype == torch.float32 for name, p in held.named_parameters() if not name.endswith("panels"))
    wide = tiny_model.__wrapped__("llama", seed=7).eval()  # the same values in float32 (buffers stay exact)
    with torch.no_grad():
        for param in wide.parameters():
            param.copy_(param.to(dtype).float())
    prompt = [5, 6, 7, 8, 9] * 3
    HFAdapter(wide, check_tree_mask=False, linear_kernel="few_row_fp32")
    HFAdapter(held, check_tree_mask=False)  # the same attention and norms on both
    with torch.no_grad():
        assert torch.equal(held(torch.tensor([prompt])).logits, wide(torch.tensor([prompt])).logits)
    engine = Engine.from_model(held, None, "hybrid")
    assert engine.generate(prompt, 16, ignore_eos=True).tokens == reference_greedy(wide, prompt, 16, ignore_eos=True)
    assert all(p.dtype == torch.float32 for p in held.state_dict().values())
