"""Every pool keeps the Pool protocol and the lookup budget on the same random workloads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.pools import LRUNGramPool, Pool, SuffixArrayPool, TriePool

from ._reference import check_contract


def make(kind: str, texts: list[list[int]]):
    if kind == "lru":
        pool = LRUNGramPool(key_len=1, max_per_key=4, ngram=4)
    elif kind == "trie":
        pool = TriePool(max_nodes=60, branch_length=5, max_query_length=3)
    else:
        return SuffixArrayPool.build([np.array(t) for t in texts], max_query_length=4, min_query_length=1)
    pool.begin_request(texts[0] if texts else [])
    for t in texts[1:] if kind == "trie" else texts:  # the LRU pool ignores prompts
        pool.update(t)
    return pool


KINDS = ["lru", "trie", "sa"]
texts_st = st.lists(st.lists(st.integers(0, 200_000) | st.integers(0, 3), max_size=40), max_size=5)


@pytest.mark.parametrize("kind", KINDS)
def test_is_a_pool(kind):
    pool = make(kind, [[1, 2, 3, 1, 2, 4]])
    assert isinstance(pool, Pool)
    pool.end_request()


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(texts=texts_st, ctx=st.lists(st.integers(0, 3), max_size=6),
       nodes=st.integers(-1, 30), depth=st.integers(-1, 10))
def test_lookup_budget(kind, texts, ctx, nodes, depth):
    pool = make(kind, texts)
    # Query with a context taken from the data too, so most lookups actually match.
    for c in (ctx, *(t[: len(t) // 2] for t in texts)):
        check_contract(pool.lookup(c, nodes, depth), max(nodes, 0), max(depth, 0))
    if kind == "trie":
        assert len(pool) <= 60


@pytest.mark.parametrize("kind", KINDS)
def test_accepts_numpy_contexts(kind):
    pool = make(kind, [[1, 2, 3, 1, 2, 4], [1, 2, 3]])
    as_list = pool.lookup([0, 1, 2], 8, 4)
    assert as_list and pool.lookup(np.array([0, 1, 2], dtype=np.int64), 8, 4) == as_list
    check_contract(as_list, 8, 4)
