"""Every supported model family decodes losslessly through the adapter; the others are refused by name."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from specfree import Engine, UnsupportedModelError
from specfree.adapters.attention import TREE_ATTENTION
from specfree.adapters.hf import HFAdapter
from specfree.loading import ignores_custom_masks, load_model
from tests.tiny_models import COMMON, CONFIGS, FAMILIES, reference_greedy, tiny_model

# Repetitive, so prompt lookup drafts several sibling candidates; 20 + 16 tokens outrun the
# 16-token window of the windowed families.
PROMPT = [5, 6, 7, 8, 9] * 3 + [10, 11, 5, 6, 7]


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_drafts_reproduce_generate(family):
    model = tiny_model(family)
    engine = Engine.from_model(model, None, "prompt_lookup", num_candidates=3, draft_len=6)
    result = engine.generate(PROMPT, 16)
    assert result.tokens == reference_greedy(model, PROMPT, 16)
    assert engine.adapter.max_length == 512  # windows are masked, never a cap on the context


def test_mixed_sliding_and_full_layers_get_one_mask_per_kind():
    adapter = HFAdapter(tiny_model("gemma2"))
    assert adapter.capabilities.windows.per_kind == {"full_attention": None, "sliding_attention": 16}
    assert adapter.capabilities.windows.sliding is None and adapter.capabilities.windows.narrowest == 16


def test_one_window_for_every_layer_past_the_window():
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, **COMMON)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    engine = Engine.from_model(model, None, "prompt_lookup", num_candidates=3, draft_len=6)
    assert engine.adapter.capabilities.windows.sliding == 8
    assert engine.generate(PROMPT, 12).tokens == reference_greedy(model, PROMPT, 12)


def test_flash_attention_is_detected():
    assert ignores_custom_masks("flash_attention_2") and ignores_custom_masks("flash_attention_3")
    assert ignores_custom_masks("kernels-community/flash-attn2")
    assert not any(map(ignores_custom_masks, ["sdpa", "eager", None]))


def _claims_flash(family: str) -> transformers.PreTrainedModel:
    """A fresh tiny model whose config says flash attention (settable without flash-attn installed)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="eager").eval()
    model.config._attn_implementation = "flash_attention_2"
    return model


# Both then run specfree's tree attention: the llama from SDPA, gemma2 (soft-capped, no SDPA) from eager.
@pytest.mark.parametrize("family, fallback, final", [("llama", "sdpa", TREE_ATTENTION),
                                                    ("gemma2", "eager", TREE_ATTENTION)])
def test_flash_attention_model_switches_to_a_masked_implementation(family, fallback, final):
    model = _claims_flash(family)
    with pytest.warns(UserWarning, match=f"'flash_attention_2' cannot take specfree's tree attention mask; "
                                         f"switched this model to '{fallback}'"):
        engine = Engine.from_model(model, None, "prompt_lookup")
    assert model.config._attn_implementation == final
    assert engine.generate(PROMPT, 8).tokens == reference_greedy(model, PROMPT, 8)


def test_flash_attention_model_that_cannot_switch_is_refused():
    class FixedAttention(transformers.LlamaForCausalLM):
        def _can_set_attn_implementation(self) -> bool:  # as a model outside AttentionInterface
            return False

    torch.manual_seed(0)
    model = FixedAttention(CONFIGS["llama"]()).eval()
    model.config._attn_implementation = "flash_attention_2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsupportedModelError, match="model family 'llama' runs 'flash_attention_2', which "
                                                        "cannot take specfree's tree attention mask, and could "
                                                        "not be switched .*attn_implementation='sdpa' or 'eager'"):
            HFAdapter(model)


def test_load_model_asked_for_flash_attention_loads_sdpa(tiny_llama_dir):
    with pytest.warns(UserWarning, match="'flash_attention_2' cannot take specfree's tree attention mask; "
                                         "loading with 'sdpa'"):
        model, _ = load_model(str(tiny_llama_dir), attn_implementation="flash_attention_2")
    assert model.config._attn_implementation == "sdpa"


def test_mpt_decodes_up_to_its_own_max_seq_len():
    # MPT's ALiBi bias is built max_seq_len long: a longer context failed inside its attention.
    model = tiny_model("mpt")
    assert HFAdapter(model, check_tree_mask=False).max_length == model.config.max_seq_len == 512
