"""GGUF files read as codes (specfree/gguf_model.py, kernels/gguf_blocks.py): per type, the codes
decode to ``gguf.quants.dequantize``'s values bit for bit and the op matches float64; tiny random
Llamas written in every type load with every linear layer held as codes, decode greedily as
transformers' own model of the file does, speculate losslessly with their verify rows bit-equal to
the one-row forward; broken files are one line and leave nothing in the cache."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.adapters.hf import HFAdapter
from specfree.errors import ModelLoadError
from specfree.kernels import gguf_blocks, load_kernels
from specfree.kernels.codes import CodedEmbedding, CodedLinear, from_blocks
from specfree.kernels.gguf_blocks import GGUF_TYPES, block_codes, type_table
from specfree.kernels.panels import LANES, WidePanelLinear, pack, unpack
from specfree.loading import load_model
from tests.gguf_files import CODED, HALF_FIELDS, write_tiny_llama
from tests.test_tree_attention import CONTEXT, CONTINUATION, chain_and_tree_against_one_row

ISA = load_kernels(progress=False)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")
ISAS = ["avx2", "avx512"] if ISA == "avx512" else ["avx2"]
# the float16 fields of the types not written as random blocks by tests.gguf_files
HALVES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), **HALF_FIELDS}


def random_blocks(qtype: T, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes as ``qtype`` blocks, every float16 scale finite (any other bits as they fall)."""
    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, size), dtype=np.uint8)
    for offset in HALVES[qtype]:
        raw[:, offset + 1] &= 0xBB  # exponent below 31 (finite), magnitudes from subnormal to ~1000
    return raw.reshape(rows, -1)


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(sorted(GGUF_TYPES)), rows=st.integers(1, 40), blocks=st.integers(1, 3),
       isa=st.sampled_from(ISAS), seed=st.integers(0, 10**6))
