"""Every user mistake gets one clear message naming the problem and the fix."""

from __future__ import annotations

import pytest
import torch
import transformers

from specfree import ConfigError, Engine, ModelLoadError, UnsupportedModelError
from specfree.adapters.hf import HFAdapter
from specfree.loading import load_model
from tests.tiny_models import COMMON, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def engine():
    return Engine.from_model(tiny_model("llama"), None, "prompt_lookup")


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    ([5, 128, 7], r"prompt token ids must be integers in \[0, 128\); got \[128\]"),
    ([5, -1], r"got \[-1\]"),
    ([5, 2.5], r"got \[2.5\]"),
    ([7] * 600, "the prompt has 600 tokens but the model's context holds 512; shorten the prompt"),
    ("text", "a text prompt needs a tokenizer"),
])
def test_bad_prompts(engine, prompt, message):
    with pytest.raises(ConfigError, match=message):
        engine.generate(prompt, 5)


def test_a_text_prompt_with_undecodable_bytes():
    # Python turns bytes that are not UTF-8 (in argv, or stdin under a C locale) into lone surrogates.
    engine = Engine.from_model(tiny_model("llama"), tiny_tokenizer(), "prompt_lookup")
    for chat in (False, True):
        with pytest.raises(ConfigError, match=r"^the prompt is not valid UTF-8 text \(it holds undecodable bytes\)"):
            engine.generate("the cat \udcff", 5, chat=chat)


def test_a_negative_seed(engine):
    with pytest.raises(ConfigError, match="^seed must be >= 0, got -1$"):
        engine.generate([5, 6], 5, seed=-1)


@pytest.mark.parametrize("max_new", [0, -3])
def test_bad_max_new_tokens(engine, max_new):
    with pytest.raises(ConfigError, match=f"max_new_tokens must be >= 1, got {max_new}"):
        engine.generate([5, 6], max_new)


@pytest.mark.parametrize("strategy, knobs, message", [
    ("nope", {}, "unknown strategy 'nope'; available: autoregressive, .*prompt_lookup"),
    ("prompt_lookup", {"draft_len": -1}, r"prompt_lookup.draft_len must be >= 1, got -1"),
    ("prompt_lookup", {"max_ngram": 0}, r"prompt_lookup.max_ngram must be >= 1, got 0"),
    ("prompt_lookup", {"min_ngram": 3, "max_ngram": 2}, r"prompt_lookup.min_ngram must be between 1 and 2, got 3"),
    ("prompt_lookup", {"match": "best"}, r"prompt_lookup.match must be one of \['recent', 'longest', 'frequent'\]"),
    ("prompt_lookup", {"draft_length": 4}, r"strategy 'prompt_lookup' has no knob 'draft_length'; its knobs: max_ngram"),
    ("prompt_lookup", {"num_candidates": "3"}, r"prompt_lookup.num_candidates must be an integer, got '3'"),
    ("autoregressive", {"do_sample": True, "temperature": 0}, r"temperature must be > 0.0, got 0.0"),
    ("autoregressive", {"do_sample": True, "top_p": 1.5}, r"top_p must be > 0.0 and <= 1.0, got 1.5"),
    ("autoregressive", {"do_sample": True, "seed": -1}, r"seed must be >= 0, got -1"),
    # The trie strategy names its own knobs, not the pool it builds from them.
    ("trie", {"decay": 0}, r"^trie.decay must be > 0.0 and < 1.0, got 0.0$"),
    ("trie", {"decay": 1}, r"^trie.decay must be > 0.0 and < 1.0, got 1.0$"),
    ("trie", {"max_nodes": 0}, r"^trie.max_nodes must be >= 1, got 0$"),
    ("trie", {"branch_length": 0}, r"^trie.branch_length must be >= 1, got 0$"),
    ("trie", {"max_query_length": 0}, r"^trie.max_query_length must be >= 1, got 0$"),
])
def test_bad_strategy_and_knobs(strategy, knobs, message):
    with pytest.raises(ConfigError, match=message):
        Engine.from_model(tiny_model("llama"), None, strategy, **knobs)


