"""Falcon files in the layout llama.cpp's converter writes (its fused heads as all queries, all keys, all
values: ``tensor_data_layout`` "jploski") decode as the source model rounded as the file rounds it, for each
kind of Falcon decoder; and a file whose layout specfree cannot know is refused by tensor and architecture.
These files are written here (``tests.gguf_architectures.converter_qkv``), so no llama.cpp is needed; the
check against the converter itself is ``tests/test_gguf_converter.py``."""

from __future__ import annotations

import gguf
import pytest
import torch

from specfree import Engine
from specfree.errors import ModelLoadError
from specfree.loading import load_model
from tests.gguf_architectures import HEADS, file_model, write_architecture
from tests.test_gguf_architectures import PROMPTS, greedy

NEW = 10
# Falcon's three decoders: the newer (grouped key/value heads, two norms a layer), the old with multi-query
# (falcon-7b), the old with a key and value a head. num_key_value_heads is what the writer states in the file.
DECODERS = {
    "grouped": dict(new_decoder_architecture=True, num_kv_heads=2, num_key_value_heads=2),
    "multi_query": dict(new_decoder_architecture=False, multi_query=True, num_kv_heads=1, num_key_value_heads=1),
    "per_head": dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=HEADS,
                     num_key_value_heads=HEADS),
}


def rounded(model):
    """``model`` with its matrices rounded through float16, as an F16 file holds them (norms stay float32)."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(parameter.half().float())
    return model


def logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def decodes_as(path, reference, cache) -> None:
    """specfree's model of ``path`` gives ``reference``'s logits (a misread head moves them far more than
    the float32 product orders do) and its greedy tokens."""
    model, _ = load_model(str(path), cache_dir=cache)
    for prompt in PROMPTS:
        torch.testing.assert_close(logits(model, prompt), logits(reference, prompt), rtol=0, atol=1e-3)
    engine = Engine.from_model(model, None, "autoregressive", precision="exact")
    assert [engine.generate(prompt, NEW, ignore_eos=True).tokens for prompt in PROMPTS] == [
        greedy(reference, prompt, NEW) for prompt in PROMPTS]


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_falcon_file_in_the_converters_layout_decodes_as_the_rounded_source(decoder, tmp_path):
    path = tmp_path / f"falcon-{decoder}.gguf"
    source = write_architecture(path, "falcon", "F16", extra=DECODERS[decoder])
    decodes_as(path, rounded(source), tmp_path / "cache")


@pytest.mark.parametrize("decoder", ["grouped", "per_head"])
def test_a_quantized_falcon_in_the_converters_layout_is_held_as_codes_in_transformers_row_order(decoder, tmp_path):
    path = tmp_path / f"falcon-{decoder}-q8.gguf"
    source = write_architecture(path, "falcon", "Q8_0", extra=DECODERS[decoder])
    decodes_as(path, file_model(path, source), tmp_path / "cache")  # the reference: dequantized, then rows moved
    model, _ = load_model(str(path), cache_dir=tmp_path / "cache")
    assert "attn_qkv" in model.gguf_holdings.coded  # the rows moved as codes


def _overwrite(path, old: bytes, new: bytes) -> None:
    """Bytes of the file's metadata replaced in place, the same length (a key or a value renamed)."""
    data = bytearray(path.read_bytes())
    at = data.index(old)
    data[at:at + len(old)] = new
    path.write_bytes(bytes(data))


def test_a_grouped_falcon_that_does_not_state_its_layout_is_refused_by_tensor_and_architecture(tmp_path):
    path = tmp_path / "falcon-unstated.gguf"
    write_architecture(path, "falcon", "F16", extra=DECODERS["grouped"])
    _overwrite(path, b"falcon.tensor_data_layout", b"falcon.tensor_data_layouX")  # the key is gone
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_qkv\.weight \(falcon\) .* would decode a guess"):
        load_model(str(path), cache_dir=tmp_path / "cache")


def test_a_multi_query_falcon_needs_no_stated_layout_its_orders_are_one(tmp_path):
    path = tmp_path / "falcon-mq-unstated.gguf"
    source = write_architecture(path, "falcon", "F16", extra=DECODERS["multi_query"])
    _overwrite(path, b"falcon.tensor_data_layout", b"falcon.tensor_data_layouX")
    decodes_as(path, rounded(source), tmp_path / "cache")


def test_a_layout_specfree_does_not_map_is_refused_by_name(tmp_path):
    path = tmp_path / "falcon-other.gguf"
    write_architecture(path, "falcon", "F16", extra=DECODERS["grouped"])
    _overwrite(path, b"jploski", b"jpl0ski")
    with pytest.raises(ModelLoadError, match=r"'jpl0ski' layout, which specfree does not map for the falcon"):
        load_model(str(path), cache_dir=tmp_path / "cache")


def test_transformers_own_reading_of_a_grouped_falcon_is_refused_not_decoded(tmp_path):
    path = tmp_path / "falcon-bf16.gguf"
    write_architecture(path, "falcon", "F16", extra=DECODERS["grouped"])
    with pytest.raises(ModelLoadError, match="specfree reads it itself only on a CPU in float32"):
        load_model(str(path), dtype="bfloat16", cache_dir=tmp_path / "cache")


def test_the_metadata_edit_the_refusals_use_leaves_a_readable_file(tmp_path):
    path = tmp_path / "falcon-edited.gguf"
    write_architecture(path, "falcon", "F16", extra=DECODERS["grouped"])
    _overwrite(path, b"jploski", b"jpl0ski")
    assert gguf.GGUFReader(str(path)).fields["falcon.tensor_data_layout"].contents() == "jpl0ski"