def test_every_type_decodes_to_gguf_dequantize_bit_for_bit(qtype, rows, blocks, isa, seed):
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows, blocks, seed)
    expected = quants.dequantize(raw, qtype).reshape(rows, block * blocks)
    codes = block_codes(raw, qtype, rows, block * blocks)
    assert codes is not None
    coded = from_blocks(codes, LANES[isa])
    decoded = unpack(coded.decode(), rows).numpy()
    # equal as floats (a zero scale may give -0.0 where gguf gives 0.0: the same in every sum), and
    # bit for bit wherever the value is not zero
    assert np.array_equal(decoded, expected) and np.array_equal(codes.values(), expected)
    nonzero = expected != 0
    assert np.array_equal(decoded[nonzero].view(np.uint32), expected[nonzero].view(np.uint32))
    padded = -(-rows // LANES[isa]) * LANES[isa]  # a last panel's zero columns
    assert coded.nbytes() * 8 == GGUF_TYPES[qtype].held_bits * padded * block * blocks  # what a load is sized by


@pytest.mark.parametrize("qtype", sorted(GGUF_TYPES))
def test_each_types_row_says_how_its_codes_are_held(qtype):
    row = GGUF_TYPES[qtype]
    block, _ = GGML_QUANT_SIZES[qtype]
    codes = block_codes(random_blocks(qtype, 4, 1, 7), qtype, 4, block)
    assert row.held_as.split(":")[0].split(",")[0] == from_blocks(codes, LANES[ISA]).kind
    assert ("sub-scales" in row.held_as) == (codes.sub is not None)
    assert set(row.precisions) == {"exact", "int8"} and row.layer(conv1d=False) is CodedLinear


def test_the_type_tables_in_the_docs_and_the_readme_are_the_rows():
    assert type_table() in gguf_blocks.__doc__
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    short = lambda bits: f"{round(bits, 1):g}"  # noqa: E731
    seen = set()
    for names, _, bits in re.findall(r"^\| ((?:Q\w+)(?:, Q\w+)*) \| ([^|]+) \| ([^|]+) \|$", readme, re.M):
        types = [T[name] for name in names.split(", ")]
        held, in_file = re.fullmatch(r"([\d.]+) \(([\d., ]+)\)", bits.strip()).groups()
        assert all(short(GGUF_TYPES[t].held_bits) == held for t in types), names
        assert in_file.split(", ") == [short(gguf_blocks.file_bits(t)) for t in types], names
        seen.update(types)
    assert seen == set(GGUF_TYPES)  # README.md#models-and-gguf's table names every type the rows hold


def test_a_type_without_a_code_format_or_with_a_non_finite_scale_has_no_codes():
    raw = random_blocks(T.Q4_0, 2, 1, 0)
    raw[0, :2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    assert block_codes(raw, T.Q4_0, 2, 32) is None
    assert T.IQ4_NL not in GGUF_TYPES and block_codes(np.zeros((2, 18), np.uint8), T.IQ4_NL, 2, 32) is None


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(sorted(GGUF_TYPES)), rows=st.integers(1, 64), n=st.integers(1, 70),
       blocks=st.integers(1, 2), with_bias=st.booleans(), isa=st.sampled_from(ISAS), seed=st.integers(0, 10**6))
def test_the_op_on_every_type_equals_the_float32_panels_and_matmul_in_float64(qtype, rows, n, blocks, with_bias, isa,
                                                                             seed):
    """Odd shapes (a short last panel), 1-64 rows (registers, and the decode-once buffer past 16),
    each ISA this CPU has; the library's F.linear, the fallback, on the same values within rounding."""
    block, _ = GGML_QUANT_SIZES[qtype]
    k = block * blocks
    codes = block_codes(random_blocks(qtype, n, blocks, seed), qtype, n, k)
    weight = torch.from_numpy(codes.values())
    coded = from_blocks(codes, LANES[isa])
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    bias = torch.randn(n, generator=generator) if with_bias else None
    out = coded.linear(x, bias, n, isa)
    assert torch.equal(out, torch.ops.specfree.panel_linear(x, pack(weight, LANES[isa]), bias, n, isa))
    one = coded.linear(x[-1:], bias, n, isa)
    assert torch.equal(one[0], out[-1])  # a row's bits its own
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    tolerance = 1e-5 * (k ** 0.5) * (x.abs().max().item() * weight.abs().max().item() + 1)
    assert (out.double() - expected).abs().max().item() <= tolerance
    library = torch.nn.functional.linear(x, weight, bias)
    assert (library.double() - expected).abs().max().item() <= tolerance


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def tiny_file(folder, qtype: T, **kwargs):
    name = "-".join([qtype.name] + [f"{k}_{getattr(v, 'name', v)}" for k, v in sorted(kwargs.items())])
    path = folder / f"{name}.gguf"
    return path if path.exists() else write_tiny_llama(path, qtype, **kwargs)


def reference(path):
    """transformers' own model of the file (every tensor dequantized to float32)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def greedy(model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 300, 301]


@pytest.mark.parametrize("qtype", CODED + (T.F16, T.BF16, T.F32), ids=lambda t: t.name)
def test_a_tiny_llama_of_every_type_holds_codes_and_decodes_as_transformers_does(qtype, gguf_dir, tmp_path):
    path = tiny_file(gguf_dir, qtype)
    model, _ = load_model(str(path), cache_dir=tmp_path)
    holdings = model.gguf_holdings
    coded = [m for m in model.modules() if isinstance(m, CodedLinear)]
    if qtype in CODED:
        assert not holdings.dequantized and len(coded) == 7 * 2 + 1  # every linear, and the tied head
        assert isinstance(model.get_input_embeddings(), CodedEmbedding)
        assert all(dict(types) == {qtype.name: types.total()} for types in holdings.coded.values())
    else:
        assert not coded and not holdings.coded
        wide = [m for m in model.modules() if isinstance(m, WidePanelLinear)]
        assert len(wide) == (7 * 2 if qtype != T.F32 else 0)  # 16-bit weights stay 16 bits
    assert not any(p.is_file() and p.stat().st_size > 1 << 20 for p in tmp_path.rglob("*")  # no float weights
                   if "kernels" not in p.parts and not p.name.startswith("codes-"))  # cached: codes are
    engine = Engine.from_model(model, None, "hybrid", precision="exact")  # transformers' arithmetic
    assert engine.generate(PROMPT, 16, ignore_eos=True).tokens == greedy(reference(path), PROMPT, 16)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_a_warm_load_reads_the_stored_codes_and_a_damaged_entry_is_repacked(qtype, gguf_dir, tmp_path, monkeypatch):
    import specfree.gguf_model

    path = tiny_file(gguf_dir, qtype)
    first, _ = load_model(str(path), cache_dir=tmp_path)
    (stored,) = tmp_path.rglob("codes-*.pt")
    repack = specfree.gguf_model._coded
    monkeypatch.setattr(specfree.gguf_model, "_coded", lambda *args, **kwargs: pytest.fail("repacked"))
    second, _ = load_model(str(path), cache_dir=tmp_path)
    pairs = list(zip(first.named_buffers(), second.named_buffers(), strict=True))
    assert pairs and all(a == b and torch.equal(x, y) for (a, x), (b, y) in pairs)
    expected = greedy(reference(path), PROMPT, 12)
    engine = Engine.from_model(second, None, "hybrid", precision="exact")
    assert engine.generate(PROMPT, 12, ignore_eos=True).tokens == expected
    stored.write_bytes(b"not a torch file")
    monkeypatch.setattr(specfree.gguf_model, "_coded", repack)
    with pytest.warns(UserWarning, match="could not be read"):
        third, _ = load_model(str(path), cache_dir=tmp_path)
    assert Engine.from_model(third, None, "hybrid", precision="exact").generate(PROMPT, 12, ignore_eos=True).tokens == expected
    assert stored.stat().st_size > 1000  # written again
    older = stored.with_name("codes-0000000000000000.pt")  # an older specfree's entry
    older.write_bytes(stored.read_bytes())
    stored.unlink()
    load_model(str(path), cache_dir=tmp_path)
    assert stored.is_file() and not older.exists()


@pytest.mark.parametrize("qtype,head", [(T.Q4_K, T.Q6_K), (T.Q5_K, T.Q8_0), (T.Q4_0, T.F16)], ids=str)
def test_an_untied_head_of_another_type_and_the_embedding_keep_their_own_codes(qtype, head, gguf_dir, tmp_path):
    path = tiny_file(gguf_dir, qtype, tied=False, head_type=head)
    model, _ = load_model(str(path), cache_dir=tmp_path)
    embedding, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embedding, CodedEmbedding) and embedding.table is not lm_head
    assert isinstance(lm_head, CodedLinear) == (head != T.F16)
    assert model.gguf_holdings.coded.get("output", {}).get(head.name, 0) == (head != T.F16)
    engine = Engine.from_model(model, None, "prompt_lookup", precision="exact")
    assert engine.generate(PROMPT, 12, ignore_eos=True).tokens == greedy(reference(path), PROMPT, 12)


STRATEGIES = ["autoregressive", "prompt_lookup", "lookahead", "trie", "recycling", "hybrid", "sam", "logit_spec",
              "suffix"]


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_1], ids=lambda t: t.name)
def test_every_strategy_is_lossless_and_every_verify_row_equals_the_one_row_forward(qtype, gguf_dir, tmp_path):
    path = tiny_file(gguf_dir, qtype)
    model, _ = load_model(str(path), cache_dir=tmp_path)
    expected = greedy(reference(path), PROMPT, 12)
    for strategy in STRATEGIES:
        knobs = {"draft_tree_capacity": 16} if strategy == "logit_spec" else {}
        engine = Engine.from_model(model, None, strategy, precision="exact", **knobs)
        assert engine.generate(PROMPT, 12, ignore_eos=True).tokens == expected, strategy
    sampling = dict(do_sample=True, seed=5, temperature=0.8, precision="exact")
    sampled = Engine.from_model(model, None, "hybrid", **sampling).generate(PROMPT, 12, ignore_eos=True).tokens
    assert sampled == Engine.from_model(model, None, "autoregressive", **sampling).generate(
        PROMPT, 12, ignore_eos=True).tokens
    adapter = HFAdapter(model, check_tree_mask=False, precision="exact")
    chain, tree, alone = chain_and_tree_against_one_row(adapter, CONTEXT, CONTINUATION)
    assert torch.equal(chain, alone) and torch.equal(tree, alone)


def test_the_name_map_is_transformers_own(gguf_dir):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

    from specfree.gguf_model import gguf_names

    path = tiny_file(gguf_dir, T.Q8_0, tied=False)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    processor = LlamaTensorProcessor(config=config.to_dict())
    assert gguf_names(model, processor, "llama") == get_gguf_hf_weights_map(model, processor)


@pytest.mark.parametrize("damage", ["truncated", "header only", "foreign", "empty"])
def test_a_broken_gguf_is_one_line_and_leaves_nothing_in_the_cache(damage, gguf_dir, tmp_path):
    whole = tiny_file(gguf_dir, T.Q4_0).read_bytes()
    data = {"truncated": whole[: len(whole) - 5000], "header only": whole[:200],
            "foreign": b"PK\x03\x04" + whole[4:], "empty": b""}[damage]
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path), cache_dir=cache)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    left = [p for p in cache.rglob("*") if p.is_file() and "kernels" not in p.parts] if cache.exists() else []
    assert all(p.parent.name == "digests" for p in left), left  # at most the digest memo


def test_a_file_too_large_for_memory_is_refused_up_front_with_the_bytes(gguf_dir, tmp_path, monkeypatch):
    from specfree import gguf_model

    monkeypatch.setattr(gguf_model, "available_memory", lambda: 1000)  # the name gguf_model calls
    with pytest.raises(ModelLoadError, match=r"needs about .* GiB of memory .* and 0.0 GiB is available"):
        load_model(str(tiny_file(gguf_dir, T.Q4_0)), cache_dir=tmp_path)


def test_a_stock_float32_copy_that_would_not_fit_is_refused_before_unpacking(gguf_dir, tmp_path, monkeypatch):
    import specfree.kernels as kernels
    from specfree.errors import SpecfreeError

    model, _ = load_model(str(tiny_file(gguf_dir, T.Q4_K)), cache_dir=tmp_path)
    monkeypatch.setattr(kernels.layers, "available_memory", lambda: 1000)
    with pytest.raises(SpecfreeError, match=r"stock float32 copy of this model's linear layers needs .* GiB"):
        with kernels.stock_linears(model):
            pass
    assert isinstance(model.get_output_embeddings(), CodedLinear)  # nothing was unpacked


def test_files_of_one_architecture_in_other_types_get_their_own_compiled_package(gguf_dir, tmp_path):
    """A package traced on one type's codes (int32 words, float16 scales) cannot run another's (int8
    codes, 8-bit sub-scales): the package's key names the tensors each layer holds."""
    from specfree.adapters.packaged import architecture_fingerprint

    keys = {qtype: architecture_fingerprint(load_model(str(tiny_file(gguf_dir, qtype)), cache_dir=tmp_path)[0])
            for qtype in (T.Q4_0, T.Q6_K)}
    assert keys[T.Q4_0] != keys[T.Q6_K]
    again = load_model(str(tiny_file(gguf_dir, T.Q4_0, seed=1)), cache_dir=tmp_path)[0]  # other values, same type
    assert architecture_fingerprint(again) == keys[T.Q4_0]


def test_each_coded_layer_keeps_its_types_row_and_preparation_reads_its_precisions(tmp_path):
    from dataclasses import replace

    from specfree.kernels.layers import set_precision
    from specfree.settings import EngineSettings

    model, _ = load_model(str(write_tiny_llama(tmp_path / "q8.gguf", T.Q8_0)), cache_dir=tmp_path)
    coded = [m for m in model.modules() if isinstance(m, CodedLinear)]
    assert coded and all(m.block_type is GGUF_TYPES[T.Q8_0] for m in coded)
    int8 = EngineSettings(precision="int8", cache_dir=str(tmp_path))
    set_precision(model, int8)
    assert {m.precision for m in coded} == {"int8"}
    exact_only = replace(GGUF_TYPES[T.Q8_0], precisions=("exact",))  # a type whose row has no int8 kernel
    for module in coded:
        module.block_type = exact_only
    set_precision(model, int8)
    assert {m.precision for m in coded} == {"exact"}
