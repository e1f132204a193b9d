"""Several requests in one forward: each one's output is bit-identical to decoding it alone.

The checks compare each request's tokens and its log-probabilities with the same request decoded
alone. A log-probability is the log-softmax of the verify row that predicted the token, so equal
floats say the rows themselves were bit-equal, not only their argmax.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.batching import Batch
from specfree.cost import CostModel
from specfree.errors import ConfigError
from specfree.kernels.tree_attention import LONG_ROWS
from tests.test_lossless import drafter_specs, prompts
from tests.tiny_models import VOCAB, reference_greedy, tiny_model

SETTINGS = settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Families whose rows are exact (their engines batch): plain, GQA, learned positions, parallel
# attention, per-kind sliding windows (cohere_compass_text's 16-token window is exceeded here).
BATCHED = ["llama", "qwen2", "gpt2", "gpt_neox", "phi3", "opt", "llama_gguf", "cohere_compass_text"]
CPU_LIKE = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4])


def drive(batch: Batch, requests: list[dict], arrivals: list[int]) -> dict[int, object]:
    """Run ``requests`` through ``batch``, request i joining at step ``arrivals[i]`` or once there is
    room after it; returns each request's Generation (or its error) by index."""
    waiting = sorted(range(len(requests)), key=lambda i: arrivals[i])
    index_of, out, step = {}, {}, 0
    while waiting or batch.members:
        while waiting and batch.room and arrivals[waiting[0]] <= step:
            i = waiting.pop(0)
            index_of[batch.add(batch.engine.request(**requests[i]))] = i
        for event in batch.step():
            if event.result is not None:
                out[index_of[event.member]] = event.result
            elif event.error is not None:
                out[index_of[event.member]] = event.error
        step += 1
        assert step < 10_000
    return out


@SETTINGS
@given(family=st.sampled_from(BATCHED), spec=drafter_specs(), priced=st.booleans(),
       prompt_list=st.lists(prompts(), min_size=1, max_size=5), max_batch=st.integers(1, 4),
       data=st.data())
def test_each_request_of_a_batch_is_its_own_greedy_decoding(family, spec, priced, prompt_list, max_batch, data):
    model = tiny_model(family)
    name, knobs = spec
    engine = Engine.from_model(model, None, name, priced=priced, costs=CPU_LIKE, **knobs)
    assert engine.batch_off is None
    n = len(prompt_list)
    max_new = data.draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    arrivals = data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    requests = [dict(prompt=p, max_new_tokens=m, logprobs=1) for p, m in zip(prompt_list, max_new)]
    batch = Batch(engine, max_batch)
    results = drive(batch, requests, arrivals)
    assert not batch.members
    if max_batch > 1:  # every request's KV left with it (a batch of one runs the adapter's own lane: its KV stays, as after any call)
        assert batch.kv.entries == 0
    for i, request in enumerate(requests):
        alone = engine.generate(request["prompt"], request["max_new_tokens"], logprobs=1)
        assert results[i].tokens == alone.tokens == reference_greedy(model, request["prompt"],
                                                                       request["max_new_tokens"])
        assert results[i].logprobs == alone.logprobs  # the verify rows' bits, not only their argmax
        assert results[i].stop_reason == alone.stop_reason


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llama", "gpt2", "cohere_compass_text"]), spec=drafter_specs(),
       prompt_list=st.lists(prompts(), min_size=2, max_size=4), seeds=st.lists(st.integers(0, 2**31), min_size=4,
                                                                                max_size=4),
       temperature=st.floats(0.3, 1.5), top_k=st.integers(0, 50))
