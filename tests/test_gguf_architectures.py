"""Every architecture transformers reads from GGUF, written small in F16, Q8_0 and Q4_K_M
(``tests.gguf_architectures``), decodes in specfree as the model of the file does, with its linear layers
held as codes; and what a swapped module carries (Gemma's embedding scale) is the model's own arithmetic."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from specfree import Engine
from specfree.adapters.hf import HFAdapter
from specfree.errors import ModelLoadError
from specfree.kernels import load_kernels
from specfree.kernels.codes import CodedEmbedding, CodedLinear, carries_embedding, find_codes
from specfree.kernels.experts import CODED_EXPERTS
from specfree.kernels.panels import LANES, WidePanelLinear
from specfree.loading import load_model
from tests.gguf_architectures import ARCHITECTURES, TYPES, file_model, write_architecture
from tests.test_tree_attention import CONTEXT, CONTINUATION, chain_and_tree_against_one_row

PROMPTS = ([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 300, 301], [40, 41, 42, 100, 200, 300, 12, 13])
NEW = 10
# Run dequantized (named in one warning line); every other layer is held as codes:
# MoE routers that are not nn.Linear (ffn_gate_inp_shexp: a 1-D tensor in the file) and GPT-2's position table
ROUTERS = ("ffn_gate_inp", "position_embd")


def greedy(model, prompt: list[int], new: int = NEW) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


def transformers_model(path):
    """transformers' own ``from_pretrained(gguf_file=)``, or None where it cannot read the file."""
    from transformers import AutoModelForCausalLM

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    except (RuntimeError, ValueError):
        return None


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("architectures")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_architecture_and_type_decodes_as_the_model_of_the_file_with_its_linears_as_codes(
        architecture, files, tmp_path):
    for kind in TYPES:
        path = files / f"{architecture}-{kind}.gguf"
        source = write_architecture(path, architecture, kind)
        expected = [greedy(file_model(path, source), prompt) for prompt in PROMPTS]
        reference = transformers_model(path)
        if reference is not None:  # where transformers reads the file, it agrees
            assert [greedy(reference, prompt) for prompt in PROMPTS] == expected, kind
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, _ = load_model(str(path), cache_dir=tmp_path)
        holdings = model.gguf_holdings
        if kind == "F16":
            assert not holdings.coded
            assert architecture == "gpt2" or any(isinstance(m, WidePanelLinear) for m in model.modules())
        else:
            assert not holdings.kept, kind
            assert all(any(part in name for part in ROUTERS) for name in holdings.dequantized), kind
            if "moe" in architecture:  # each expert's rows held as codes, run through transformers' experts interface
                assert {'ffn_gate_exps', 'ffn_up_exps', 'ffn_down_exps'} <= holdings.coded.keys()
                assert model.config._experts_implementation == CODED_EXPERTS
            assert isinstance(model.get_input_embeddings(), CodedEmbedding)
            linears = [m for m in model.modules() if type(m) is nn.Linear or type(m).__name__ == "FalconLinear"]
            assert all(m.weight.numel() < 256 * 64 for m in linears), kind  # routers at most, never a layer
        if holdings.dequantized:  # the routers run float32, and one line says so
            assert any("run dequantized as float32" in str(w.message) for w in caught)
        engine = Engine.from_model(model, None, "hybrid", precision="exact")  # transformers' arithmetic
        assert [engine.generate(prompt, NEW, ignore_eos=True).tokens for prompt in PROMPTS] == expected, kind


STRATEGIES = ["autoregressive", "prompt_lookup", "lookahead", "trie", "hybrid", "suffix"]


# Falcon calls torch's SDPA itself (not through transformers' AttentionInterface), so its rows run
# torch's kernel, not specfree's row-exact operator: their bits may depend on the row count (they do
# on a Zen 5), and the adapter says so, which keeps such a model out of batches and the prompt cache.
@pytest.mark.parametrize("architecture,kind,rows_exact", [("gemma3_text", "Q4_K_M", True), ("qwen3_moe", "Q8_0", True),
                                                          ("falcon", "Q4_K_M", False)])
def test_every_strategy_is_lossless_and_verify_rows_equal_the_one_row_forward(architecture, kind, rows_exact, files,
                                                                              tmp_path):
    path = files / f"{architecture}-{kind}-strategies.gguf"
    write_architecture(path, architecture, kind, seed=1)
    model, _ = load_model(str(path), cache_dir=tmp_path)
    alone = Engine.from_model(model, None, "autoregressive").generate(PROMPTS[0], NEW, ignore_eos=True).tokens
    for strategy in STRATEGIES:
        engine = Engine.from_model(model, None, strategy)
        assert engine.generate(PROMPTS[0], NEW, ignore_eos=True).tokens == alone, strategy
    sampling = dict(do_sample=True, seed=3, temperature=0.8)
    sampled = Engine.from_model(model, None, "hybrid", **sampling).generate(PROMPTS[0], NEW, ignore_eos=True).tokens
    assert sampled == Engine.from_model(model, None, "autoregressive", **sampling).generate(
        PROMPTS[0], NEW, ignore_eos=True).tokens
    adapter = HFAdapter(model, check_tree_mask=False)
    assert adapter.rows_exact == rows_exact
    if not rows_exact:
        engine = Engine.from_model(model, None, "hybrid")
        assert "not bit-equal" in engine.batch_off and "not bit-equal" in engine.reuse_off
        return
    chain, tree, one_row = chain_and_tree_against_one_row(adapter, CONTEXT, CONTINUATION)
    assert torch.equal(chain, one_row) and torch.equal(tree, one_row)  # MoE experts too: coded, row by row


