"""The suffix trees of SuffixDecoding against brute-force search over random token strings."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specfree.errors import ConfigError
from specfree.pools import Pool
from specfree.pools.suffix_tree import SuffixTreePool, SuffixTrie

from ._reference import check_contract

texts = st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=4)
patterns = st.lists(st.integers(0, 3), min_size=1, max_size=6)
depths = st.integers(1, 7)


def occurrences(seqs: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(s[i : i + n] == pattern for s in seqs for i in range(len(s) - n + 1))


def followers(seqs: list[list[int]], pattern: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    n = len(pattern)
    for s in seqs:
        for i in range(len(s) - n):
            if s[i : i + n] == pattern:
                out[s[i + n]] = out.get(s[i + n], 0) + 1
    return out


def substrings(seqs: list[list[int]], depth: int) -> set[tuple[int, ...]]:
    return {tuple(s[i:j]) for s in seqs for i in range(len(s)) for j in range(i + 1, min(len(s), i + depth) + 1)}


def brute_score(seqs, context, depth, size_cap, factor, offset, min_prob, max_depth) -> float:
    """The best speculation score by enumeration: a path's probability telescopes to
    count(match + path) / count(match), and the greedy tree takes the ``size`` likeliest paths."""
    ctx = context[max(0, len(context) - depth) :]
    best = 0.0
    for m in range(1, len(ctx) + 1):
        match = ctx[len(ctx) - m :]
        total = occurrences(seqs, match)
        if total == 0:
            break
        size = min(size_cap, int(m * factor + offset + 1e-6))
        paths = {p[m:] for p in substrings(seqs, depth) if p[:m] == tuple(match) and
                 0 < len(p) - m <= max_depth}
        probs = sorted((occurrences(seqs, list(match) + list(p)) / total for p in paths), reverse=True)
        probs = [p for p in probs if p >= min_prob][: max(size, 0)]
        if probs:
            best = max(best, sum(probs))
    return best


@settings(max_examples=60, deadline=None)
@given(seqs=texts, depth=depths, queries=st.lists(patterns, max_size=5))
def test_counts_and_continuations_match_brute_force(seqs, depth, queries):
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.insert(s)
    for p in substrings(seqs, depth) | {tuple(q[:depth]) for q in queries}:
        assert trie.count(p) == occurrences(seqs, list(p))
        if len(p) < depth:
            assert trie.continuations(p) == followers(seqs, list(p))
    assert len(trie) == len(substrings(seqs, depth))
    for q in queries:
        brute = max([m for m in range(1, min(len(q), depth) + 1) if occurrences(seqs, q[len(q) - m :])],
                    default=0)
        assert trie.longest_match(q) == brute


@settings(max_examples=40, deadline=None)
@given(seq=st.lists(st.integers(0, 3), max_size=40), cuts=st.lists(st.integers(0, 40), max_size=5), depth=depths)
def test_growing_token_by_token_counts_what_inserting_the_whole_sequence_counts(seq, cuts, depth):
    grown, whole = SuffixTrie(depth), SuffixTrie(depth)
    whole.insert(seq)
    last = 0
    for cut in sorted(min(c, len(seq)) for c in cuts) + [len(seq)]:
        grown.append(seq[last:cut])
        last = cut
    assert len(grown) == len(whole)
    assert all(grown.count(p) == whole.count(p) for p in substrings([seq], depth))


@settings(max_examples=40, deadline=None)
@given(seqs=texts, context=st.lists(st.integers(0, 3), min_size=1, max_size=8), depth=st.integers(2, 6),
       cap=st.integers(1, 8), factor=st.sampled_from([0.5, 1.0, 2.0]), offset=st.sampled_from([0.0, 1.0]),
       min_prob=st.sampled_from([0.0, 0.1, 0.4]), max_depth=st.integers(1, 6))
def test_speculation_takes_the_likeliest_paths_of_the_best_match(seqs, context, depth, cap, factor, offset,
                                                                 min_prob, max_depth):
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.insert(s)
    draft = trie.speculate(context, cap, factor, offset, min_prob, max_depth)
    assert draft.score == pytest.approx(brute_score(seqs, context, depth, cap, factor, offset, min_prob, max_depth))
    assert len(draft.tokens) <= min(cap, int(draft.match_len * factor + offset + 1e-6))
    assert all(p >= min_prob for p in draft.probs)
    check_contract(draft.candidates(), len(draft.tokens), max_depth)


def every_match_draft(trie: SuffixTrie, context, cap, factor, offset, min_prob, max_depth):
    """The paper's search without shortcuts: a tree for every matching suffix, shortest first, the
    best score kept (a longer match on a tie)."""
    ctx = list(context)[max(0, len(context) - trie.max_tree_depth) :]
    best = None
    for m in range(1, len(ctx) + 1):
        node = trie.find(ctx[len(ctx) - m :])
        if node is None:
            break
        size = min(cap, int(m * factor + offset + 1e-6))
        if size > 0:
            draft = trie._grow(node, size, min_prob, max_depth)
            if draft.tokens and (best is None or draft.score >= best.score):
                best, best.match_len = draft, m
    return best


@settings(max_examples=60, deadline=None)
@given(seqs=texts, context=st.lists(st.integers(0, 3), min_size=1, max_size=9), depth=st.integers(2, 7),
       cap=st.integers(1, 8), factor=st.sampled_from([0.0, 0.5, 1.0, 2.0]), offset=st.sampled_from([-2.0, 0.0, 1.0]),
       min_prob=st.sampled_from([0.0, 0.1, 0.4]), max_depth=st.integers(1, 6))
# A tie between two match lengths (the longer wins), and a shorter match whose tree beats the longer's.
@example(seqs=[[0, 1, 2], [0, 1, 3]], context=[0, 1], depth=3, cap=8, factor=2.0, offset=0.0, min_prob=0.0,
         max_depth=1)
@example(seqs=[[0, 1, 2], [1, 3, 3], [1, 3, 3], [1, 3, 3]], context=[0, 1], depth=4, cap=8, factor=2.0, offset=0.0,
         min_prob=0.0, max_depth=3)
def test_the_longest_first_search_drafts_what_trying_every_match_drafts(seqs, context, depth, cap, factor, offset,
                                                                       min_prob, max_depth):
    """Speculation tries the longest match first and stops once no shorter one can score more:
    the same tree, node for node, and the same match length as growing one for every match."""
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.insert(s)
    draft = trie.speculate(context, cap, factor, offset, min_prob, max_depth)
    reference = every_match_draft(trie, context, cap, factor, offset, min_prob, max_depth)
    if reference is None:
        assert not draft.tokens
    else:
        assert (draft.tokens, draft.parents, draft.probs, draft.match_len) == \
            (reference.tokens, reference.parents, reference.probs, reference.match_len)


@settings(max_examples=40, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12), pieces=st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=6), others=texts, depth=st.integers(1, 6))
def test_the_suffixes_a_trie_grew_are_its_matches_without_a_search(prompt, pieces, others, depth):
    """A request's own trie knows its context's suffix nodes; the global store knows those of a
    response it streams (the longer ones, reaching into the prompt, are searched)."""
    local, pool = SuffixTrie(depth), SuffixTreePool(max_tree_depth=depth)
    for other in others:
        pool.add_request(other)
    local.append(prompt)
    handle, context, output = pool.open_response(), list(prompt), []
    for piece in pieces:
        local.append(piece)
        pool.extend_response(handle, piece)
        context += piece
        output += piece
        assert local.own_matches() == local.matches(context)
        known = pool.response_matches(handle)
        assert known == pool.trie.matches(output)
        assert pool.trie.matches(context, known) == pool.trie.matches(context)
    assert pool.response_matches(None) == []


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.lists(st.integers(0, 5), max_size=25), max_size=12), cached=st.integers(0, 4),
       max_nodes=st.integers(1, 80))
def test_the_global_store_keeps_the_newest_requests_within_its_bounds(requests, cached, max_nodes):
    pool = SuffixTreePool(max_tree_depth=5, max_cached_requests=cached, max_nodes=max_nodes)
    added = []
    for r in requests:
        pool.add_request(r)
        added += [r] if r and cached else []
        kept = list(pool.requests)
        assert len(kept) <= cached and len(pool) <= max_nodes
        assert kept == added[len(added) - len(kept) :]  # the oldest went first
        fresh = SuffixTrie(5)
        for k in kept:
            fresh.insert(k)
        assert len(pool.trie) == len(fresh)  # eviction left exactly the kept requests' nodes
        assert all(pool.trie.count(p) == fresh.count(p) for p in substrings(added, 5))


@settings(max_examples=40, deadline=None)
@given(responses=st.lists(st.lists(st.lists(st.integers(0, 5), max_size=6), max_size=5), min_size=1, max_size=4),
       order=st.randoms(use_true_random=False), cached=st.integers(0, 3), max_nodes=st.integers(1, 200))
def test_responses_streamed_side_by_side_count_what_whole_requests_count(responses, order, cached, max_nodes):
    """Concurrent requests streaming their outputs in pieces, interleaved, and closing in any order:
    at every moment the store counts exactly the open responses so far plus the cached requests
    (the newest within the bounds; open ones are never evicted)."""
    pool = SuffixTreePool(max_tree_depth=4, max_cached_requests=cached, max_nodes=max_nodes)
    handles = [pool.open_response() for _ in responses]
    written = [[] for _ in responses]
    # Every piece in a random interleaving; each request closes at a random later point.
    events = [(i, piece) for i, pieces in enumerate(responses) for piece in pieces]
    order.shuffle(events)
    for i in range(len(responses)):
        last = max([n for n, (j, _) in enumerate(events) if j == i], default=-1)
        events.insert(order.randint(last + 1, len(events)), (i, None))
    closed = []
    for i, piece in events:
        if piece is None:
            pool.close_response(handles[i])
            closed += [written[i]] if written[i] and cached else []
        else:
            pool.extend_response(handles[i], piece)
            written[i] += piece if cached else []
        still_open = [written[j] for j in range(len(responses)) if handles[j] in pool.live]
        kept = list(pool.requests)
        assert kept == closed[len(closed) - len(kept):] and len(kept) <= cached
        fresh = SuffixTrie(4)
        for seq in kept + still_open:
            fresh.insert(seq)
        assert len(pool.trie) == len(fresh)
        assert all(pool.trie.count(q) == fresh.count(q) for q in substrings(kept + still_open, 4))
    assert not pool.live


def test_memory_stays_bounded_over_many_requests():
    pool = SuffixTreePool(max_tree_depth=8, max_cached_requests=1000, max_nodes=2000)
    for i in range(300):
        pool.add_request([(i * 7 + j * 13) % 97 for j in range(20)])
        assert len(pool) <= 2000
    # Node ids are reused: the columns never outgrow the cap plus one request's worth.
    assert len(pool.trie._count) <= 2000 + 20 * 8 + 1
    by_count = SuffixTreePool(max_tree_depth=8, max_cached_requests=3)
    for i in range(50):
        by_count.add_request([i, i + 1, i + 2])
    assert list(by_count.requests) == [[47, 48, 49], [48, 49, 50], [49, 50, 51]]


def test_is_a_pool_and_keeps_the_lookup_contract():
    pool = SuffixTreePool(max_tree_depth=6)
    assert isinstance(pool, Pool)
    pool.begin_request([9, 9])
    pool.update([1, 2, 3, 1, 2, 4])
    pool.update([1, 2, 3])
    out = pool.lookup([0, 1, 2], 8, 4)
    assert sorted(c[0] for c in out) == [3, 4] and [3, 1, 2, 4] in out  # "1 2" went on with 3 twice, 4 once
    check_contract(out, 8, 4)
    assert pool.lookup([0, 1, 2], 0, 4) == [] and pool.lookup([7], 8, 4) == []


# --- the state file ---------------------------------------------------------------------------

FP = bytes(range(16))


def saved(tmp_path):
    pool = SuffixTreePool(max_tree_depth=4)
    for r in ([1, 2, 3], [4, 5], [1, 2, 6, 7]):
        pool.add_request(r)
    path = tmp_path / "state.bin"
    pool.save(path, 10, FP)
    return pool, path


def test_the_state_file_round_trips(tmp_path):
    pool, path = saved(tmp_path)
    back = SuffixTreePool(max_tree_depth=4)
    back.load(path, 10, FP)
    assert list(back.requests) == list(pool.requests) and len(back) == len(pool)
    assert not list(tmp_path.glob("*.tmp"))  # written atomically: no temp file left


@pytest.mark.parametrize("damage, words", [
    ("truncate", "truncated"),
    ("vocab", "another tokenizer"),
    ("fingerprint", "another tokenizer"),
    ("flip", "corrupt"),
    ("magic", "not a specfree suffix state file"),
])
def test_a_bad_state_file_is_one_clear_error_and_is_not_used(tmp_path, damage, words):
    _, path = saved(tmp_path)
    data = bytearray(path.read_bytes())
    vocab, fp = 10, FP
    if damage == "truncate":
        path.write_bytes(bytes(data[:-5]))
    elif damage == "vocab":
        vocab = 11
    elif damage == "fingerprint":
        fp = bytes(16)
    elif damage == "flip":
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(b"X" + bytes(data[1:]))
    pool = SuffixTreePool(max_tree_depth=4)
    pool.add_request([8, 8, 8])
    with pytest.raises(ConfigError, match=words) as err:
        pool.load(path, vocab, fp)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "state_file" in message
    assert list(pool.requests) == [[8, 8, 8]]  # untouched
