"""Hybrid sizing: probabilities that respect one token per position, and a tree only where it pays."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from specfree import Engine
from specfree.cost import CostModel
from specfree.strategies.hybrid import AcceptanceModel, Hybrid, reach_probabilities
from specfree.strategies.prompt_lookup import PromptLookup
from tests.tiny_models import tiny_model

paths = st.lists(st.integers(0, 3), min_size=1, max_size=4).map(tuple)


@given(st.dictionaries(paths, st.floats(0.0, 1.0), min_size=1, max_size=30))
def test_siblings_share_one_token_and_children_never_beat_parents(rates):
    rates = {path[:depth]: rates.get(path[:depth], 0.5) for path in rates for depth in range(1, len(path) + 1)}
    reach = reach_probabilities(rates)
    assert set(reach) == set(rates)
    for parent in {path[:-1] for path in reach}:
        siblings = [p for path, p in reach.items() if path[:-1] == parent]
        assert sum(siblings) <= reach.get(parent, 1.0) + 1e-9


def test_disagreeing_guesses_count_only_where_the_first_failed():
    reach = reach_probabilities({(1,): 0.5, (2,): 0.4, (1, 7): 0.5})
    assert np.isclose(reach[(1,)], 0.5)
    assert np.isclose(reach[(2,)], 0.4 * 0.5)
    assert np.isclose(reach[(1, 7)], 0.25)


def hybrid_after(accepted: int, rejected: int) -> Hybrid:
    acceptance = AcceptanceModel()
    for depth in range(1, 13):  # prompt lookup labels its drafts by matched n-gram length
        for _ in range(accepted):
            acceptance.record("prompt_lookup", "n2", depth, True)
        for _ in range(rejected):
            acceptance.record("prompt_lookup", "n2", depth, False)
    hybrid = Hybrid([PromptLookup(max_ngram=2, min_ngram=1, draft_len=8, num_candidates=1)], acceptance=acceptance)
    # A CPU-like curve: two rows cost 20% more than one, sixteen rows twice as much.
    hybrid.costs = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4])
    hybrid.setup(vocab_size=100, max_length=512)
    return hybrid


def drafts_of(hybrid: Hybrid, context: np.ndarray):
    hybrid.begin(context)
    candidates = hybrid.propose(context, max_depth=8).candidates
    # The hybrid lists every node as a candidate (parents first); its tree's leaves are the drafts.
    return [c for c in candidates if not any(len(d) > len(c) and d[: len(c)] == c for d in candidates)]


def test_drafts_that_rarely_land_are_not_verified():
    context = np.array([5, 6, 7, 8, 9, 5, 6, 7], dtype=np.int64)
    assert drafts_of(hybrid_after(accepted=1, rejected=30), context) == []
    assert drafts_of(hybrid_after(accepted=30, rejected=1), context) == [[8, 9, 5, 6, 7]]


def test_recycling_counts_the_tokens_its_table_knows():
    engine = Engine.from_model(tiny_model("llama"), None, "recycling")
    for prompt in ([5, 6, 7, 5, 6, 7, 5], [9, 9, 10, 11]):
        engine.generate(prompt, 12)
        table = engine.strategy.table
        assert engine.strategy.stats()["known_tokens"] == (table[:, 0] >= 0).sum() > 0


def test_prompt_lookup_labels_copies_from_the_answer_apart_from_copies_from_the_prompt():
    lookup = PromptLookup(max_ngram=2, min_ngram=1, draft_len=3, num_candidates=2)
    lookup.begin(np.array([5, 6, 7, 8]))
    context = np.array([5, 6, 7, 8, 1, 6, 7, 2, 6, 7])  # "6 7" in the prompt (at 1) and in the answer (at 5)
    proposal = lookup.propose(context, max_depth=8)
    assert proposal.candidates == [[2, 6, 7], [8, 1, 6]]
    assert proposal.labels == ["n2out", "n2"]
