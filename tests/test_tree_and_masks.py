"""Draft trees, tree masks, and the KV kept after a step."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.adapters.attention import GROUPED_SDPA, is_grouped_query, stock_attention, use_grouped_sdpa
from specfree.adapters.hf import HFAdapter
from specfree.adapters.kv_buffers import cache_in
from specfree.masks.tree import ancestors, build_layout
from specfree.draft_tree import merge
from tests.tiny_models import FAMILIES, VOCAB, tiny_model

candidate_lists = st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), max_size=8)


@given(candidates=candidate_lists, budget=st.integers(0, 30), max_depth=st.integers(1, 6))
def test_merge_dedupes_prefixes_and_respects_budget(candidates, budget, max_depth):
    tree = merge(99, ((c, "x") for c in candidates), budget=budget, max_depth=max_depth)
    assert tree.num_drafted <= budget
    assert max(tree.depths) <= max_depth
    paths = {tuple(tree.tokens[n] for n in tree.path_to(node)) for node in range(len(tree))}
    assert len(paths) == len(tree)  # every node is a distinct token path: prefixes are shared
    # Reference: insert prefixes greedily in order while the budget allows.
    expected: set[tuple[int, ...]] = {()}
    for cand in candidates:
        for k in range(1, min(len(cand), max_depth) + 1):
            prefix = tuple(cand[:k])
            if prefix not in expected:
                if len(expected) - 1 >= budget:
                    break
                expected.add(prefix)
        if len(expected) - 1 >= budget and budget > 0:
            break
    assert paths == expected


@st.composite
def parent_arrays(draw):
    n = draw(st.integers(1, 30))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@given(parents=parent_arrays())
def test_each_row_attends_exactly_to_its_ancestors(parents):
    anc = ancestors(parents)
    for i in range(len(parents)):
        chain, node = set(), i
        while node != -1:
            chain.add(node)
            node = parents[node]
        assert set(np.flatnonzero(anc[i])) == chain


def random_tree(rng: np.random.Generator, size: int):
    candidates = [rng.integers(3, VOCAB, size=rng.integers(1, 5)).tolist() for _ in range(size)]
    return merge(int(rng.integers(3, VOCAB)), ((c, "t") for c in candidates), budget=16)


@settings(max_examples=30, deadline=None)
@given(family=st.sampled_from(FAMILIES), seed=st.integers(0, 10_000))
def test_tree_rows_and_committed_kv_match_a_plain_forward(family, seed):
    rng = np.random.default_rng(seed)
    model = tiny_model(family)
    adapter = HFAdapter(model)
    prefix = rng.integers(3, VOCAB, size=int(rng.integers(1, 12))).tolist()
    tree = random_tree(rng, int(rng.integers(1, 6)))
    adapter.prefill(torch.tensor(prefix))
    layout = build_layout(tree, None, root_position=len(prefix))
    logits = adapter.forward(layout.tokens, layout.allowed, layout.positions)

    # Each tree row's logits equal a plain forward over exactly its own prefix.
    node = int(rng.integers(0, len(tree)))
    path_tokens = [tree.tokens[0]] + [tree.tokens[n] for n in tree.path_to(node)]
    ids = torch.tensor([prefix + path_tokens])
    with torch.no_grad():  # positions as generate passes them (RoBERTa-style models would count from pad + 1)
        plain = model(ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=True)
    # fp32 rounding differs between the two layouts; it scales with the logits (gemma3n_text's reach
    # ~10 and differed by 1.65e-4 at seed 132)
    scale = max(1.0, float(plain.logits[0, -1].abs().max()))
    torch.testing.assert_close(logits[node], plain.logits[0, -1], atol=1e-4 * scale, rtol=1e-4)

    # After committing the path root..node, the cache equals the plain forward's cache. specfree keeps every
    # position; a sliding layer of the plain cache keeps only the last window - 1 of them.
    adapter.commit([0, *tree.path_to(node)], rows=layout.rows)
    assert adapter.past_len == len(prefix) + len(path_tokens)
    for ours, ref in zip(adapter.store.cache.layers, cache_in(plain).layers):
        assert ours.keys.shape[-2] == adapter.past_len
        kept = ref.keys.shape[-2]
        torch.testing.assert_close(ours.keys[..., -kept:, :], ref.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values[..., -kept:, :], ref.values, atol=1e-5, rtol=1e-4)


def test_positions_default_to_row_sum_minus_one():
    adapter = HFAdapter(tiny_model("llama"))
    tree = merge(5, [([6, 7], "a"), ([8], "b")], budget=8)
    layout = build_layout(tree, None, root_position=3)
    adapter.prefill(torch.tensor([3, 4, 9]))
    explicit = adapter.forward(layout.tokens, layout.allowed, layout.positions)
    assert adapter.truncate(3)  # the step dropped through the adapter: its KV manager keeps the count
    derived = adapter.forward(layout.tokens, layout.allowed)
    torch.testing.assert_close(explicit, derived)
    assert layout.positions.tolist() == [3, 4, 5, 4]


@settings(max_examples=15, deadline=None)
@given(family=st.sampled_from(FAMILIES), seed=st.integers(0, 10_000))
def test_grouped_attention_equals_transformers_sdpa_on_tree_rows(family, seed):
    """The grouped-query SDPA the adapter switches to gives exactly transformers' logits."""
    rng = np.random.default_rng(seed)
    model = tiny_model(family)
    prefix = torch.tensor(rng.integers(3, VOCAB, size=int(rng.integers(1, 12))))
    layout = build_layout(random_tree(rng, int(rng.integers(1, 6))), None, root_position=len(prefix))
    config = model.config
    logits = {}
    for grouped in (False, True):
        with stock_attention(model):
            runs_sdpa = config._attn_implementation == "sdpa"
            if grouped:  # the adapter would pick tree attention first; grouped SDPA is its fallback
                use_grouped_sdpa(model)
            adapter = HFAdapter(model, check_tree_mask=False, grouped_attention=False)
            adapter.prefill(prefix)
            logits[grouped] = adapter.forward(layout.tokens, layout.allowed, layout.positions)
            switched = config._attn_implementation == GROUPED_SDPA
        assert switched == (grouped and is_grouped_query(model) and runs_sdpa)
    assert torch.equal(logits[False], logits[True])
