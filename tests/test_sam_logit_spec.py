"""SAM-Decoding and LogitSpec: their stores against brute force, their drafts lossless."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import ConfigError, Engine
from specfree.pools.suffix_array import SuffixArrayPool
from specfree.pools.suffix_automaton import SuffixAutomaton, SuffixAutomatonPool
from specfree.strategies.logit_spec import LogitSpec, NGramTable
from specfree.strategies.sam import SamDrafter
from tests.test_lossless import CPU_LIKE, prompts
from tests.tiny_models import FAMILIES, reference_greedy, tiny_model

FAST = settings(max_examples=60, deadline=None)
SETTINGS = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
texts = st.lists(st.integers(0, 3), max_size=60)  # a small alphabet: many repeats


def earlier_match(text: list[int]) -> tuple[int, int]:
    """(L, e): the longest suffix of ``text`` that also ends at an earlier index, and the end index
    of its first occurrence; (0, -1) when none."""
    n = len(text)
    for length in range(n - 1, 0, -1):
        for end in range(length - 1, n - 1):
            if text[end - length + 1 : end + 1] == text[n - length :]:
                return length, end
    return 0, -1


@FAST
@given(text=texts, cuts=st.lists(st.integers(1, 7), max_size=20))
def test_the_automaton_tracks_the_longest_earlier_match_and_its_first_occurrence(text, cuts):
    sam, done = SuffixAutomaton(), 0
    for cut in cuts + [len(text)]:  # extended in random chunks, as accepted tokens arrive
        sam.extend(text[done : done + cut])
        done = min(len(text), done + cut)
        length, end = earlier_match(text[:done])
        assert sam.match_length == length
        assert sam.first_end(sam.match_state) == end if length else sam.match_state == 0
    assert sam.states <= max(1, 2 * len(text))


@FAST
@given(text=st.lists(st.integers(0, 3), min_size=1, max_size=60), depth=st.integers(1, 12),
       climb=st.booleans())
def test_the_pool_drafts_what_followed_an_earlier_occurrence_of_a_suffix(text, depth, climb):
    pool = SuffixAutomatonPool(climb=climb)
    pool.begin_request(text[:5])
    tokens, length = pool.draft(text, depth)  # follows the context by itself
    longest, end = earlier_match(text)
    if not climb:
        assert length == longest
        assert tokens == (text[end + 1 : end + 1 + depth] if longest else [])
    assert length <= longest and (length > 0) == (longest > 0) == bool(tokens)
    if length:  # the continuation of the first earlier occurrence of the last `length` tokens
        n = len(text)
        first = next(e for e in range(length - 1, n - 1) if text[e - length + 1 : e + 1] == text[n - length :])
        assert tokens == text[first + 1 : first + 1 + depth]
    assert pool.lookup(text, depth, depth) == ([tokens] if tokens else [])


def test_the_pool_rebuilds_for_another_context_and_stays_bounded():
    pool = SuffixAutomatonPool(max_tokens=16)
    pool.begin_request([1, 2, 3, 1, 2])
    assert pool.draft([1, 2, 3, 1, 2], 4) == ([3, 1, 2], 2)
    assert pool.draft([7, 8, 7], 4) == ([8, 7], 1)  # not an extension: rebuilt
    long = [1, 2, 3, 4] * 20
    for n in range(1, len(long) + 1):
        pool.draft(long[:n], 4)
        assert len(pool.sam) <= 16
    assert pool.draft(long, 4)[0] == [1, 2, 3, 4]


@FAST
@given(docs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=4),
       context=st.lists(st.integers(0, 3), min_size=1, max_size=12), cap=st.integers(1, 12))
def test_the_datastore_answers_the_same_longest_match_query(docs, context, cap):
    store = SuffixArrayPool.build([np.array(d) for d in docs])
    length, start = store.longest_match(context, cap)
    text = store.text.tolist()  # documents joined by -1 separators
    def first(k):
        return next((s for s in range(len(text) - k + 1) if text[s : s + k] == context[len(context) - k :]), -1)
    best = max((k for k in range(1, min(cap, len(context)) + 1) if first(k) >= 0), default=0)
    assert (length, start) == (best, first(best) if best else -1)


@FAST
@given(text=st.lists(st.integers(0, 3), max_size=50), cuts=st.lists(st.integers(1, 9), max_size=8),
       tail=st.lists(st.integers(0, 3), min_size=1, max_size=4), n_max=st.integers(1, 4), pred=st.integers(1, 6))
def test_the_ngram_table_keeps_the_longest_latest_continuation(text, cuts, tail, n_max, pred):
    table, done = NGramTable(n_max, pred), 0
    table.reset(text[: cuts[0] if cuts else len(text)])
    done = len(table.text)
    for cut in cuts[1:] + [len(text)]:
        table.extend(text[done : done + cut])
        done = len(table.text)
    found, n = table.lookup(tail)
    for size in range(min(n_max, len(tail)), 0, -1):
        key = tail[len(tail) - size :]
        ends = [e for e in range(size, len(text)) if text[e - size : e] == key]
        if ends:
            best = max(ends, key=lambda e: (len(text[e : e + pred]), e))
            assert (found, n) == (text[best : best + pred], size)
            return
    assert (found, n) == ([], 0)


def test_sam_drafts_from_the_corpus_when_its_match_is_longer_by_more_than_the_bias():
    corpus = SuffixArrayPool.build([np.array([9, 1, 2, 3, 4, 5, 6, 7])])
    sam = SamDrafter(SuffixAutomatonPool(), corpus, None, draft_len=3, threshold=2, bias=1)
    prompt = np.array([1, 2, 3, 4, 8, 1, 2])
    sam.begin(prompt)
    proposal = sam.propose(prompt, 8)  # own text: [1 2] twice (length 2); corpus: [1 2] too
    assert proposal.candidates == [[3, 4, 8]] and proposal.labels == ["dyn2"]
    context = np.array([5, 6, 2, 3, 4, 5])  # corpus match [2 3 4 5] (4) beats the own text's [5] (1) + bias
    sam.begin(context)
    proposal = sam.propose(context, 8)
    assert proposal.candidates == [[6, 7]] and proposal.labels == ["static4"]


def test_logit_spec_drafts_the_lookup_and_each_guessed_next_next_token():
    spec = LogitSpec(max_ngram_size=2, num_pred_tokens=3, draft_tree_capacity=7, rank_bounds=[1], rank_lengths=[3, 1])
    prompt = np.array([1, 2, 3, 4, 2, 5, 6, 1, 2])
    spec.begin(prompt)
    spec._top, spec._top_for = [2, 5, 3, 7], len(prompt)  # the root's row: argmax 2 (the root), then 5, 3, 7
    proposal = spec.propose(prompt, 8)
    # lookup [1 2] -> [3 4 2]; guess 5 (rank 1): 5 + lookup [2 5] -> [5 6 1]; guess 3 (rank 2): [3]
    assert proposal.candidates == [[3, 4, 2], [5, 6, 1], [3]]
    assert proposal.labels == ["next:n2", "top1:n2", "top2:n2"]


@st.composite
def sam_or_logit_spec(draw) -> tuple[str, dict]:
    name = draw(st.sampled_from(["sam", "logit_spec", "hybrid"]))
    priced = draw(st.booleans())
    if name == "sam":
        return name, dict(draft_len=draw(st.integers(1, 12)), threshold=draw(st.integers(1, 5)),
                          bias=draw(st.integers(0, 4)), fallback=draw(st.sampled_from([None, "recycling", "lookahead"])),
                          priced=priced)
    if name == "logit_spec":
        return name, dict(max_ngram_size=draw(st.integers(1, 4)), num_pred_tokens=draw(st.integers(1, 8)),
                          draft_tree_capacity=draw(st.integers(1, 24)), priced=priced)
    drafters = draw(st.lists(st.sampled_from(["sam", "logit_spec", "recycling", "prompt_lookup", "lookahead"]),
                             min_size=1, max_size=3, unique=True))
    return name, dict(drafters=drafters, max_rows=draw(st.integers(1, 24)), priced=priced)


@SETTINGS
@given(family=st.sampled_from(FAMILIES), requests=st.lists(prompts(), min_size=1, max_size=2),
       spec=sam_or_logit_spec(), max_new=st.integers(1, 30))
def test_greedy_is_plain_greedy(family, requests, spec, max_new):
    model = tiny_model(family)
    name, knobs = spec
    engine = Engine.from_model(model, None, name, costs=CPU_LIKE, **knobs)
    for prompt in requests:
        assert engine.generate(prompt, max_new).tokens == reference_greedy(model, prompt, max_new)


@settings(SETTINGS, max_examples=4)
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), spec=sam_or_logit_spec(), seed=st.integers(0, 2**31),
       temperature=st.floats(0.3, 1.5), top_k=st.integers(0, 50))
def test_seeded_sampling_is_plain_seeded_sampling(family, prompt, spec, seed, temperature, top_k):
    model = tiny_model(family)
    sampling = dict(do_sample=True, seed=seed, temperature=temperature, top_k=top_k)
    name, knobs = spec
    speculative = Engine.from_model(model, None, name, costs=CPU_LIKE, **knobs, **sampling).generate(prompt, 20)
    assert speculative.tokens == Engine.from_model(model, None, "autoregressive", **sampling).generate(prompt, 20).tokens


@pytest.mark.parametrize("priced", [True, False], ids=["priced", "unpriced"])
def test_sam_with_a_datastore_is_lossless_and_drafts_on_repeated_text(priced, datastore):
    model = tiny_model("llama")
    plain = Engine.from_model(model, None, "autoregressive").generate([5, 6, 7], 40, ignore_eos=True)
    prompt = [5, 6, 7] + plain.tokens  # the model's own continuation: repeated as it decodes on
    again = reference_greedy(model, prompt, 30, ignore_eos=True)
    for name, knobs in [("sam", {"datastore": datastore}), ("logit_spec", {"datastore": datastore})]:
        result = Engine.from_model(model, None, name, priced=priced, costs=CPU_LIKE, **knobs).generate(
            prompt, 30, ignore_eos=True)
        assert result.tokens == again
        assert priced or result.forwards < len(result.tokens)  # drafts land: not lossless-but-useless


@pytest.mark.parametrize("knobs, message", [
    ({"fallback": "nope"}, r"^sam.fallback must be null or a strategy that holds no members: .*recycling.*; got 'nope'$"),
    ({"fallback": "hybrid"}, r"^sam.fallback must be null or a strategy that holds no members"),
    ({"fallback": "retrieval"}, r"^sam.fallback=retrieval: strategy=retrieval needs a datastore file"),
    ({"threshold": 0}, r"^sam.threshold must be >= 1, got 0$"),
    ({"pool": "trie"}, r"^sam drafts from a suffix automaton: use pool=suffix_automaton"),
    ({"datastore": "/no/such.sfds"}, r"^datastore file not found: /no/such.sfds"),
])
def test_sam_refuses_bad_knobs_in_one_line(knobs, message):
    with pytest.raises(ConfigError, match=message):
        Engine.from_model(tiny_model("llama"), None, "sam", **knobs)


def test_logit_spec_looks_up_the_datastore_where_the_text_has_no_ngram():
    spec = LogitSpec(max_ngram_size=2, num_pred_tokens=3, draft_tree_capacity=8)
    spec.corpus = SuffixArrayPool.build([np.array([7, 8, 9, 4, 5])])
    prompt = np.array([1, 2, 3, 7, 8])  # [7 8] / [8] occur only in the corpus
    spec.begin(prompt)
    assert spec.propose(prompt, 8).candidates == [[9, 4, 5]] and spec.propose(prompt, 8).labels == ["next:ds2"]


def test_logit_spec_refuses_a_rank_schedule_that_does_not_fit():
    with pytest.raises(ConfigError, match=r"^logit_spec.rank_lengths must hold one more length than rank_bounds"):
        Engine.from_model(tiny_model("llama"), None, "logit_spec", rank_bounds=[8, 32], rank_lengths=[4, 3])


def test_sam_composes_from_a_config_with_its_pool_and_fallback():
    from specfree.config import build_strategy, compose
    from specfree.plugins import build_plugin_manager, registry

    reg = registry(build_plugin_manager())
    cfg = compose(["strategy=sam", "strategy.fallback=prompt_lookup", "pool=suffix_automaton", "pool.max_tokens=99"],
                  reg)
    sam = build_strategy(cfg, reg)
    assert sam.pool.max_tokens == 99 and sam.fallback.name == "prompt_lookup"
    assert build_strategy(compose(["strategy=sam", "strategy.fallback=null"], reg), reg).fallback is None