@pytest.mark.parametrize("drafters, message", [
    (["prompt_lookup", "nope"], r"^hybrid.drafters\[1\]: unknown strategy 'nope'; members can be: autoregressive, "
                                r"logit_spec, lookahead, prompt_lookup, recycling, retrieval, sam, suffix, trie$"),
    ([{"name": "lookahead", "windw": 2}], r"^hybrid.drafters\[0\] \(lookahead\): windw: strategy 'lookahead' has no "
                                         r"knob 'windw'; its knobs: window, .* \(did you mean window\?\)$"),
    ([{"name": "lookahead", "window": "wide"}], r"^hybrid.drafters\[0\] \(lookahead\): window: expected int, "
                                                r"got 'wide'$"),
    ([{"name": "trie", "decoding_length": None}], r"^hybrid.drafters\[0\] \(trie\): decoding_length: expected int, "
                                                  r"got None$"),
    (["trie", {"name": "hybrid"}], r"^hybrid.drafters\[1\] \(hybrid\): a hybrid cannot be a member of a hybrid; "
                                   r"list its members in this hybrid's drafters instead$"),
    ([{"name": "retrieval", "datastore": "/no/such.sfds"}], r"^hybrid.drafters\[0\] \(retrieval\): datastore file not "
                                                            r"found: /no/such.sfds \(build one with: python -m specfree "),
    (["retrieval"], r"^hybrid.drafters\[0\] \(retrieval\): strategy=retrieval needs a datastore file: "
                    r"strategy.datastore=PATH"),
    ([{"name": "prompt_lookup", "draft_len": 0}], r"^hybrid.drafters\[0\] \(prompt_lookup\): prompt_lookup.draft_len "
                                                  r"must be >= 1, got 0$"),
    ([{"name": "lookahead", "pool": "nope"}], r"^hybrid.drafters\[0\] \(lookahead\): lookahead.pool=nope: unknown "
                                             r"pool 'nope'; available: lru, suffix_array, suffix_automaton, suffix_tree, trie$"),
    ([{"name": "recycling", "pool": "trie"}], r"^hybrid.drafters\[0\] \(recycling\): pool: strategy 'recycling' has "
                                             r"no knob 'pool'; its knobs: successors, widths$"),
    ([{"name": "trie", "priced": False}], r"^hybrid.drafters\[0\] \(trie\): priced sets how the whole step runs, "
                                         r"not one member: set it on the strategy that holds this one"),
    ([{"window": 2}], r"^hybrid.drafters\[0\]: give a strategy name or \{name: NAME, knob: value, ...\}, got "),
    ([], r"^hybrid.drafters must be a non-empty list of strategy names or \{name: ..., knobs\}, got \[\]$"),
])
def test_bad_hybrid_members(drafters, message):
    with pytest.raises(ConfigError, match=message) as info:
        Engine.from_model(tiny_model("llama"), None, "hybrid", drafters=drafters)
    assert "\n" not in str(info.value)


def test_generation_stops_at_the_model_context(engine):
    result = engine.generate([7] * 500, 100, ignore_eos=True)
    assert len(result.tokens) == 12 and result.stop_reason == "context_length"


def test_a_model_whose_rows_see_later_rows_is_refused_by_name():
    """An encoder loaded as a causal LM attends both ways; the probe must not let it decode."""
    def roberta(is_decoder: bool):
        config = transformers.RobertaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=512,
                                            is_decoder=is_decoder, **COMMON)
        return transformers.AutoModelForCausalLM.from_config(config).eval()

    with pytest.raises(UnsupportedModelError, match="model family 'roberta' is not causal: a row's logits change "
                                                    "when later tokens are appended .*is_decoder=True"):
        HFAdapter(roberta(is_decoder=False))
    HFAdapter(roberta(is_decoder=True))  # the same family as a decoder is causal and passes


def test_sparse_top_k_attention_is_refused_by_name():
    from tests.family_configs import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("hy_v4")).eval()
    with pytest.raises(UnsupportedModelError, match="model family 'hy_v4' runs sparse top-k attention "
                                                    r"\(indexed_attention layers\)"):
        HFAdapter(model)