def test_seeded_sampling_in_a_batch_is_each_requests_own(family, spec, prompt_list, seeds, temperature, top_k):
    name, knobs = spec
    engine = Engine.from_model(tiny_model(family), None, name, costs=CPU_LIKE, do_sample=True, temperature=temperature,
                               top_k=top_k, **knobs)
    requests = [dict(prompt=p, max_new_tokens=20, seed=s) for p, s in zip(prompt_list, seeds)]
    results = drive(Batch(engine, 3), requests, [0] * len(requests))
    plain = Engine.from_model(tiny_model(family), None, "autoregressive", do_sample=True, temperature=temperature,
                              top_k=top_k)
    for i, request in enumerate(requests):
        assert results[i].tokens == plain.generate(request["prompt"], 20, seed=request["seed"]).tokens


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode():
    """A 400-token prompt (three chunks) joins two running requests: each step runs one chunk of it
    and a step of theirs, and it decodes as it does alone with the prompt cache's chunked prefill."""
    model = tiny_model("llama")
    engine = Engine.from_model(model, None, "prompt_lookup", costs=CPU_LIKE)
    long = [(7 * i) % (VOCAB - 3) + 3 for i in range(400)]
    batch = Batch(engine, 3)
    running = [batch.add(engine.request([5, 6, 7, 8] * 3, 40, ignore_eos=True)),
               batch.add(engine.request([9, 10, 11] * 4, 40, ignore_eos=True))]
    batch.step()
    newcomer = batch.add(engine.request(long, 20, logprobs=0))
    for chunk in range(3):
        events = batch.step()
        assert newcomer.prefilled == min(160 * (chunk + 1), len(long) - 1)
        assert {e.member for e in events if e.chunk is not None} >= set(running)  # not stalled
    results = {}
    while batch.members:
        results.update({e.member: e.result for e in batch.step() if e.result is not None})
    chunked = Engine.from_model(model, None, "prompt_lookup", prompt_cache=True)
    assert results[newcomer].logprobs == chunked.generate(long, 20, logprobs=0).logprobs
    for member, prompt in zip(running, ([5, 6, 7, 8] * 3, [9, 10, 11] * 4)):
        assert results[member].tokens == reference_greedy(model, prompt, 40, ignore_eos=True)


class Explodes:
    """A logits processor that fails on its first call (a bad processor in one request)."""

    def __call__(self, input_ids, scores):
        raise ValueError("this processor is broken")


def test_a_request_that_fails_ends_alone():
    model = tiny_model("qwen2")
    engine = Engine.from_model(model, None, "prompt_lookup", costs=CPU_LIKE)
    broken = Engine.from_model(model, None, "autoregressive", logits_processors=[Explodes()]).verifier
    requests = [dict(prompt=[5, 6, 7] * 4, max_new_tokens=16, ignore_eos=True),
                dict(prompt=[8, 9] * 5, max_new_tokens=16, verifier=broken),
                dict(prompt=[10, 11, 12] * 3, max_new_tokens=16, ignore_eos=True)]
    batch = Batch(engine, 3)
    results = drive(batch, requests, [0, 0, 0])
    assert isinstance(results[1], ValueError)
    for i in (0, 2):
        assert results[i].tokens == reference_greedy(model, requests[i]["prompt"], 16, ignore_eos=True)
    assert batch.kv.entries == 0


def test_a_held_prompt_is_adopted_by_the_next_request_that_starts_with_it():
    """With ``hold_prompts`` a finished request's KV waits for the next turn of its chat: the next
    request reuses it (``cached_tokens``) and decodes what it decodes alone."""
    model = tiny_model("llama")
    engine = Engine.from_model(model, None, "autoregressive")
    batch = Batch(engine, 2, hold_prompts=True)
    first = [5, 6, 7, 8, 9, 10]
    done = drive(batch, [dict(prompt=first, max_new_tokens=12, ignore_eos=True, logprobs=0)], [0])[0]
    assert batch.kv.entries > 0  # held
    second = first + done.tokens + [11, 12, 13]
    again = drive(batch, [dict(prompt=second, max_new_tokens=12, ignore_eos=True, logprobs=0)], [0])[0]
    assert again.cached_tokens == len(first) + len(done.tokens) - 1
    assert again.logprobs == engine.generate(second, 12, ignore_eos=True, logprobs=0).logprobs
    batch.close()  # the lone generate above dropped what the batch held (its KV stays, as after any call)
    assert not batch.members and not batch.kv.held


def test_generate_batch_returns_one_generation_per_prompt_in_order():
    model = tiny_model("gpt2")
    engine = Engine.from_model(model, None, "hybrid", costs=CPU_LIKE)
    prompt_list = [[5, 6, 7] * 3, [9, 8] * 4, [20, 21, 22, 23], [30] * 5, [40, 41] * 2]
    results = engine.generate_batch(prompt_list, 16, max_batch=2, ignore_eos=True)
    assert [r.tokens for r in results] == [reference_greedy(model, p, 16, ignore_eos=True) for p in prompt_list]


