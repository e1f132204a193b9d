"""Weights held as codes (specfree/kernels/codes.py, panel_linear.cpp): the op against float64 and
bit for bit against the float32 panel kernel on the decoded weights, every code path this CPU
has; codes found only where they give the weight back exactly; a model whose weights came from a
quantized file computes what its float32 panels compute, bit for bit, keeps the stock state dict,
and says which weights it cannot load."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.adapters.hf import HFAdapter
from specfree.kernels import library_linears, linear_path, load_kernels
from specfree.kernels.codes import CodedEmbedding, CodedLinear, Codes, find_codes
from specfree.kernels.panels import LANES, PanelLinear, pack, pack_linears, unpack
from specfree.kernels.saved_codes import SavedCodes
from tests.tiny_models import gguf_rounded, round_like_gguf, tiny_model

fresh_model = tiny_model.__wrapped__

ISA = load_kernels(progress=False)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")
ISAS = ["avx2", "avx512"] if ISA == "avx512" else ["avx2"]
KINDS = {"q4_1": "affine4", "q8_0": "scaled8"}


def coded_linear(x, coded, bias, n, isa):
    return torch.ops.specfree.coded_linear(x, coded.codes, coded.scales, coded.offsets, bias, n, isa)


@settings(max_examples=60, deadline=None)
# n up to 300: panels of 8 and 16, blocks of each width and a short last panel
@given(rows=st.integers(1, 40), blocks=st.integers(1, 10), n=st.integers(1, 300), kind=st.sampled_from(list(KINDS)),
       with_bias=st.booleans(), isa=st.sampled_from(ISAS), seed=st.integers(0, 99))
def test_the_op_equals_the_float32_panels_bit_for_bit_and_matmul_in_float64(rows, blocks, n, kind, with_bias, isa,
                                                                             seed):
    generator = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    weight = gguf_rounded(torch.randn(n, k, generator=generator), kind)
    x = torch.randn(rows, k, generator=generator)
    bias = torch.randn(n, generator=generator) if with_bias else None
    coded = find_codes(weight, LANES[isa])
    assert coded is not None and coded.kind == KINDS[kind]
    assert torch.equal(unpack(coded.decode(), n), weight)
    out = coded_linear(x, coded, bias, n, isa)
    assert torch.equal(out, torch.ops.specfree.panel_linear(x, pack(weight, LANES[isa]), bias, n, isa))
    assert coded.scales.dtype == torch.float16  # a GGUF file's scales: float16 values, held as such
    wide = Codes(coded.codes, coded.scales.float(), None if coded.offsets is None else coded.offsets.float())
    assert torch.equal(coded_linear(x, wide, bias, n, isa), out)  # float32 scales: the same values, bits
    for row in (0, rows - 1):  # each row's bits its own
        assert torch.equal(coded_linear(x[row:row + 1], coded, bias, n, isa)[0], out[row])
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    tolerance = 1e-5 * (k ** 0.5) * (x.abs().max().item() * weight.abs().max().item() + 1)
    assert (out.double() - expected).abs().max().item() <= tolerance


def test_codes_are_found_only_where_they_give_the_weight_back_exactly():
    generator = torch.Generator().manual_seed(3)
    weight = gguf_rounded(torch.randn(40, 64, generator=generator), "q4_1")
    assert find_codes(weight, 16) is not None
    assert find_codes(torch.randn(40, 64, generator=generator), 16) is None  # plain float32 weights
    assert find_codes(weight[:, :48], 16) is None  # K not a whole number of blocks
    assert find_codes(weight.bfloat16(), 16) is None
    nudged = weight.clone()
    nudged[31, 40] = torch.nextafter(nudged[31, 40], torch.tensor(1e9))  # one value off by one ulp
    assert find_codes(nudged, 16) is None


@pytest.mark.parametrize("isa", ISAS)
def test_the_op_refuses_codes_it_cannot_run(isa):
    """Each refusal asked of a path this CPU runs, with codes made for that path (an AVX2-only CPU
    refuses 16-column codes before it looks at the shapes)."""
    coded = find_codes(gguf_rounded(torch.randn(20, 64), "q4_1"), LANES[isa])
    with pytest.raises(RuntimeError, match="do not multiply"):
        coded_linear(torch.randn(2, 63), coded, None, 20, isa)
    with pytest.raises(RuntimeError, match=r"affine codes are int32 \(affine4, eight a word\) or uint8"):
        torch.ops.specfree.coded_linear(torch.randn(2, 64), coded.codes.view(torch.int8), coded.scales,
                                        coded.offsets, None, 20, isa)


def test_codes_for_16_columns_cannot_run_the_avx2_path():
    coded = find_codes(gguf_rounded(torch.randn(20, 64), "q4_1"), LANES["avx512"])
    with pytest.raises(RuntimeError, match="panels of 16 columns cannot run the avx2 path"):
        coded_linear(torch.randn(2, 64), coded, None, 20, "avx2")


@pytest.mark.skipif(ISA == "avx512", reason="needs a CPU without AVX-512 (AVX2 only: e.g. AMD Zen 3, Intel before "
                                            "Skylake-SP or a client core)")
def test_a_cpu_without_avx512_refuses_its_path():
    coded = find_codes(gguf_rounded(torch.randn(20, 64), "q4_1"), LANES["avx512"])
    with pytest.raises(RuntimeError, match="this CPU cannot run the avx512 code path"):
        coded_linear(torch.randn(2, 64), coded, None, 20, "avx512")


def test_a_model_from_a_quantized_file_holds_codes_and_computes_its_float32_panels_bits():
    coded, panels = fresh_model("llama_gguf", seed=4), fresh_model("llama_gguf", seed=4)
    state = {name: tensor.clone() for name, tensor in coded.state_dict().items()}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    HFAdapter(coded, check_tree_mask=False)
    HFAdapter(panels, check_tree_mask=False, linear_kernel="few_row_fp32")
    assert linear_path(coded) == f"few_row-coded-{ISA}" and linear_path(panels) == f"few_row-panels-{ISA}"
    assert all(isinstance(m, CodedLinear) for m in coded.modules() if isinstance(m, PanelLinear))
    with torch.no_grad():
        assert torch.equal(coded(ids).logits, panels(ids).logits)
    saved = coded.state_dict()
    assert set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in state)
    coded.load_state_dict(state)  # codes found again
    bad = dict(state, **{"model.layers.0.mlp.up_proj.weight": torch.randn(64, 32)})
    with pytest.raises(RuntimeError, match="not exactly the values of a 4- or 8-bit code.*few_row_fp32"):
        coded.load_state_dict(bad)
    library_linears(coded)
    assert linear_path(coded) == "library" and all(torch.equal(coded.state_dict()[k], state[k]) for k in state)


def test_a_tied_embedding_decodes_its_rows_from_the_heads_codes():
    model = fresh_model("llama", seed=6)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    round_like_gguf(model)  # the head (and so the embedding) as Q8_0
    ids = torch.tensor([[7, 0, 2, 95, 4, 127]])
    with torch.no_grad():
        stock_rows = model.get_input_embeddings()(ids)
    HFAdapter(model, check_tree_mask=False)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, CodedEmbedding) and embedding.storage is model.lm_head.codes
    assert not any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= 128 * 32
                   for t in model.buffers() if t is not model.lm_head.scales)  # no float32 copy of the table
    assert torch.equal(embedding(ids), stock_rows)


def test_codes_found_once_are_loaded_after_and_only_where_they_decode_exactly(tmp_path):
    lanes, linear = LANES[ISA], (lambda m: type(m) is torch.nn.Linear)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])

    def packed(seed=4):  # a fresh GGUF-rounded model, packed through the saved codes
        model = fresh_model("llama_gguf", seed=seed)
        coder = SavedCodes.for_model(model, linear, lanes, tmp_path)
        pack_linears(model, linear, lanes, coder)
        coder.save()
        with torch.no_grad():
            return coder, model(ids).logits

    reference = fresh_model("llama_gguf", seed=4)
    pack_linears(reference, linear, lanes)  # float32 panels
    with torch.no_grad():
        expected = reference(ids).logits
    first, logits = packed()
    layers = first.searched
    assert layers == 15 and first.loaded == 0 and first.path.is_file() and torch.equal(logits, expected)
    second, logits = packed()
    assert (second.loaded, second.searched) == (layers, 0) and torch.equal(logits, expected)

    entries = torch.load(first.path, weights_only=True)  # one code changed: that layer searched again
    damaged = next(key for key, parts in entries.items() if parts[0].dtype == torch.int32)  # not the head,
    entries[damaged][0].view(-1)[0] ^= 1  # whose padding token's row is zeros, any code decoding to 0
    torch.save(entries, first.path)
    third, logits = packed()
    assert (third.loaded, third.searched) == (layers - 1, 1) and torch.equal(logits, expected)
    assert (packed()[0].loaded, packed()[0].searched) == (layers, 0)  # the file was repaired

    first.path.write_bytes(first.path.read_bytes()[:100])  # truncated: every layer searched
    truncated, logits = packed()
    assert truncated.searched == layers and torch.equal(logits, expected)
    assert packed(seed=5)[0].path != first.path  # other weights, another file

    def mixed():  # GGUF-rounded but for one layer without codes, which every load searches again
        model = fresh_model("llama_gguf", seed=6)
        plain_weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.copy_(plain_weight)
        coder = SavedCodes.for_model(model, linear, lanes, tmp_path)
        pack_linears(model, linear, lanes, coder)
        coder.save()
        return coder

    written = mixed().path.stat().st_mtime_ns
    again = mixed()  # the coded layers loaded, the other searched again: nothing new to write
    assert (again.loaded, again.searched) == (layers - 1, 1) and again.path.stat().st_mtime_ns == written

    plain = fresh_model("llama", seed=4)  # no codes: nothing written
    coder = SavedCodes.for_model(plain, linear, lanes, tmp_path / "plain")
    pack_linears(plain, linear, lanes, coder)
    coder.save()
    assert coder.searched and not coder.codes and not (tmp_path / "plain").exists()


def test_the_linear_curves_of_a_model_too_large_to_copy_measure_its_codes_alone():
    """bench's cost curves where the dense variants' weight copies would not fit: the coded
    variants only, on the codes the layers hold, and one line saying why."""
    from specfree.bench.linear_curves import DENSE_COPIES, dense_bytes, linear_curves, linear_modules, no_room_for_copies

    model = fresh_model("llama_gguf", seed=4)
    HFAdapter(model, check_tree_mask=False)
    need = DENSE_COPIES * dense_bytes(linear_modules(model))
    assert no_room_for_copies(model, memory=need) is None
    why = no_room_for_copies(model, memory=need - 1)
    assert why is not None and why.startswith(f"{DENSE_COPIES} unpacked copies of the weights need ")
    assert no_room_for_copies(model, copies=1, memory=need // DENSE_COPIES) is None
    curves = linear_curves(model, rows=(1, 3), rounds=1, dense=False)
    assert set(curves) == {f"few_row-coded-{ISA}", f"few_row-coded-int8-{ISA}"}
    assert all(ms > 0 for per_rows in curves.values() for ms in per_rows.values())
