"""``Engine(prompt_cache=True)``: a call reuses the KV of the longest common prefix with the last
call's tokens and prefills only the rest, and its answer is a fresh engine's bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from specfree import Engine
from specfree.adapters.compiled import compiled_adapter
from specfree.batching import EXACT_CHUNK
from specfree.plugins import build_plugin_manager, registry
from tests.tiny_models import VOCAB, reference_greedy, tiny_model
from tests.test_lossless import CPU_LIKE

REG = registry(build_plugin_manager())


def conversation(seed: int, turns: int, first: int = 40) -> list[list[int]]:
    """Prompts that each extend the last one's prompt (the answer is added by the caller) with new ids."""
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(first if t == 0 else rng.randrange(3, 30))] for t in range(turns)]


def engine(model=None, strategy: str = "hybrid", **knobs) -> Engine:
    return Engine.from_model(model or tiny_model("llama"), None, strategy, costs=CPU_LIKE, prompt_cache=True, **knobs)


def test_prefill_chunks_give_each_row_the_one_row_forwards_bits():
    """The property reuse rests on: a row's KV is the same whether a chunk of a prefill or a step of one row made it."""
    ids = torch.tensor(conversation(1, 1, 2 * EXACT_CHUNK + 7)[0])
    adapter = engine().adapter
    held = []
    for rows in (EXACT_CHUNK, 1):
        adapter.reset()
        for at in range(0, len(ids), rows):
            if rows == 1 and at >= 20:
                adapter.forward(ids[at : at + 1])
                adapter.commit([0], 1)
            else:
                adapter.prefill(ids[at : at + rows] if rows > 1 else ids[at : at + 1])
        held.append([(layer.keys.clone(), layer.values.clone()) for layer in adapter.store.cache.layers])
    for (k1, v1), (k2, v2) in zip(*held, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("strategy, sampling", [("hybrid", {}), ("autoregressive", {}),
                                                ("hybrid", {"do_sample": True, "temperature": 0.9, "top_k": 20})])
def test_a_conversation_reuses_its_prefix_and_answers_as_a_fresh_engine(strategy, sampling):
    cached, fresh = engine(strategy=strategy, **sampling), engine(strategy=strategy, **sampling)
    context: list[int] = []
    for turn, new in enumerate(conversation(7, 6, first=EXACT_CHUNK + 30)):  # the first prompt spans two chunks
        before = list(context)
        context += new
        fresh.forget()
        want = fresh.generate(context, 24, ignore_eos=True, seed=turn)
        got = cached.generate(context, 24, ignore_eos=True, seed=turn)
        assert got.tokens == want.tokens
        if not sampling:
            assert got.tokens == reference_greedy(cached.adapter.model, context, 24, ignore_eos=True)
        assert want.cached_tokens == 0
        if turn == 0:
            assert got.cached_tokens == 0
        else:  # the whole last prompt and all of its answer whose KV was kept: only the new ids are prefilled
            assert got.cached_tokens == len(before) - 1
            assert got.prefilled_tokens == len(context) - 1 - got.cached_tokens
        context += got.tokens


def test_the_prefix_is_reused_where_prompts_diverge_and_cache_prompt_false_prefills_all():
    cached, fresh = engine(), engine()
    base = conversation(3, 1, 60)[0]
    cached.generate(base, 10)
    other = base[:25] + [5, 6, 7, 8]  # diverges at 25
    got = cached.generate(other, 12)
    assert got.cached_tokens == 25 and got.tokens == fresh.generate(other, 12).tokens
    again = cached.generate(other, 12, cache_prompt=False)
    assert again.cached_tokens == 0 and again.tokens == got.tokens
    same = cached.generate(other, 12)  # the same prompt again: all but its last id
    assert same.cached_tokens == len(other) - 1 and same.tokens == got.tokens
    cached.forget()
    assert cached.generate(other, 12).cached_tokens == 0


def test_engines_sharing_an_adapter_never_reuse_what_the_other_left():
    first = engine(strategy="prompt_lookup")
    second = Engine.from_model(first.adapter.model, None, "prompt_lookup", costs=CPU_LIKE, adapter=first.adapter,
                               prompt_cache=True)
    a, b = conversation(21, 1, 50)[0], conversation(22, 1, 80)[0]  # b longer: the KV it leaves could be cut to a's
    answer = first.generate(a, 8, ignore_eos=True)
    second.generate(b, 8, ignore_eos=True)  # the adapter now holds b
    follow = a + answer.tokens + [4, 5]
    again = first.generate(follow, 8, ignore_eos=True)
    assert again.cached_tokens == 0
    assert again.tokens == reference_greedy(first.adapter.model, follow, 8, ignore_eos=True)
    assert first.generate(follow + again.tokens, 4).cached_tokens == len(follow + again.tokens) - 1


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_a_recurrent_model_says_why_it_does_not_reuse(family):
    model = tiny_model(family)
    cached = Engine.from_model(model, None, "prompt_lookup", costs=CPU_LIKE, prompt_cache=True)
    assert cached.prompt_cache_off is not None and "cannot be cut back" in cached.prompt_cache_off
    prompt = conversation(5, 1, EXACT_CHUNK + 20)[0]  # one prefill call: a Mamba-1 mixer cannot take a second
    first = cached.generate(prompt, 8, ignore_eos=True)
    second = cached.generate(prompt + first.tokens + [9, 10], 8, ignore_eos=True)
    assert second.cached_tokens == 0
    assert second.tokens == reference_greedy(model, prompt + first.tokens + [9, 10], 8, ignore_eos=True)


def test_a_family_whose_rows_are_not_exact_does_not_reuse():
    """Mixtral runs the row-exact operator, but its experts take rows together: the probe sees it."""
    model = tiny_model("mixtral")
    cached = Engine.from_model(model, None, "prompt_lookup", costs=CPU_LIKE, prompt_cache=True)
    assert cached.adapter.capabilities.attention == "tree_attention"
    assert "probe" in cached.prompt_cache_off
    prompt = conversation(9, 1, 20)[0]
    first = cached.generate(prompt, 6, ignore_eos=True)
    assert cached.generate(prompt + first.tokens + [4], 6, ignore_eos=True).cached_tokens == 0


def test_a_compiled_adapter_reuses_only_its_eager_prefill():
    model = tiny_model("qwen2")
    adapter = compiled_adapter(model, backend="eager", min_slots=16, buckets=(1, 8))
    cached = Engine(adapter, REG.make("strategy", "prompt_lookup"), prompt_cache=True)
    assert cached.prompt_cache_off is None
    prompt = conversation(11, 1, 30)[0]
    first = cached.generate(prompt, 12, ignore_eos=True)
    follow = prompt + first.tokens + [7, 8, 9]
    second = cached.generate(follow, 12, ignore_eos=True)
    assert second.cached_tokens == len(prompt) - 1  # not the rows its compiled steps made
    assert second.tokens == reference_greedy(model, follow, 12, ignore_eos=True)


def test_the_config_key_reaches_the_engine(tiny_llama_dir):
    on = Engine.from_config({"model": {"name": "local", "path": str(tiny_llama_dir)}, "prompt_cache": True},
                            overrides=["strategy=autoregressive", "compile=false"])
    assert on.prompt_cache is True and on.prompt_cache_off is None
    off = Engine.from_config({"model": {"name": "local", "path": str(tiny_llama_dir)}},
                             overrides=["strategy=autoregressive", "compile=false"])
    assert off.prompt_cache is False