def test_an_engine_that_cannot_batch_says_why_and_decodes_one_at_a_time():
    model = tiny_model("mixtral")  # experts route the rows of a forward together
    engine = Engine.from_model(model, None, "prompt_lookup")
    assert "bit-equal" in engine.batch_off
    with pytest.warns(UserWarning, match="one request at a time"):
        results = engine.generate_batch([[5, 6, 7] * 3, [9, 8] * 4], 8, ignore_eos=True)
    assert [r.tokens for r in results] == [reference_greedy(model, p, 8, ignore_eos=True)
                                           for p in ([5, 6, 7] * 3, [9, 8] * 4)]
    with pytest.raises(ConfigError, match="cannot decode requests together"):
        Batch(engine)


def test_bad_batch_arguments_are_one_clear_error():
    engine = Engine.from_model(tiny_model("llama"), None, "autoregressive")
    with pytest.raises(ConfigError, match="list of prompts"):
        engine.generate_batch("one prompt")
    with pytest.raises(ConfigError, match="max_batch"):
        engine.generate_batch([[5, 6]], max_batch=0)
    batch = Batch(engine, 1)
    batch.add(engine.request([5, 6, 7]))
    with pytest.raises(ConfigError, match="full"):
        batch.add(engine.request([5, 6, 7]))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        engine.request([5, 6], max_new_tokens=0)
    batch.close()
    assert batch.kv.entries == 0


def test_the_suffix_drafters_of_a_batch_share_one_store():
    """Each place of a batch forks the engine's drafter; the suffix drafter's forks share its global
    store, so every request's output lands in the one tree (and each drafts from the others')."""
    model = tiny_model("llama")
    engine = Engine.from_model(model, None, "hybrid", drafters=["prompt_lookup", "suffix"], costs=CPU_LIKE)
    prompt_list = [[5, 6, 7, 8] * 3, [9, 10] * 5, [11, 12, 13] * 2]
    results = engine.generate_batch(prompt_list, 12, max_batch=3, ignore_eos=True)
    store = next(d for d in engine.strategy.drafters if d.name == "suffix").pool
    assert len(store.requests) == 3
    assert [r.tokens for r in results] == [reference_greedy(model, p, 12, ignore_eos=True) for p in prompt_list]


def test_a_batch_teaches_the_engines_cost_curve_nothing(tmp_path):
    """The curve prices one request's rows; a batch's forward attends over several contexts, so its
    times are not folded in (they once taught a curve that 3 rows cost 8 times 2)."""
    engine = Engine.from_model(tiny_model("llama"), None, "prompt_lookup", cache_dir=str(tmp_path))
    before = engine.costs.as_dict()
    prompt_list = [[5, 6, 7, 8] * 3, [9, 10] * 5, [11, 12, 13] * 2, [14, 15] * 3] * 2
    engine.generate_batch(prompt_list, 24, max_batch=4, ignore_eos=True)
    assert engine.costs.as_dict() == before


def test_a_step_asking_more_rows_than_stay_exact_is_cut_to_them():
    """Recycling at widths 4, 4, 4, 4, unpriced, asks for more than 160 rows a step; past ``LONG_ROWS`` the
    attention operator's rows are no longer each its own, so the planner cuts every step to the
    adapter's ``exact_rows``: the logits of each kept row (their logprobs) equal a batch's and the
    plain loop's bit for bit (found by the property test above, logprobs 1e-6 apart before the cut)."""
    model = tiny_model("llama")
    engine = Engine.from_model(model, None, "recycling", priced=False, costs=CPU_LIKE, successors=4,
                               widths=[4, 4, 4, 4])
    request = dict(prompt=[3], max_new_tokens=12, logprobs=1)
    for _ in range(2):  # the second time its successors are known: wide trees
        alone = engine.generate(request["prompt"], 12, logprobs=1)
    assert max(step.offered for step in alone.steps) > LONG_ROWS  # asked
    assert max(step.rows for step in alone.steps) == engine.adapter.exact_rows == LONG_ROWS  # ran
    batched = drive(Batch(engine, 1), [request], [0])[0]
    plain = Engine.from_model(model, None, "autoregressive").generate([3], 12, logprobs=1)
    assert batched.logprobs == alone.logprobs == plain.logprobs
