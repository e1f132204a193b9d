"""Fuzzing the engine: any built-in strategy with random valid knobs, on any tiny family, with
prompts full of what breaks drafters (long runs of one token, special tokens, EOS inside the
prompt), must never raise and must give exactly plain greedy decoding, stopping where it does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.pools import SuffixArrayPool
from tests.tiny_models import (
    BOS,
    EOS,
    FAMILIES,
    PAD,
    VOCAB,
    reference_greedy,
    tiny_model,
)

SPECIAL = (PAD, BOS, EOS, 3)  # 3 is the tiny tokenizer's <unk>
FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def datastore(tmp_path_factory) -> str:
    """A small retrieval datastore whose documents hold runs, special tokens and EOS too."""
    rng = np.random.default_rng(0)
    docs = [np.arange(3, VOCAB), np.array([5, 6, 7] * 12), np.array([EOS, EOS, BOS, PAD, EOS, 9, 9, 9, EOS]),
            rng.integers(0, VOCAB, 200), np.array([11] * 30 + [EOS] + [12, 13] * 10)]
    path = tmp_path_factory.mktemp("fuzz") / "store.sfds"
    SuffixArrayPool.build(docs).save(path)
    return str(path)


# ---- prompts ------------------------------------------------------------------------------
TOKEN = st.integers(0, VOCAB - 1)
PIECES = st.one_of(
    st.tuples(TOKEN, st.integers(1, 12)).map(lambda run: [run[0]] * run[1]),  # one token repeated
    st.sampled_from(SPECIAL).map(lambda t: [t]),  # EOS, BOS, PAD, <unk> anywhere in the prompt
    st.lists(TOKEN, min_size=1, max_size=6),  # noise
    st.tuples(st.lists(TOKEN, min_size=1, max_size=5), st.integers(2, 4)).map(lambda p: p[0] * p[1]),  # a repeat
)


@st.composite
def prompts(draw) -> list[int]:
    return [t for piece in draw(st.lists(PIECES, min_size=1, max_size=5)) for t in piece][:48]


# ---- strategies and their knobs -----------------------------------------------------------
@st.composite
def prompt_lookup_knobs(draw) -> dict:
    max_ngram = draw(st.integers(1, 4))
    return {"max_ngram": max_ngram, "min_ngram": draw(st.integers(1, max_ngram)),
            "draft_len": draw(st.integers(1, 12)), "num_candidates": draw(st.integers(1, 4)),
            "match": draw(st.sampled_from(["recent", "longest", "frequent"])),
            "pool": draw(st.sampled_from([None, "suffix_array"]))}  # suffix_array: an index of the prompt


@st.composite
def lookahead_knobs(draw) -> dict:
    knobs = {"window": draw(st.integers(1, 5)), "ngram": draw(st.integers(2, 5)),
             "guesses": draw(st.one_of(st.integers(1, 6), st.none())),
             "init": draw(st.sampled_from(["random", "recent"])), "init_seed": draw(st.integers(0, 9)),
             "pool_from_prompt": draw(st.booleans()), "add_output": draw(st.booleans()),
             "idle_every": draw(st.integers(0, 3)), "pool_capacity": draw(st.one_of(st.integers(1, 500), st.none()))}
    if knobs["idle_every"] == 0 and not (knobs["pool_from_prompt"] or knobs["add_output"]):
        knobs["idle_every"] = 1  # otherwise refused: the window would never run
    # No pool (its own LRU), or one from the pool group's nodes, by name or with knobs.
    knobs["pool"] = draw(st.sampled_from([None, "trie", "lru"]) | st.builds(
        lambda nodes, depth, query: {"name": "trie", "max_nodes": nodes, "branch_length": depth,
                                     "max_query_length": query},
        st.integers(1, 500), st.integers(1, 6), st.integers(1, 4)) | st.builds(
        lambda ngram, per_key: {"name": "lru", "ngram": ngram, "max_per_key": per_key},
        st.integers(knobs["ngram"], 6), st.one_of(st.integers(1, 4), st.none())))
    if knobs["pool"] == "lru" and knobs["ngram"] > 4:
        knobs["pool"] = {"name": "lru", "ngram": knobs["ngram"]}  # the group's lru keeps 4-grams
    return knobs


@st.composite
def trie_knobs(draw) -> dict:
    return {"decoding_length": draw(st.integers(1, 24)), "branch_length": draw(st.integers(1, 10)),
            "max_query_length": draw(st.integers(1, 6)), "max_nodes": draw(st.integers(1, 400)),
            "decay": draw(st.floats(0.01, 0.99)), "persist": draw(st.booleans())}  # decay: open (0, 1)


@st.composite
def recycling_knobs(draw) -> dict:
    successors = draw(st.integers(1, 6))
    return {"successors": successors, "widths": draw(st.lists(st.integers(1, successors), min_size=1, max_size=5))}


@st.composite
def retrieval_knobs(draw) -> dict:
    max_query_length = draw(st.integers(1, 8))
    return {"max_nodes": draw(st.integers(1, 16)), "max_depth": draw(st.integers(1, 8)),
            "max_query_length": max_query_length, "min_query_length": draw(st.integers(1, max_query_length))}


@st.composite
def sam_knobs(draw) -> dict:
    return {"draft_len": draw(st.integers(1, 12)), "threshold": draw(st.integers(1, 6)), "bias": draw(st.integers(0, 4)),
            "fallback": draw(st.sampled_from([None, "recycling", "prompt_lookup", "lookahead"]))}


@st.composite
def logit_spec_knobs(draw) -> dict:
    return {"max_ngram_size": draw(st.integers(1, 4)), "num_pred_tokens": draw(st.integers(1, 24)),
            "draft_tree_capacity": draw(st.integers(1, 64))}


@st.composite
def suffix_knobs(draw) -> dict:
    return {"max_tree_depth": draw(st.integers(1, 24)), "max_cached_requests": draw(st.integers(0, 4)),
            "max_spec_factor": draw(st.floats(0.0, 4.0)), "max_spec_offset": draw(st.floats(-2.0, 4.0)),
            "min_token_prob": draw(st.floats(0.0, 1.0)), "max_nodes": draw(st.integers(1, 400)),
            "live_outputs": draw(st.booleans())}


@st.composite
def hybrid_knobs(draw) -> dict:
    """Members by name (the hybrid's tuned knobs) or with knobs of their own, repeats allowed."""
    member_knobs = {"prompt_lookup": prompt_lookup_knobs(), "trie": trie_knobs(), "recycling": recycling_knobs(),
                    "retrieval": retrieval_knobs(), "lookahead": lookahead_knobs(), "sam": sam_knobs(),
                    "logit_spec": logit_spec_knobs(), "suffix": suffix_knobs()}
    name = st.sampled_from(sorted(member_knobs))
    member = name | name.flatmap(lambda n: member_knobs[n].map(lambda knobs: {"name": n, **knobs}))
    return {"drafters": draw(st.lists(member, min_size=1, max_size=4)), "max_rows": draw(st.integers(1, 40))}


KNOBS = {
    "autoregressive": st.just({}),
    "prompt_lookup": prompt_lookup_knobs(),
    "lookahead": lookahead_knobs(),
    "trie": trie_knobs(),
    "recycling": recycling_knobs(),
    "hybrid": hybrid_knobs(),
    "retrieval": retrieval_knobs(),
    "sam": sam_knobs(),
    "logit_spec": logit_spec_knobs(),
    "suffix": suffix_knobs(),
}
NEEDS_DATASTORE = ("retrieval", "hybrid", "sam")


def strategy_specs() -> st.SearchStrategy[tuple[str, dict]]:
    return st.sampled_from(sorted(KNOBS)).flatmap(lambda name: KNOBS[name].map(lambda knobs: (name, knobs)))


def test_the_fuzzer_covers_every_built_in_strategy():
    from specfree.plugins import build_plugin_manager, registry

    assert set(KNOBS) == set(registry(build_plugin_manager()).names("strategy"))


REQUESTS = st.lists(st.tuples(prompts(), st.integers(1, 30), st.booleans()), min_size=1, max_size=2)


@FUZZ
@given(family=st.sampled_from(FAMILIES), spec=strategy_specs(), requests=REQUESTS)
def test_any_strategy_on_any_prompt_is_plain_greedy(datastore, family, spec, requests):
    model = tiny_model(family)
    name, knobs = spec
    if name in NEEDS_DATASTORE:
        knobs = {**knobs, "datastore": datastore}
    engine = Engine.from_model(model, None, name, **knobs)
    for prompt, max_new, ignore_eos in requests:  # a second request meets the pools the first one filled
        result = engine.generate(prompt, max_new, ignore_eos=ignore_eos)
        tokens = result.tokens
        assert tokens == reference_greedy(model, prompt, max_new, ignore_eos=ignore_eos)
        if not ignore_eos:
            assert EOS not in tokens[:-1]  # stops at the first EOS it emits, EOS in the prompt or not
        assert 1 <= len(tokens) <= max_new
        ended_on_eos = not ignore_eos and tokens[-1] == EOS
        assert result.stop_reason == ("eos" if ended_on_eos else "max_new_tokens")
        assert len(tokens) == max_new or ended_on_eos
        assert sum(s.emitted for s in result.steps) == len(tokens) == len(result.drafted_mask)
