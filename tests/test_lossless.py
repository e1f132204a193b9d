"""The product: every strategy reproduces plain decoding token for token."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import Engine
from tests.tiny_models import EOS, FAMILIES, VOCAB, reference_greedy, tiny_model

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def prompts(draw) -> list[int]:
    """Prompts that repeat themselves (so lookup drafts hit), with noise, avoiding EOS."""
    token = st.integers(3, VOCAB - 1)
    pattern = draw(st.lists(token, min_size=1, max_size=6))
    repeats = draw(st.integers(1, 4))
    noise = draw(st.lists(token, max_size=4))
    prompt = (pattern * repeats + noise)[:40]
    return prompt


@st.composite
def strategy_specs(draw) -> tuple[str, dict]:
    name = draw(st.sampled_from(["autoregressive", "prompt_lookup", "recycling", "hybrid"]))
    if name == "autoregressive":
        return name, {}
    if name == "recycling":
        successors = draw(st.integers(1, 6))
        return name, dict(successors=successors,
                          widths=draw(st.lists(st.integers(1, successors), min_size=1, max_size=5)))
    if name == "hybrid":
        drafters = draw(st.lists(st.sampled_from(["prompt_lookup", "trie", "recycling", "lookahead"]), min_size=1,
                                 max_size=4, unique=True))
        return name, dict(drafters=drafters, max_rows=draw(st.integers(1, 40)))
    max_ngram = draw(st.integers(1, 4))
    return name, dict(
        max_ngram=max_ngram,
        min_ngram=draw(st.integers(1, max_ngram)),
        draft_len=draw(st.integers(1, 12)),
        num_candidates=draw(st.integers(1, 4)),
        match=draw(st.sampled_from(["recent", "longest", "frequent"])),
    )


@SETTINGS
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), spec=strategy_specs(),
       max_new=st.integers(1, 40))
def test_greedy_equals_transformers_generate(family, prompt, spec, max_new):
    model = tiny_model(family)
    name, knobs = spec
    engine = Engine.from_model(model, None, name, **knobs)
    result = engine.generate(prompt, max_new_tokens=max_new)
    assert result.tokens == reference_greedy(model, prompt, max_new)
    assert sum(s.emitted for s in result.steps) == len(result.tokens)


@SETTINGS
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), spec=strategy_specs(),
       seed=st.integers(0, 2**31), temperature=st.floats(0.3, 1.5), top_k=st.integers(0, 50),
       top_p=st.floats(0.5, 1.0), repetition_penalty=st.floats(1.0, 1.5))
def test_seeded_sampling_equals_autoregressive_sampling(family, prompt, spec, seed, temperature, top_k, top_p,
                                                       repetition_penalty):
    model = tiny_model(family)
    sampling = dict(do_sample=True, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p,
                    repetition_penalty=repetition_penalty)
    name, knobs = spec
    speculative = Engine.from_model(model, None, name, **knobs, **sampling).generate(prompt, 30)
    plain = Engine.from_model(model, None, "autoregressive", **sampling).generate(prompt, 30)
    assert speculative.tokens == plain.tokens


def test_sampling_depends_on_seed_and_stops_at_eos():
    model = tiny_model("llama")
    runs = {tuple(Engine.from_model(model, None, "autoregressive", do_sample=True, seed=s)
                  .generate([5, 6, 7], 20, ignore_eos=True).tokens) for s in range(4)}
    assert len(runs) > 1  # different seeds really give different samples
    result = Engine.from_model(model, None, "prompt_lookup").generate([5, 6, 7] * 5, 200)
    if EOS in result.tokens:
        assert result.tokens[-1] == EOS and result.stop_reason == "eos"


def test_prompt_lookup_drafts_are_accepted_on_repetitive_text():
    """Guard against a lossless-but-useless drafter: on text the model repeats, fewer forwards than tokens."""
    model = tiny_model("llama")
    plain = Engine.from_model(model, None, "autoregressive").generate([5, 6, 7], 60, ignore_eos=True)
    # Feed the model's own continuation back as the prompt: prompt lookup can copy it.
    prompt = [5, 6, 7] + plain.tokens
    again = Engine.from_model(model, None, "autoregressive").generate(prompt, 30, ignore_eos=True)
    lookup = Engine.from_model(model, None, "prompt_lookup", draft_len=8).generate(prompt, 30, ignore_eos=True)
    assert lookup.tokens == again.tokens
    assert lookup.forwards < len(lookup.tokens)
