"""Weights packed in place into panels (specfree/kernels/panels.py, panel_linear.cpp): the op against
float64 over odd shapes, every code path this CPU has, fp32 and bf16 weights; each row's bits
independent of the other rows; the code paths agree bit for bit; the read-pass floor reads what it
is given; a packed model computes what the stock one does, keeps one copy of each weight (a tied
embedding reads the head's panels), and gives the stock state dict back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.pytorch_utils import Conv1D

from specfree.adapters import as_shipped
from specfree.adapters.hf import HFAdapter
from specfree.kernels import library_linears, linear_path, load_kernels
from specfree.kernels.panels import LANES, FilePages, PanelEmbedding, PanelLinear, pack, unpack
from tests.tiny_models import tiny_model

fresh_model = tiny_model.__wrapped__  # a model of its own: these tests repack, tie and restore it

ISA = load_kernels(progress=False)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")
ISAS = ["avx2", "avx512"] if ISA == "avx512" else ["avx2"]


def panel_linear(x, weight, bias, isa):
    return torch.ops.specfree.panel_linear(x, pack(weight, LANES[isa]), bias, weight.shape[0], isa)


@settings(max_examples=60, deadline=None)
# n up to 300: 19 panels of 16, so each of two threads runs a block of 8 and narrower ones after it
@given(rows=st.integers(1, 64), k=st.integers(1, 300), n=st.integers(1, 300), with_bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), isa=st.sampled_from(ISAS), seed=st.integers(0, 99))
def test_the_op_equals_matmul_in_float64(rows, k, n, with_bias, dtype, isa, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    out = panel_linear(x, weight, bias, isa)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    # one fp32 accumulator per output, summed over k in order: error ~ sqrt(k) * eps * scale
    tolerance = 1e-5 * (k ** 0.5) * (x.abs().max().item() * weight.float().abs().max().item() + 1)
    assert (out.double() - expected).abs().max().item() <= tolerance


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 40), k=st.integers(1, 200), n=st.integers(1, 300), isa=st.sampled_from(ISAS),
       seed=st.integers(0, 99))
def test_each_row_has_the_same_bits_alone_and_the_code_paths_agree(rows, k, n, isa, seed):
    generator = torch.Generator().manual_seed(seed)
    x, weight, bias = torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator), \
        torch.randn(n, generator=generator)
    together = panel_linear(x, weight, bias, isa)
    for row in range(rows):
        assert torch.equal(panel_linear(x[row:row + 1], weight, bias, isa)[0], together[row])
    for other in ISAS:  # lane for lane the same fma sequence
        assert torch.equal(panel_linear(x, weight, bias, other), together)


def test_pack_and_unpack_round_trip_and_the_op_refuses_what_it_cannot_run():
    weight = torch.randn(13, 7)
    panels = pack(weight, 8)
    assert panels.shape == (2, 7, 8) and torch.equal(unpack(panels, 13), weight)
    assert torch.equal(panels[1, :, 5:], torch.zeros(7, 3))  # zero columns past N
    with pytest.raises(RuntimeError, match="do not multiply"):
        torch.ops.specfree.panel_linear(torch.randn(2, 6), panels, None, 13, "avx2")
    with pytest.raises(RuntimeError, match="panels of 16 columns cannot run the avx2 path"):
        torch.ops.specfree.panel_linear(torch.randn(2, 7), pack(weight, 16), None, 13, "avx2")


@pytest.mark.parametrize("isa", ISAS)
def test_the_linear_pass_calls_the_op_for_each_product(isa):
    weights = [torch.randn(40, 33), torch.randn(7, 40)]
    panels = [pack(w, LANES[isa]) for w in weights]
    xs = [torch.randn(3, 33), torch.randn(3, 40)]
    assert torch.ops.specfree.linear_pass(xs, panels, [None, torch.randn(7)], [40, 7], isa) is None
    with pytest.raises(RuntimeError, match="one activation, bias and output count per panels tensor"):
        torch.ops.specfree.linear_pass(xs[:1], panels, [None, None], [40, 7], isa)
    with pytest.raises(RuntimeError, match="do not multiply"):  # the op's own checks, so the op ran
        torch.ops.specfree.linear_pass(xs[::-1], panels, [None, None], [40, 7], isa)


@pytest.mark.parametrize("streams", [1, 2, 3, 4, 8])
def test_the_read_pass_reads_every_value_as_any_number_of_streams(streams):
    tensors = [torch.randn(1000), torch.randn(37, 5), torch.randn(64, 64), torch.randn(3, 4096 + 13)]
    total = torch.ops.specfree.read_pass(tensors, streams).item()
    assert total == pytest.approx(sum(t.double().sum().item() for t in tensors), abs=1e-2)
    with pytest.raises(RuntimeError, match="streams must be 1 to 8"):
        torch.ops.specfree.read_pass(tensors, 9)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])  # gpt2: Conv1D layers, weights stored [K, N]
def test_a_packed_model_computes_what_the_stock_one_does_and_saves_the_stock_state(family):
    model = fresh_model(family, seed=5)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        stock = model(ids).logits
    HFAdapter(model, check_tree_mask=False)
    assert linear_path(model) == f"few_row-panels-{ISA}"
    assert not any(type(m) in (nn.Linear, Conv1D) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock, rtol=1e-4, atol=1e-4)
    packed_state = model.state_dict()
    assert set(packed_state) == set(state) and all(torch.equal(packed_state[k], state[k]) for k in state)
    model.load_state_dict(state)  # loads into the panels
    with as_shipped(model):
        assert linear_path(model) == "library"
        with torch.no_grad():
            # the same weights (the state dict above); the attention call may differ in its mask argument
            torch.testing.assert_close(model(ids).logits, stock, rtol=1e-5, atol=1e-5)
    library_linears(model)
    assert linear_path(model) == "library" and all(torch.equal(model.state_dict()[k], state[k]) for k in state)
    assert {type(m) for m in model.modules()} >= ({Conv1D} if family == "gpt2" else {nn.Linear})
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock, rtol=1e-5, atol=1e-5)


TIED_IDS = torch.tensor([[7, 0, 2, 95, 4]])


def tied_model():
    """A tiny Llama whose head shares the embedding's weight (as SmolLM2's does), some ids, and its
    stock logits for them."""
    model = fresh_model("llama", seed=6)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    with torch.no_grad():
        return model, TIED_IDS, model(TIED_IDS).logits


def test_a_tied_embedding_reads_the_heads_panels_one_copy_of_each_weight():
    model, ids, stock = tied_model()
    stock_bytes = sum(p.numel() for p in model.parameters())
    HFAdapter(model, check_tree_mask=False)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, PanelEmbedding) and isinstance(model.lm_head, PanelLinear)
    assert embedding.panels is model.lm_head.panels
    assert sum(p.numel() for p in model.parameters()) <= stock_bytes * 1.02  # padding only, no second copy
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock, rtol=1e-4, atol=1e-4)
    with as_shipped(model):
        assert model.get_input_embeddings().weight is model.lm_head.weight  # the tie kept in the stock copy
        with torch.no_grad():
            # the same weights (the state dict above); the attention call may differ in its mask argument
            torch.testing.assert_close(model(ids).logits, stock, rtol=1e-5, atol=1e-5)
    assert isinstance(model.get_input_embeddings(), PanelEmbedding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_a_long_prefill_is_right_and_keeps_the_one_row_bits(dtype, isa):
    """Both paths take every row count themselves (AVX2 in groups of 6, AVX-512 in groups of 8)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 100, 40, generator=generator)  # 200 rows, batched
    weight = torch.randn(1100, 40, generator=generator).to(dtype)  # a last panel short of columns
    bias = torch.randn(1100, generator=generator).to(dtype)
    out = panel_linear(x, weight, bias, isa)
    expected = x.double() @ weight.double().T + bias.double()
    assert out.shape == (2, 100, 1100) and (out.double() - expected).abs().max().item() < 1e-3
    for b, row in ((0, 0), (0, 99), (1, 37), (1, 98)):
        assert torch.equal(panel_linear(x[b, row:row + 1], weight, bias, isa)[0], out[b, row])


