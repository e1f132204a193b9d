from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.pools import LRUNGramPool

from ._reference import NaiveLRU, check_contract

tokens = st.lists(st.integers(0, 5), max_size=30)
knobs = st.fixed_dictionaries({
    "key_len": st.integers(1, 3),
    "max_per_key": st.one_of(st.none(), st.integers(1, 4)),
    "max_keys": st.one_of(st.none(), st.integers(1, 6)),
    "ngram": st.integers(2, 5),
})
# One workload step: ("update", tokens) | ("add", key, cont) | ("lookup", context, nodes, depth)
ops = st.lists(st.one_of(
    st.tuples(st.just("update"), tokens),
    st.tuples(st.just("add"), st.lists(st.integers(0, 5), min_size=3, max_size=3),
              st.lists(st.integers(0, 5), min_size=1, max_size=4)),
    st.tuples(st.just("lookup"), tokens, st.integers(0, 12), st.integers(0, 5)),
), max_size=25)


@settings(max_examples=150, deadline=None)
@given(knobs, ops)
def test_matches_naive_lru_and_respects_caps(kw, workload):
    pool, ref = LRUNGramPool(**kw), NaiveLRU(**kw)
    for op in workload:
        if op[0] == "update":
            pool.update(op[1])
            ref.update(op[1])
        elif op[0] == "add":
            key, cont = op[1][: kw["key_len"]], op[2][: kw["ngram"] - 1]
            pool.add(key, cont)
            ref.add(key, cont)
        else:
            _, ctx, nodes, depth = op
            got = pool.lookup(ctx, nodes, depth)
            assert got == ref.lookup(ctx, nodes, depth)
            check_contract(got, nodes, depth)
        assert len(pool) == len(ref)
        assert pool.keys() == ref.keys
        assert all(pool.continuations(k) == ref.conts[k] for k in ref.keys)
        if kw["max_keys"] is not None:
            assert len(pool.keys()) <= kw["max_keys"]
        if kw["max_per_key"] is not None:
            stored = pool.keys()
            assert all(len(pool.continuations(k)) <= kw["max_per_key"] for k in stored)
        if kw["max_keys"] is not None and kw["max_per_key"] is not None:
            assert len(pool) <= kw["max_keys"] * kw["max_per_key"]


def test_lru_order_and_eviction():
    pool = LRUNGramPool(key_len=1, max_per_key=2, max_keys=2, ngram=3)
    pool.add([1], [2, 3])
    pool.add([1], [4, 5])
    pool.add([1], [2, 3])  # re-added: moves to the front
    assert pool.lookup([9, 1], 10, 5) == [[2, 3], [4, 5]]
    pool.add([1], [6, 7])  # over max_per_key: the least recent, (4, 5), goes
    assert pool.continuations([1]) == [(6, 7), (2, 3)]
    pool.add([2], [0])
    pool.lookup([1], 10, 5)  # a lookup hit makes key 1 the most recent
    pool.add([3], [0])  # over max_keys: key 2 goes, not key 1
    assert pool.keys() == [(3,), (1,)]
    assert len(pool) == 3


def test_update_adds_complete_ngrams_only():
    pool = LRUNGramPool(key_len=2, ngram=3)
    pool.update([1, 2, 3, 4, 5])
    # key 2 tokens + continuation ngram-1=2 tokens: windows of 4, and no partial one at the end
    assert pool.keys() == [(2, 3), (1, 2)]
    assert pool.continuations([1, 2]) == [(3, 4)]
    assert pool.continuations([3, 4]) == []
    assert pool.lookup([0, 1, 2], 8, 8) == [[3, 4]]
    assert pool.lookup([5], 8, 8) == []


def test_lookup_truncates_last_candidate_to_fit():
    pool = LRUNGramPool(key_len=1, ngram=4)
    pool.add([0], [1, 2, 3])
    pool.add([0], [1, 5, 6])
    # most recent first: [1,5,6] uses 3 nodes, then [1,2,3] shares "1" and fits only "2".
    assert pool.lookup([0], 4, 3) == [[1, 5, 6], [1, 2]]
    assert pool.lookup([0], 4, 1) == [[1]]
    assert pool.lookup([0], 0, 3) == []


@pytest.mark.parametrize("kw, words", [
    ({"key_len": 0}, "key_len must be >= 1"),
    ({"max_per_key": 0}, "max_per_key must be >= 1, or None for no limit, got 0"),
    ({"max_keys": -1}, "max_keys must be >= 1, or None"),
    ({"ngram": 1}, "ngram must be >= 2"),
    ({"ngram": 2.5}, "ngram must be an integer"),
])
def test_knob_validation(kw, words):
    with pytest.raises(ValueError, match=re.escape(f"ngram_pool.{words}")):
        LRUNGramPool(**kw)


def test_add_validates_shapes():
    pool = LRUNGramPool(key_len=2, ngram=3)
    with pytest.raises(ValueError, match="key_len=2"):
        pool.add([1], [2])
    with pytest.raises(ValueError, match="ngram-1=2"):
        pool.add([1, 2], [3, 4, 5])
    with pytest.raises(ValueError, match="ngram-1=2"):
        pool.add([1, 2], [])
