"""The model's own generation settings (its ``generation_config``) are followed by default, losslessly.

Greedy-type settings give exactly the model's own ``generate()``; sampling settings give exactly
specfree's plain seeded sampling with the same settings, given explicitly; explicit arguments win;
``generation="plain"`` gives plain greedy; ``decode`` says what came from the model.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as settings_
from hypothesis import strategies as st
from rich.console import Console
from transformers import GenerationConfig
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from specfree import Engine, cli
from specfree.adapters import as_shipped
from specfree.config import compose
from specfree.errors import ConfigError
from specfree.plugins import build_plugin_manager, registry
from tests.test_lossless import CPU_LIKE, prompts, strategy_specs
from tests.tiny_models import BOS, EOS, PAD, VOCAB, tiny_model

STRATEGIES = registry(build_plugin_manager()).names("strategy")
PROMPT = [5, 6, 7, 8, 9] * 3 + [5, 6]
NEW = 16
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2)


def settings(**asked) -> GenerationConfig:
    """A generation_config as a model would ship it: its special tokens plus ``asked``."""
    asked.setdefault("eos_token_id", EOS)
    return GenerationConfig(bos_token_id=BOS, pad_token_id=PAD, **asked)


def model_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The model's own generate(), under whatever its generation_config says."""
    ids = torch.tensor([prompt])
    with torch.no_grad(), as_shipped(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model():
    """A copy of the tiny Llama whose generation_config the tests change (the shared one stays as built)."""
    return copy.deepcopy(tiny_model("llama"))


@pytest.fixture(scope="module")
def adapter(model):
    """One adapter for every engine here: the settings are read from the model, not the adapter."""
    return Engine.from_model(model, None, "autoregressive").adapter


@pytest.fixture(scope="module")
def plain(model) -> list[int]:
    model.generation_config = settings()
    return model_generate(model, PROMPT, NEW)


def greedy_cases(plain: list[int]) -> dict[str, dict]:
    """Each greedy-type setting, chosen so that it changes this prompt's plain greedy output."""
    stops_early = [EOS, plain[3]]  # an EOS that plain decoding meets at its 4th token
    return {
        "repetition_penalty": dict(repetition_penalty=1.3),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "forced_eos_token_id": dict(forced_eos_token_id=EOS),
        "suppress_tokens": dict(suppress_tokens=plain[:2]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=plain[:1]),
        "min_new_tokens": dict(min_new_tokens=8, eos_token_id=stops_early),
        "min_length": dict(min_length=len(PROMPT) + 8, eos_token_id=stops_early),
        "bad_words_ids": dict(bad_words_ids=[[plain[1]]]),
        "all at once": dict(repetition_penalty=1.2, no_repeat_ngram_size=3, forced_eos_token_id=EOS,
                            suppress_tokens=plain[1:2], begin_suppress_tokens=plain[:1]),
    }


@pytest.fixture(scope="module")
def greedy_expected(model, plain) -> dict[str, tuple[dict, list[int]]]:
    """Each case's settings and the model's own generate() output under them."""
    expected = {}
    for case, asked in greedy_cases(plain).items():
        model.generation_config = settings(**asked)
        expected[case] = asked, model_generate(model, PROMPT, NEW)
    return expected


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_settings_give_the_models_own_generate(strategy, model, adapter, plain, greedy_expected, datastore,
                                                      one_thread):
    knobs = {"datastore": datastore} if strategy == "retrieval" else {}
    for case, (asked, expected) in greedy_expected.items():
        assert expected != plain, f"{case} should change this prompt's output"
        model.generation_config = settings(**asked)
        engine = Engine.from_model(model, None, strategy, adapter=adapter, costs=CPU_LIKE, **knobs)
        assert engine.generate(PROMPT, NEW).tokens == expected, case
        assert set(engine.model_settings.followed) == set(asked) - {"eos_token_id"}


@settings_(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=prompts(), spec=strategy_specs(), penalty=st.sampled_from([None, 1.3]),
       ngram=st.sampled_from([None, 2, 3]), suppress=st.lists(st.integers(3, VOCAB - 1), max_size=3),
       forced_eos=st.booleans(), min_new=st.sampled_from([None, 4]), new=st.integers(1, 20))
def test_greedy_settings_property(model, adapter, prompt, spec, penalty, ngram, suppress, forced_eos, min_new, new):
    """Any mix of greedy-type settings, any strategy: the model's own generate(), token for token."""
    asked = {k: v for k, v in dict(repetition_penalty=penalty, no_repeat_ngram_size=ngram, suppress_tokens=suppress,
                                   forced_eos_token_id=EOS if forced_eos else None, min_new_tokens=min_new).items()
             if v}
    model.generation_config = settings(**asked)
    name, knobs = spec
    engine = Engine.from_model(model, None, name, adapter=adapter, costs=CPU_LIKE, **knobs)
    assert engine.generate(prompt, new).tokens == model_generate(model, prompt, new)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sampling_settings_give_plain_seeded_sampling(strategy, model, adapter, plain, datastore, one_thread):
    knobs = {"datastore": datastore} if strategy == "retrieval" else {}
    model.generation_config = settings(**SAMPLING, no_repeat_ngram_size=3)
    sampled = {seed: Engine.from_model(model, None, strategy, adapter=adapter, costs=CPU_LIKE, seed=seed, **knobs)
               .generate(PROMPT, NEW, ignore_eos=True).tokens for seed in (1, 2)}
    for seed, tokens in sampled.items():  # the same settings, given explicitly, without drafts
        explicit = Engine.from_model(model, None, "autoregressive", adapter=adapter, generation="plain", seed=seed,
                                     logits_processors=[NoRepeatNGramLogitsProcessor(3)], **SAMPLING)
        assert tokens == explicit.generate(PROMPT, NEW, ignore_eos=True).tokens
    assert sampled[1] != sampled[2]  # it really samples


def test_explicit_arguments_win_and_plain_ignores_the_model(model, adapter, plain, one_thread):
    model.generation_config = settings(**SAMPLING)
    greedy = Engine.from_model(model, None, "prompt_lookup", adapter=adapter, costs=CPU_LIKE, do_sample=False)
    assert greedy.verifier.name == "greedy" and greedy.model_settings.followed == {"repetition_penalty": 1.2}
    model.generation_config = settings(repetition_penalty=1.2)
    expected = model_generate(model, PROMPT, NEW)  # greedy, still with the model's repetition penalty
    model.generation_config = settings(**SAMPLING)
    assert greedy.generate(PROMPT, NEW).tokens == expected
    hotter = Engine.from_model(model, None, "prompt_lookup", adapter=adapter, costs=CPU_LIKE, temperature=1.3, seed=4)
    assert hotter.model_settings.followed == {k: v for k, v in SAMPLING.items() if k != "temperature"}
    explicit = Engine.from_model(model, None, "autoregressive", adapter=adapter, generation="plain", seed=4,
                                 **{**SAMPLING, "temperature": 1.3})
    assert hotter.generate(PROMPT, NEW).tokens == explicit.generate(PROMPT, NEW).tokens
    ignoring = Engine.from_model(model, None, "hybrid", adapter=adapter, costs=CPU_LIKE, generation="plain")
    assert ignoring.model_settings.line() is None and ignoring.verifier.name == "greedy"
    assert ignoring.generate(PROMPT, NEW).tokens == plain  # generate() under a bare generation_config
    with pytest.raises(ConfigError, match="generation must be one of model, plain"):
        Engine.from_model(model, None, "hybrid", adapter=adapter, generation="greedy")


def test_settings_specfree_does_not_follow_are_named(model, adapter):
    model.generation_config = settings(do_sample=True, min_p=0.05)
    with pytest.warns(UserWarning, match=r"not followed by specfree: min_p=0.05"):
        engine = Engine.from_model(model, None, "autoregressive", adapter=adapter)
    assert engine.model_settings.followed == {"do_sample": True, "top_k": 50}  # generate()'s own top_k default


def test_a_bad_value_from_the_model_names_its_source(model, adapter):
    model.generation_config = settings(do_sample=True, top_p=0.9)
    model.generation_config.top_p = 1.5  # past GenerationConfig's own checks, as a hand-edited file may be
    with pytest.raises(ConfigError, match=r"top_p must be .*generation_config: .*top_p=1.5.*generation=plain"):
        Engine.from_model(model, None, "autoregressive", adapter=adapter)


# ---- decode: configs, the stderr line, result.json -------------------------------------------
@pytest.fixture(scope="module")
def sampling_llama_dir(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama folder with a generation_config that samples and penalises repetition."""
    import shutil

    folder = tmp_path_factory.mktemp("sampling-llama")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    settings(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.1).save_pretrained(folder)
    return folder


def decode(folder, tmp_path, overrides):
    reg = registry(build_plugin_manager())
    cfg = compose(["model=local", f"model.path={folder}", "prompt=the cat and the dog", "max_new_tokens=8",
                   "strategy=prompt_lookup", "compile=false", f"output={tmp_path / 'r.json'}", *overrides], reg)
    err = io.StringIO()
    code = cli.decode(cfg, reg, out=Console(file=io.StringIO()), err=Console(file=err, width=300))
    return code, err.getvalue(), json.loads((tmp_path / "r.json").read_text())


def test_decode_follows_the_model_says_so_and_records_the_path(sampling_llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err, result = decode(sampling_llama_dir, tmp_path, ["seed=5"])
    assert code == 0
    assert ("from the model's generation_config: do_sample=True temperature=0.6 top_k=50 top_p=0.9 "
            "repetition_penalty=1.1 (generation=plain to decode greedily)") in err
    assert result["generation"]["followed"]["temperature"] == 0.6
    path = result["path"]
    assert path["forward"] == "eager" and path["eager_because"] == "compile=false"
    assert path["linear_kernel"].startswith(("few_row-", "library")) and path["attention"] in ("tree_attention", "grouped_sdpa", "sdpa", "eager")
    assert path["priced"] is True and path["verification"].startswith("llama: verifies")
    assert {"torch", "transformers", "specfree"} <= set(result["versions"]) and result["cpu"]["model_name"]
    # explicit settings win; generation=plain decodes greedily, silently
    _, err, hotter = decode(sampling_llama_dir, tmp_path, ["seed=5", "verifier=sampling", "verifier.temperature=1.5"])
    assert "temperature=0.6" not in err and hotter["generation"]["followed"]["top_p"] == 0.9
    _, err, greedy = decode(sampling_llama_dir, tmp_path, ["generation=plain"])
    assert "generation_config" not in err and greedy["generation"] == {"mode": "plain", "followed": {}, "ignored": {}}
    _, _, plain = decode(sampling_llama_dir, tmp_path, ["generation=plain", "strategy=autoregressive"])
    assert greedy["tokens"] == plain["tokens"]
    _, _, explicit_greedy = decode(sampling_llama_dir, tmp_path, ["verifier=greedy"])
    assert explicit_greedy["generation"]["followed"] == {"repetition_penalty": 1.1}


def test_a_verifier_knob_without_a_verifier_says_to_pick_one():
    with pytest.raises(ConfigError, match=r"no verifier is chosen; pick one first \(verifier=NAME"):
        compose(["verifier.temperature=0.7"])
