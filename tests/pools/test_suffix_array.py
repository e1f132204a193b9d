from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.pools import SuffixArrayPool
from specfree.pools.suffix_array import suffix_array

from ._reference import check_contract, naive_sa_lookup

docs_st = st.lists(st.lists(st.integers(0, 3), max_size=25), max_size=5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1, 2**31 - 2), max_size=60), st.sampled_from([3, 300, 70_000, 2**24 + 5]))
def test_suffix_array_sorts_suffixes(values, vocab):
    # Token widths of 1 to 4 bytes: ids are folded into [0, vocab) to hit each one.
    text = np.array([v % vocab if v >= 0 else -1 for v in values] + [-1], dtype=np.int32)
    sa = suffix_array(text)
    expect = sorted(range(len(text)), key=lambda i: text[i:].tolist())
    assert sa.tolist() == expect


@settings(max_examples=150, deadline=None)
@given(docs_st, st.lists(st.integers(0, 3), max_size=8), st.integers(1, 5), st.integers(1, 3),
       st.integers(0, 12), st.integers(0, 6))
def test_lookup_matches_brute_force(docs, ctx, max_q, min_q, nodes, depth):
    min_q = min(min_q, max_q)
    pool = SuffixArrayPool.build([np.array(d, dtype=np.int64) for d in docs],
                                 max_query_length=max_q, min_query_length=min_q)
    cands = pool.lookup(ctx, nodes, depth)
    check_contract(cands, nodes, depth)
    assert cands == naive_sa_lookup(docs, ctx, max_q, min_q, nodes, depth)
    assert len(pool) == sum(len(d) for d in docs)


@settings(max_examples=60, deadline=None)
@given(docs_st, st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_occurrences_match_brute_force(docs, pattern):
    pool = SuffixArrayPool.build(docs)
    text = [t for d in docs for t in d + [-1]]
    expect = [i for i in range(len(text)) if text[i : i + len(pattern)] == pattern]
    assert pool.occurrences(pattern).tolist() == expect


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=300), st.lists(st.integers(0, 2), max_size=4),
       st.integers(1, 8), st.integers(1, 20), st.integers(1, 6))
def test_sampled_occurrences_still_give_real_continuations(doc, ctx, cap, nodes, depth):
    pool = SuffixArrayPool.build([doc], max_occurrences=cap, min_query_length=1)
    cands = pool.lookup(ctx, nodes, depth)
    check_contract(cands, nodes, depth)
    for c in cands:  # each candidate follows some occurrence of a suffix of ctx
        assert any(doc[i : i + len(c)] == c and doc[max(0, i - 1) : i] == ctx[-1:] for i in range(len(doc)))


def test_lookup_counts_and_document_boundaries():
    pool = SuffixArrayPool.build([[5, 6, 1, 2], [5, 6, 1, 3], [5, 6, 1, 3], [9, 5, 6]])
    # "5 6" occurs 4 times; the last one ends its document, so it adds no continuation.
    assert pool.lookup([0, 5, 6], 4, 2) == [[1, 3], [1, 2]]
    assert pool.lookup([0, 5, 6], 2, 2) == [[1, 3]]
    assert pool.lookup([9, 5, 6], 4, 2) == [[1, 3], [1, 2]]  # "9 5 6" has nothing after it
    assert pool.lookup([6, 1, 3], 4, 2) == []  # never crosses into the next document
    assert pool.lookup([7, 7], 4, 2) == []
    assert pool.lookup([6], 4, 2) == []  # shorter than min_query_length


def test_single_prompt_index_for_prompt_lookup():
    prompt = np.array([1, 2, 3, 4, 1, 2, 3, 5, 1, 2], dtype=np.int64)
    pool = SuffixArrayPool.build(prompt)
    assert pool.occurrences([1, 2]).tolist() == [0, 4, 8]
    assert pool.lookup(prompt, 4, 2) == [[3, 4], [3, 5]]


def test_build_handles_empty_input_and_reports_progress():
    stages = []
    pool = SuffixArrayPool.build([], progress=lambda stage, frac: stages.append((stage, frac)))
    assert len(pool) == 0 and pool.lookup([1, 2], 5, 5) == []
    assert stages[0] == ("concatenate", 0.0) and stages[-1] == ("done", 1.0)
    assert SuffixArrayPool.build([[], [1, 2]]).lookup([7, 1], 3, 3) == []


@pytest.mark.parametrize("kw, words", [
    ({"max_query_length": 0}, "max_query_length must be >= 1, got 0"),
    ({"min_query_length": 0}, "min_query_length must be between 1 and 16, got 0"),
    ({"min_query_length": 17}, "min_query_length must be between 1 and 16"),
    ({"max_occurrences": 0}, "max_occurrences must be >= 1"),
])
def test_knob_validation(kw, words):
    with pytest.raises(ValueError, match=re.escape(f"suffix_array_pool.{words}")):
        SuffixArrayPool.build([[1, 2, 3]], **kw)


@pytest.mark.parametrize("docs, words", [
    ([[1, -2]], "outside"),
    ([[[1, 2]]], "1-D array"),
    ([[1.5]], "1-D array of token ids"),
])
def test_build_validation(docs, words):
    with pytest.raises(ValueError, match=words):
        SuffixArrayPool.build(docs)


def test_negative_context_ids_never_match_separators():
    pool = SuffixArrayPool.build([[1, 2], [3, 4]], min_query_length=1)
    assert pool.lookup([-1, -1], 4, 4) == []
    assert pool.lookup([-1, 3], 4, 4) == [[4]]
    assert pool.occurrences([-1]).size == 0
