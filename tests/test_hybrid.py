"""The hybrid: members' drafts merged into one proposal, which the engine prices like any other."""

from __future__ import annotations

import numpy as np
from specfree import Engine
from specfree.cost import CostModel
from specfree.pricing import AcceptanceModel, price
from specfree.strategies.hybrid import Hybrid
from specfree.strategies.prompt_lookup import PromptLookup
from tests.tiny_models import tiny_model

def test_the_hybrid_offers_every_members_drafts_labelled_by_member_and_leaves_pricing_to_the_engine():
    members = [PromptLookup(max_ngram=2, min_ngram=1, draft_len=3, num_candidates=2), PromptLookup(draft_len=1)]
    hybrid = Hybrid(members, max_rows=7)
    context = np.array([5, 6, 7, 8, 5, 6], dtype=np.int64)
    hybrid.begin(context)
    proposal = hybrid.propose(context, max_depth=8)
    assert proposal.candidates == [[7, 8, 5], [7]] and proposal.max_rows == 7
    assert proposal.sources == ["prompt_lookup", "prompt_lookup#2"] and proposal.labels == ["n2", "n2"]
    # Priced on a curve where rows are free, the members' shared node is verified once.
    plan = price(6, proposal, AcceptanceModel(), CostModel([1, 64], [1.0, 1.0]), max_depth=8)
    assert plan.tree.tokens == [6, 7, 8, 5] and plan.offered == 4


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
