"""Attention families that cannot verify a draft tree (their forward rejects or ignores a custom 4D
mask or position ids, or keeps no KV cache) verify one chain a step, chosen by the wrap-time probes,
and reproduce transformers' decoding token for token: greedy and seeded sampling, every strategy."""

from __future__ import annotations

import functools
import json

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.adapters import probes
from specfree.adapters.hf import HFAdapter
from tests.test_lossless import prompts, strategy_specs
from tests.tiny_models import CHAIN_FAMILIES, Oracle, reference_greedy, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
STRATEGIES = ["autoregressive", "prompt_lookup", "lookahead", "trie", "recycling", "hybrid", "retrieval"]
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def quiet(quiet_families):
    yield


@functools.cache
def self_repeating_prompt(family: str) -> list[int]:
    """A prompt followed by the model's own continuation: copied drafts are accepted, then cut."""
    start = [5, 9, 11, 7]
    return start + reference_greedy(tiny_model(family), start, 24, ignore_eos=True)


@pytest.mark.parametrize("family", CHAIN_FAMILIES)
def test_the_probes_choose_chains_and_describe_says_why(family):
    adapter = HFAdapter(tiny_model(family))
    caps = adapter.capabilities
    assert caps.chain_only and caps.verification in (probes.CHAIN_OWN_MASK, probes.CHAIN_CUSTOM_MASK)
    text = adapter.describe()
    assert text.startswith(f"{adapter.model.config.model_type}: verifies {probes.MODES[caps.verification]}")
    # why not a tree: the tree probe's finding, or the model keeps no KV cache at all
    assert ("no draft trees: it " in text) != ("keeps no KV cache" in text)
    assert caps.chain_mask == (caps.verification == probes.CHAIN_CUSTOM_MASK)


def test_both_chain_modes_are_covered():
    """Some of these families take a custom mask (but not a tree), some reject or ignore it."""
    modes = {HFAdapter(tiny_model(family)).capabilities.verification for family in CHAIN_FAMILIES}
    assert modes == {probes.CHAIN_OWN_MASK, probes.CHAIN_CUSTOM_MASK}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", CHAIN_FAMILIES)
def test_every_strategy_reproduces_generate(family, strategy, datastore):
    knobs = {"datastore": datastore} if strategy == "retrieval" else {}
    if strategy == "hybrid":
        knobs["drafters"] = ["prompt_lookup", "trie", "recycling"]
    prompt = self_repeating_prompt(family)
    result = Engine.from_model(tiny_model(family), None, strategy, **knobs).generate(prompt, 16, ignore_eos=True)
    assert result.tokens == reference_greedy(tiny_model(family), prompt, 16, ignore_eos=True)
    assert all(s.rows == s.drafted + 1 for s in result.steps)  # one chain: no aux rows, no siblings


@pytest.mark.parametrize("family", CHAIN_FAMILIES)
def test_kept_and_cut_chains(family):
    model = tiny_model(family)
    prompt = [5, 9, 11, 7]
    truth = prompt + reference_greedy(model, prompt, 24, ignore_eos=True)
    oracle = Oracle(truth, depth=4, wrong_at=2)  # draft mechanics: unpriced, so every chain is verified as drafted
    result = Engine.from_model(model, None, oracle, priced=False).generate(prompt, 24, ignore_eos=True)
    assert result.tokens == truth[len(prompt) :]
    cut = [s for s in result.steps if s.accepted < s.drafted]
    assert [s.accepted for s in cut] == [2] * len(cut) and len(cut) >= 2
    assert any(s.accepted == s.drafted == 4 for s in result.steps)


@SETTINGS
@given(family=st.sampled_from(CHAIN_FAMILIES), prompt=prompts(), spec=strategy_specs(), max_new=st.integers(1, 24))
def test_greedy_equals_generate_property(family, prompt, spec, max_new):
    model = tiny_model(family)
    name, knobs = spec
    result = Engine.from_model(model, None, name, **knobs).generate(prompt, max_new_tokens=max_new)
    assert result.tokens == reference_greedy(model, prompt, max_new)


@SETTINGS
@given(family=st.sampled_from(CHAIN_FAMILIES), prompt=prompts(), spec=strategy_specs(),
       seed=st.integers(0, 2**31), temperature=st.floats(0.3, 1.5), top_k=st.integers(0, 50),
       top_p=st.floats(0.5, 1.0))
def test_seeded_sampling_equals_autoregressive_sampling_property(family, prompt, spec, seed, temperature, top_k,
                                                                 top_p):
    model = tiny_model(family)
    sampling = dict(do_sample=True, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p)
    name, knobs = spec
    speculative = Engine.from_model(model, None, name, **knobs, **sampling).generate(prompt, 20)
    plain = Engine.from_model(model, None, "autoregressive", **sampling).generate(prompt, 20)
    assert speculative.tokens == plain.tokens


def test_decode_says_when_a_model_verifies_chains(tmp_path, monkeypatch, capsys):
    from specfree import cli

    folder = tmp_path / "bloom"
    tiny_model("bloom").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.chdir(tmp_path)  # Hydra's run folders
    capsys.readouterr()  # saving printed a progress bar
    code = cli.main(["decode", "model=local", f"model.path={folder}", "prompt=the cat and the dog",
                     "max_new_tokens=6", f"output={tmp_path / 'r.json'}"])
    assert code == 0
    err = capsys.readouterr().err.splitlines()
    result = json.loads((tmp_path / "r.json").read_text())
    assert err[0] == result["verification"] == HFAdapter(tiny_model("bloom")).capabilities.describe()
    assert "bloom: verifies one chain a step" in err[0]


class CacheBlindLlama(transformers.LlamaForCausalLM):
    """Takes a cache argument but drops it: causal, yet no cached forward continues the prefix."""

    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return super().forward(input_ids=input_ids, **kwargs)


def test_a_model_that_fails_trees_and_chains_is_refused_with_both_reasons():
    from specfree import UnsupportedModelError
    from tests.tiny_models import CONFIGS

    model = CacheBlindLlama(CONFIGS["llama"]()).eval()
    with pytest.raises(UnsupportedModelError, match=r"^model family 'llama' .*, and its chains fail too: model "
                                                    r"family 'llama' does not keep its state in the cache"):
        HFAdapter(model)