def scaled_embedding_classes():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    return [Gemma2TextScaledWordEmbedding, Gemma3TextScaledWordEmbedding]


@pytest.mark.parametrize("cls", scaled_embedding_classes(), ids=lambda c: c.__name__)
@settings(max_examples=15, deadline=None)
@given(ids=st.lists(st.integers(0, 95), min_size=1, max_size=12), scale=st.floats(0.5, 64))
def test_a_coded_embedding_computes_what_the_models_own_embedding_class_computes(cls, ids, scale):
    isa = load_kernels()
    torch.manual_seed(0)
    head = nn.Linear(64, 96, bias=False)
    rounded = quants.dequantize(quants.quantize(head.weight.detach().numpy(), T.Q8_0), T.Q8_0)
    with torch.no_grad():  # weights that are exactly a Q8_0 code's values
        head.weight.copy_(torch.from_numpy(rounded.reshape(96, 64)))
    coded = find_codes(head.weight, LANES[isa])
    assert coded is not None
    stock = cls(96, 64, padding_idx=0, embed_scale=scale)
    with torch.no_grad():
        stock.weight.copy_(head.weight)
    assert carries_embedding(stock)
    swapped = CodedEmbedding(stock, CodedLinear(head, coded))
    index = torch.tensor(ids)
    assert torch.equal(swapped(index), stock(index))
    unswapped = swapped.to_embedding()
    assert type(unswapped) is cls and torch.equal(unswapped(index), stock(index))


def test_an_embedding_class_whose_arithmetic_is_not_carried_is_not_swapped():
    class Shifted(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) + 1

    assert carries_embedding(nn.Embedding(4, 4)) and not carries_embedding(Shifted(4, 4))
    with pytest.raises(TypeError, match="Shifted"):
        CodedEmbedding(Shifted(4, 4), None)


def test_metadata_that_disagrees_with_the_tensors_is_one_line_naming_both(files, tmp_path):
    import gguf

    path = files / "qwen3-wrong-heads.gguf"
    write_architecture(path, "qwen3", "F16")
    reader = gguf.GGUFReader(str(path), "r+")  # the file now says 16 dims a head; its tensors hold 32
    reader.fields["qwen3.attention.key_length"].parts[-1][0] = 16
    del reader
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_q\.weight has shape .* head_dim=16"):
        load_model(str(path), cache_dir=tmp_path)


@settings(max_examples=10, deadline=None)
@given(tokens=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_coded_experts_compute_what_the_experts_module_computes_and_each_row_alone(tokens, seed):
    """Qwen3-MoE's experts module, its eager forward on the codes' values, against ``coded_experts_forward``
    over the codes: close in float32 (another product order), and each row's bits those of the row alone."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from specfree.kernels.experts import ExpertCodes, coded_experts_forward

    isa = load_kernels()
    config = AutoConfig.for_model("qwen3_moe", hidden_size=64, moe_intermediate_size=32, num_experts=4)
    config._experts_implementation = "eager"
    experts = Qwen3MoeExperts(config)
    torch.manual_seed(seed)
    layers = {}
    for key, rows, columns in (("gate", 32, 64), ("up", 32, 64), ("down", 64, 32)):
        layers[key] = []
        for _ in range(4):
            linear = nn.Linear(columns, rows, bias=False)
            values = quants.dequantize(quants.quantize(linear.weight.detach().numpy(), T.Q8_0), T.Q8_0)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(values.reshape(rows, columns)))
            layers[key].append(CodedLinear(linear, find_codes(linear.weight, LANES[isa])))
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack([torch.cat([g.weight, u.weight]) for g, u in
                                                zip(layers["gate"], layers["up"])]))
        experts.down_proj.copy_(torch.stack([d.weight for d in layers["down"]]))
    experts.specfree_codes = ExpertCodes(layers["gate"], layers["up"], layers["down"])
    hidden = torch.randn(tokens, 64)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2)
    with torch.no_grad():
        coded = coded_experts_forward(experts, hidden, index, weights)
        torch.testing.assert_close(coded, experts(hidden, index, weights), rtol=1e-5, atol=1e-5)
        for row in range(tokens):
            alone = coded_experts_forward(experts, hidden[row:row + 1], index[row:row + 1], weights[row:row + 1])
            assert torch.equal(alone[0], coded[row])


def test_a_model_transformers_cannot_build_is_not_blamed_on_the_file(files, tmp_path):
    import gguf

    path = files / "llama-odd-heads.gguf"
    write_architecture(path, "llama", "F16")
    reader = gguf.GGUFReader(str(path), "r+")  # no key/value heads: transformers' attention divides by them
    reader.fields["llama.attention.head_count_kv"].parts[-1][0] = 0
    del reader
    with pytest.raises(ModelLoadError, match="could not build the llama model .* The file is not at fault") as error:
        load_model(str(path), cache_dir=tmp_path)
    assert "download it again" not in str(error.value)


@pytest.mark.parametrize("architecture", ["deci", "gpt-oss"])
def test_an_architecture_specfree_cannot_load_is_refused_by_name_with_the_reason(architecture, tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / f"{architecture}.gguf"
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"the {architecture} architecture are not supported: .+transformers folder"):
        load_model(str(path), cache_dir=tmp_path / "cache")
