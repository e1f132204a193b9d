from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.pools import TriePool

from ._reference import NaiveTrie, check_contract, naive_trie_lookup

small = st.lists(st.integers(0, 4), max_size=20)
# ("begin", prompt) | ("update", tokens, start) | ("end",)
ops = st.lists(st.one_of(
    st.tuples(st.just("begin"), small),
    st.tuples(st.just("update"), small, st.integers(0, 20)),
    st.tuples(st.just("end")),
), max_size=12)


def apply(pool: TriePool, op: tuple) -> None:
    if op[0] == "begin":
        pool.begin_request(op[1])
    elif op[0] == "update":
        pool.update(op[1], start=min(op[2], len(op[1])))
    else:
        pool.end_request()


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 5), ops)
def test_counts_match_naive_prefix_counts(branch, workload):
    pool, ref = TriePool(max_nodes=10**6, branch_length=branch), NaiveTrie(branch)
    for op in workload:
        apply(pool, op)
        if op[0] == "begin":
            if any(v[0] for v in ref.counts.values()):
                ref.end_request()  # begin_request first drops an unfinished request
            ref.update(op[1], "input")
        elif op[0] == "update":
            ref.update(op[1], "output", min(op[2], len(op[1])))
        else:
            ref.end_request()
        assert pool.to_dict() == {p: tuple(v) for p, v in ref.counts.items()}
        assert len(pool) == len(ref.counts)


def test_incremental_updates_equal_one_big_update():
    stream = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 5, 5, 1, 2]
    whole, steps = TriePool(branch_length=4), TriePool(branch_length=4)
    whole.update(stream)
    done = 0
    for end in (3, 4, 7, 8, 12, 14):  # each step passes a window of old + new tokens
        lo = max(0, done - 3)
        steps.update(stream[lo:end], start=done - lo)
        done = end
    assert steps.to_dict() == whole.to_dict()
    assert whole.to_dict()[(1, 2)] == (0, 4.0)


class WalkingTriePool(TriePool):
    """The same pool, every insert walking each window from the root (no suffix nodes carried over)."""

    def _insert(self, toks, start, is_input):
        self._walk(toks, start, is_input)


# A drafter's calls: a request's prompt, then each step the last few committed tokens + the new ones.
requests_of_steps = st.lists(st.tuples(small, st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5),
                                                       max_size=8), st.booleans()), min_size=1, max_size=4)


def drafter_calls(prompt, steps, ends, branch):
    """The calls a drafter makes over one request, and the request's whole text."""
    calls, text, seen = [("begin", prompt)], list(prompt), len(prompt)
    for new in steps:
        text += new
        lo = max(0, seen - (branch - 1))
        calls.append(("update", text[lo:], seen - lo))
        seen = len(text)
    return calls + ([("end",)] if ends else []), text


def naive_request(ref, prompt, text, ends):
    """The same request on the naive trie: its prompt as input, the rest of its text as output."""
    if any(v[0] for v in ref.counts.values()):
        ref.end_request()  # begin_request first drops an unfinished request
    ref.update(prompt, "input")
    ref.update(text, "output", len(prompt))
    if ends:
        ref.end_request()


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 5), requests_of_steps, small, st.integers(0, 12), st.integers(0, 6))
def test_steps_that_continue_the_text_extend_its_suffix_nodes_as_walking_would(branch, requests, ctx, nodes, depth):
    # The pool extends the nodes of the last insert's suffixes when the next insert continues the
    # same text: the same trie as walking every window from the root, and exactly the naive counts.
    fast, walking, ref = TriePool(branch_length=branch), WalkingTriePool(branch_length=branch), NaiveTrie(branch)
    for prompt, steps, ends in requests:
        calls, text = drafter_calls(prompt, steps, ends, branch)
        for op in calls:
            apply(fast, op)
            apply(walking, op)
            assert fast.to_dict() == walking.to_dict()
            assert fast.lookup(ctx, nodes, depth) == walking.lookup(ctx, nodes, depth)
        naive_request(ref, prompt, text, ends)
        assert fast.to_dict() == {p: tuple(v) for p, v in ref.counts.items()}


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 5), st.integers(1, 30), requests_of_steps, small, st.integers(0, 12), st.integers(0, 6))
def test_extending_suffix_nodes_under_a_cap_loses_counts_never_invents_them(branch, cap, requests, ctx, nodes, depth):
    # A shrink in the middle of an insert renumbers the nodes: the rest of it walks from the root.
    pool, ref = TriePool(max_nodes=cap, branch_length=branch), NaiveTrie(branch)
    for prompt, steps, ends in requests:
        calls, text = drafter_calls(prompt, steps, ends, branch)
        for op in calls:
            apply(pool, op)
            got = pool.to_dict()
            assert len(pool) <= cap and all(p[:-1] in got for p in got if len(p) > 1)
        naive_request(ref, prompt, text, ends)
        for p, (i, o) in pool.to_dict().items():
            assert i <= ref.counts[p][0] and o <= ref.counts[p][1]
        cands = pool.lookup(ctx, nodes, depth)
        assert cands == naive_trie_lookup(pool.to_dict(), ctx, pool.max_query_length, nodes, depth)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 30), ops, small, st.integers(0, 12), st.integers(0, 6))