def test_save_pretrained_of_a_packed_tied_model_loads_into_the_stock_class(tmp_path):
    import transformers

    model, ids, stock = tied_model()
    HFAdapter(model, check_tree_mask=False)
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.lm_head.weight is back.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, stock, rtol=1e-5, atol=1e-5)


def test_packing_hands_back_clean_checkpoint_pages_and_nothing_else(tmp_path):
    """A weight read from a mapped file gives its pages back once packed (the peak stays one copy
    of the model), reads back the same afterwards; a page written since mapping is kept."""
    data = torch.arange(1 << 20, dtype=torch.float32)  # 4 MB: whole pages inside it
    path = tmp_path / "weights.bin"
    data.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=data.numel())  # a private mapping
    assert torch.equal(mapped, data)  # every page read, so resident
    pages = FilePages.of_this_process()
    if not pages.ranges:
        pytest.skip("no /proc/self/maps on this system: dropping is a no-op")
    assert pages.drop(mapped)
    assert torch.equal(mapped, data)  # faulted in again from the file
    mapped[5] = -1.0  # now a private copy of that page
    assert not pages.drop(mapped)
    assert mapped[5] == -1.0 and torch.equal(mapped[6:], data[6:])
    assert not pages.drop(data.clone())  # ordinary memory is freed with its tensor, not here


def test_the_linear_curves_of_a_bf16_model_measure_every_variant_in_its_dtype():
    """bench's cost curves on a bf16 model: every variant multiplies bf16 activations (the library's
    refused float32 ones against bf16 weights), and AMX tiles where the CPU has them."""
    from specfree.kernels import has_amx, prepare_linears
    from specfree.bench.linear_curves import linear_curves

    model = fresh_model("llama").to(torch.bfloat16)
    prepare_linears(model)
    curves = linear_curves(model, rows=(1, 3), rounds=1)
    assert {"blas", "read_pass", f"few_row-panels-{ISAS[-1]}"} <= curves.keys()
    assert ("few_row-tiles-amx" in curves) == has_amx()
    assert all(ms > 0 for per_rows in curves.values() for ms in per_rows.values())