@pytest.mark.parametrize("codebooks", [1, 4])
def test_one_lm_head_per_codebook_is_refused_by_name(codebooks):
    """MusicGen's decoder predicts one token per codebook at each position (a list of LM heads), and
    its generate offsets the codebooks by a delay pattern: even one codebook is not plain decoding
    (the first prompt token becomes the start token, pad tokens leave the output)."""
    config = transformers.MusicgenDecoderConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_codebooks=codebooks, pad_token_id=128,
                                                bos_token_id=128, max_position_embeddings=512)
    model = transformers.MusicgenForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match=f"model family 'musicgen_decoder' keeps its LM heads in a "
                                                    rf"list \({codebooks}, one per audio codebook"):
        HFAdapter(model)


def test_logits_that_depend_on_the_split_between_forwards_are_refused_by_name():
    """BLT patches, hashes and runs its global transformer over each forward's own tokens: the probes
    find that transformers' own cached steps differ from one forward over the whole sequence."""
    from tests.family_configs import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("blt")).eval()
    with pytest.raises(UnsupportedModelError, match="model family 'blt' gives logits that depend on how the tokens "
                                                    "are split between forwards, in transformers itself"):
        HFAdapter(model)


def test_lsh_attention_is_refused_by_name():
    """Reformer's LSH layers chunk the tokens by hash bucket past their chunk length: a row's logits
    change with later tokens, and generate's cached one-token steps see other keys."""
    config = transformers.ReformerConfig(vocab_size=128, hidden_size=32, attention_head_size=8, num_attention_heads=4,
                                         feed_forward_size=64, attn_layers=["local", "lsh"], num_hidden_layers=2,
                                         axial_pos_shape=[16, 32], axial_pos_embds_dim=[16, 16],
                                         max_position_embeddings=512, local_attn_chunk_length=16,
                                         lsh_attn_chunk_length=16, num_buckets=4, hash_seed=0, is_decoder=True)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="model family 'reformer' runs LSH attention "
                                                    r"\(attn_layers 'lsh', lsh_attn_chunk_length=16\)"):
        HFAdapter(model)


def test_a_drafting_head_is_refused_by_name():
    """Gemma 4's assistant drafts for a Gemma 4 target from its hidden state and KV: not an LM on its own."""
    from tests.family_configs import tiny_config

    try:
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("gemma4_assistant")).eval()
    except ValueError:  # its config validation rejects every layer sharing KV
        pytest.skip("transformers 5.23 cannot build a Gemma 4 assistant")
    with pytest.raises(UnsupportedModelError, match="model family 'gemma4_assistant' is a drafting head for another "
                                                    "model: .*Give specfree the model it drafts for"):
        HFAdapter(model)


@pytest.mark.skipif("dory" not in transformers.CONFIG_MAPPING, reason="Dory came with transformers 5.24")
def test_logits_that_depend_on_how_tokens_are_split_are_refused_by_name():
    """Dory's `last_loop` cache mode: earlier loops read the last loop's keys for cached tokens but their
    own for new rows, so transformers' own logits change with the split; `per_loop` (the default) is exact."""
    from tests.family_configs import tiny_config

    config = tiny_config("dory")
    torch.manual_seed(0)
    assert HFAdapter(transformers.AutoModelForCausalLM.from_config(config).eval()).capabilities.verification == "tree"
    config.recurrent_kv_cache_mode = "last_loop"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="model family 'dory' gives logits that depend on how the tokens "
                                                    "are split between forwards, in transformers itself"):
        HFAdapter(model)


def test_model_files_that_do_not_exist(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found: .*missing.gguf"):
        load_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="could not load a causal LM from .*empty: it has no config.json"):
        load_model(str(tmp_path / "empty"))
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="notes.txt is a file but not a .gguf file: give a model folder or a "):
        load_model(str(tmp_path / "notes.txt"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu(tmp_path):
    with pytest.raises(ConfigError, match="device='cuda' was asked for but no CUDA GPU is available here; use device=cpu"):
        load_model(str(tmp_path), device="cuda")


def test_bad_dtype(tmp_path):
    with pytest.raises(ConfigError, match="dtype must be one of .*got 'float8'"):
        load_model(str(tmp_path), dtype="float8")
