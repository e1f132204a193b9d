"""The product: every strategy reproduces plain decoding token for token."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.cost import CostModel
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
    name, knobs = draw(drafter_specs())
    return name, {**knobs, "priced": draw(st.booleans())}  # pricing never changes a token


@st.composite
def drafter_specs(draw) -> tuple[str, dict]:
    name = draw(st.sampled_from(["autoregressive", "prompt_lookup", "recycling", "hybrid", "lookahead", "trie"]))
    if name == "autoregressive":
        return name, {}
    if name == "lookahead":
        return name, dict(window=draw(st.integers(1, 4)), ngram=draw(st.integers(2, 4)),
                          idle_every=draw(st.integers(0, 2)))
    if name == "trie":
        return name, dict(decoding_length=draw(st.integers(1, 24)), branch_length=draw(st.integers(1, 8)))
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


@functools.cache
def bf16_model(family: str):
    """A bf16 copy of a tiny family (its own: ``tiny_model`` is shared by every test)."""
    return copy.deepcopy(tiny_model(family)).to(torch.bfloat16)


@SETTINGS
@given(family=st.sampled_from(["llama", "gpt2", "qwen3"]), prompt=prompts(), spec=strategy_specs(),
       max_new=st.integers(1, 30), seed=st.integers(0, 2**31))
def test_a_bf16_model_speculates_its_own_one_row_decoding(family, prompt, spec, max_new, seed):
    """bf16 on the CPU: tree attention and batch-invariant linears (AMX tiles where the CPU has them),
    so every strategy gives the tokens of the same model's one-row loop, greedy and seeded sampling."""
    model = bf16_model(family)
    name, knobs = spec
    for sampling in ({}, dict(do_sample=True, seed=seed, temperature=0.9, top_k=20)):
        speculative = Engine.from_model(model, None, name, **knobs, **sampling).generate(prompt, max_new)
        plain = Engine.from_model(model, None, "autoregressive", **sampling).generate(prompt, max_new)
        assert speculative.tokens == plain.tokens


STRATEGIES = ["autoregressive", "prompt_lookup", "lookahead", "trie", "retrieval", "recycling", "hybrid", "sam", "logit_spec", "suffix"]
# Two rows cost 20% more than one, sixteen twice as much: pricing cuts trees down, not to nothing.
CPU_LIKE = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4])


# llama_gguf: its weights those of a quantized file, which specfree holds as codes
@pytest.mark.parametrize("family", ["llama", "llama_gguf"])
@pytest.mark.parametrize("priced", [True, False], ids=["priced", "unpriced"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_priced_and_unpriced_is_plain_decoding(strategy, priced, family, datastore):
    """Greedy equals transformers' generate and seeded sampling equals plain sampling, at the
    strategy's own knobs or priced on a CPU-like curve."""
    model = tiny_model(family)
    knobs = {"datastore": datastore} if strategy == "retrieval" else {}
    if strategy == "logit_spec":
        knobs = {"draft_tree_capacity": 16}  # 64 drafted rows (its paper's) make a slow test on the CPU
    prompt = [5, 6, 7, 8, 9] * 3 + [5, 6]
    greedy = Engine.from_model(model, None, strategy, priced=priced, costs=CPU_LIKE, **knobs)
    for _ in range(2):  # the second request meets what pools and statistics learned in the first
        result = greedy.generate(prompt, 24, ignore_eos=True)
        assert result.tokens == reference_greedy(model, prompt, 24, ignore_eos=True)
        assert all(s.rows <= s.offered for s in result.steps)
        cap = 32 if strategy == "hybrid" else 1 << 30  # the hybrid's max_rows caps even its unpriced steps
        assert priced or all(s.rows == min(s.offered, cap) for s in result.steps)
    sampling = dict(do_sample=True, seed=3, temperature=0.9, top_k=30)
    sampled = Engine.from_model(model, None, strategy, priced=priced, costs=CPU_LIKE, **knobs, **sampling)
    plain = Engine.from_model(model, None, "autoregressive", **sampling)
    assert sampled.generate(prompt, 24).tokens == plain.generate(prompt, 24).tokens


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
    lookup = Engine.from_model(model, None, "prompt_lookup", draft_len=8, priced=False).generate(
        prompt, 30, ignore_eos=True)
    assert lookup.tokens == again.tokens
    assert lookup.forwards < len(lookup.tokens)