def test_memory_cap_and_lookup_under_pruning(branch, cap, workload, ctx, nodes, depth):
    pool, ref = TriePool(max_nodes=cap, branch_length=branch), NaiveTrie(branch)
    for op in workload:
        if op[0] == "update":  # start=0: pruning may lose counts, never invent them
            op = ("update", op[1], 0)
        apply(pool, op)
        assert len(pool) <= cap
        got = pool.to_dict()
        assert all(p[:-1] in got for p in got if len(p) > 1), "orphaned node"
        assert all(len(p) <= branch for p in got)
        if op[0] == "begin":
            if any(v[0] for v in ref.counts.values()):
                ref.end_request()
            ref.update(op[1], "input")
        elif op[0] == "update":
            ref.update(op[1], "output")
        else:
            ref.end_request()
        for p, (i, o) in got.items():
            assert i <= ref.counts[p][0] and o <= ref.counts[p][1]
    cands = pool.lookup(ctx, nodes, depth)
    check_contract(cands, nodes, depth)
    assert cands == naive_trie_lookup(pool.to_dict(), ctx, pool.max_query_length, nodes, depth)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 30), st.lists(ops, min_size=1, max_size=4), small, st.integers(0, 12),
       st.integers(0, 6))
def test_a_requests_end_unlinks_what_its_prompt_alone_held_as_if_renumbered(branch, cap, requests, ctx, nodes,
                                                                            depth):
    # The same workload on a pool compacted after every call: same nodes, counts and drafts, under
    # any cap (the holes an end leaves never count toward it, nor reach a lookup or a file).
    lazy, eager = TriePool(max_nodes=cap, branch_length=branch), TriePool(max_nodes=cap, branch_length=branch)
    for workload in requests:
        for op in (*workload, ("end",)):
            apply(lazy, op)
            apply(eager, op)
            eager.compact()
            assert lazy.to_dict() == eager.to_dict() and len(lazy) == len(eager) <= cap
            assert lazy.lookup(ctx, nodes, depth) == eager.lookup(ctx, nodes, depth)
    assert len(eager._tok) - 1 == len(eager)  # compacted: no holes left
    lazy.compact()
    assert lazy._tok == eager._tok and lazy._par == eager._par  # renumbered alike


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(small, st.booleans()), max_size=6), small, st.integers(1, 4),
       st.integers(0, 15), st.integers(0, 6))
def test_lookup_matches_naive_best_first(texts, ctx, query, nodes, depth):
    pool = TriePool(branch_length=6, max_query_length=query)
    for toks, is_input in texts:
        pool.update(toks, source="input" if is_input else "output")
    cands = pool.lookup(ctx, nodes, depth)
    check_contract(cands, nodes, depth)
    assert cands == naive_trie_lookup(pool.to_dict(), ctx, query, nodes, depth)


def test_lookup_prefers_longest_match_with_children_and_frequency():
    pool = TriePool(branch_length=4, max_query_length=3)
    pool.update([7, 8, 9, 1])
    pool.update([8, 2, 8, 2, 8, 3])
    # "7 8" matches a path whose only child is 9; the best-first tree then follows it.
    assert pool.lookup([5, 7, 8], 2, 4) == [[9, 1]]
    # "6 8" is unknown, so the match falls back to "8": children 2 (count 2), 9, 3 (count 1).
    assert pool.lookup([6, 8], 3, 1) == [[2], [3], [9]]
    assert pool.lookup([6, 8], 2, 3) == [[2, 8]]
    assert pool.lookup([1], 5, 5) == []  # "1" only ever ended a window: no children
    assert pool.lookup([], 5, 5) == []


def test_ties_go_to_smaller_token_ids_even_when_children_outnumber_the_budget():
    pool = TriePool(branch_length=3)
    for t in range(9, -1, -1):
        pool.update([50, t, 60])
    pool.update([50, 6, 60])  # the most frequent child comes first despite its larger id
    assert pool.lookup([50], 4, 1) == [[6], [0], [1], [2]]
    assert pool.lookup([50], 3, 2) == [[6, 60], [0]]


def test_decay_keeps_frequent_output_and_drops_rare():
    pool = TriePool(max_nodes=40, branch_length=2)
    for _ in range(8):
        pool.update([1, 2])
    for t in range(100, 160):  # singletons overflow the cap and trigger decay + pruning
        pool.update([t])
        assert len(pool) <= 40
    counts = pool.to_dict()
    assert (1, 2) in counts and (1,) in counts
    assert counts[(1, 2)][1] < 8  # decayed


def test_prompt_larger_than_cap_is_evicted_and_dropped_at_end():
    pool = TriePool(max_nodes=50, branch_length=3)
    pool.update([1, 1, 1, 1])  # output "1 1 1" outlives the request
    pool.begin_request(list(range(10, 200)))
    assert len(pool) <= 50
    pool.end_request()
    assert pool.to_dict() == {(1,): (0, 4.0), (1, 1): (0, 3.0), (1, 1, 1): (0, 2.0)}


@pytest.mark.parametrize("kw, words", [
    ({"max_nodes": 0}, "max_nodes must be >= 1, got 0"),
    ({"branch_length": 0}, "branch_length must be >= 1"),
    ({"max_query_length": 0}, "max_query_length must be >= 1"),
    ({"decay": 1.0}, "decay must be > 0.0 and < 1.0, got 1.0"),
    ({"decay": 0}, "decay must be > 0.0 and < 1.0, got 0.0"),
])
def test_knob_validation(kw, words):
    with pytest.raises(ValueError, match=re.escape(f"trie_pool.{words}")):
        TriePool(**kw)


def test_update_validation():
    pool = TriePool()
    with pytest.raises(ValueError, match="source must be 'input' or 'output'"):
        pool.update([1], source="prompt")
    with pytest.raises(ValueError, match="start must be in"):
        pool.update([1, 2], start=3)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        pool.update([1, -2])
    with pytest.raises(ValueError, match="token ids must be in"):
        pool.update([2**32])
