"""Pricing on its own: hand-made proposals, statistics and cost curves in, a plan of rows out."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.cost import CostModel
from specfree.pricer import as_proposed, learn
from specfree.pricing import AGREED, AcceptanceModel, Node, Plan, agreed_label, node_rates, price, reach_probabilities
from specfree.draft_tree import DraftTree
from specfree.types import AuxBlock, Proposal

FLAT = CostModel([1, 2, 64], [1.0, 1.0, 1.0])  # rows are free
STEEP = CostModel([1, 2, 64], [1.0, 10.0, 400.0])  # one more row costs ten forwards
CPU = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4])  # two rows 20% dearer than one

# A tree with branches: [1, 2, 3] and [1, 4] share their first node, [5] is a sibling of it.
BRANCHY = Proposal([[1, 2, 3], [1, 4], [5]], "drafter")


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[n] for n in tree.path_to(node)) for node in range(1, len(tree))}


def window(rows: int) -> AuxBlock:
    return AuxBlock(list(range(10, 10 + rows)), list(range(1, rows + 1)),
                    torch.ones(rows, rows, dtype=torch.bool).tril())


def trained(accepted: int, rejected: int, source: str = "drafter", label: str | None = None) -> AcceptanceModel:
    acceptance = AcceptanceModel()
    for depth in range(1, 13):
        for hit in [True] * accepted + [False] * rejected:
            acceptance.record(source, label, depth, hit)
    return acceptance


def test_a_flat_curve_keeps_the_whole_tree():
    plan = price(0, BRANCHY, AcceptanceModel(), FLAT, max_depth=8)
    assert paths(plan.tree) == {(1,), (1, 2), (1, 2, 3), (1, 4), (5,)}
    assert plan.rows == plan.offered == 6


def test_a_steep_curve_keeps_the_root_only():
    plan = price(0, BRANCHY, trained(30, 1), STEEP, max_depth=8)
    assert len(plan.tree) == 1 and plan.rows == 1 and plan.offered == 6


def test_nodes_are_kept_best_first_while_tokens_per_second_rise():
    # Likely first nodes, unlikely second guesses: a CPU curve keeps the likely chain only.
    acceptance = trained(30, 1)
    proposal = Proposal([[1, 2, 3], [5]], "drafter", sources=["drafter", "guess"])
    for _ in range(30):
        acceptance.record("guess", None, 1, False)
    plan = price(0, proposal, acceptance, CPU, max_depth=8)
    assert paths(plan.tree) == {(1,), (1, 2), (1, 2, 3)}
    assert plan.tree.sources[1:] == ["drafter"] * 3


def test_a_row_is_weighed_against_every_token_the_shared_step_emits():
    # A batch's requests share one forward: a row that delays it delays the others' tokens too,
    # so what pays for one request alone does not pay when three others share the step.
    acceptance = trained(1, 1)  # half the drafts land
    chain = Proposal([[1, 2, 3, 4]], "drafter")
    alone = price(0, chain, acceptance, CPU, max_depth=8, chain=True)
    shared = price(0, chain, acceptance, CPU, max_depth=8, chain=True, shared_tokens=3 * 1.5)
    assert len(alone.tree) > len(shared.tree) >= 1


def test_drafts_that_rarely_land_are_not_verified():
    proposal = Proposal([[8, 9, 5, 6, 7]], "prompt_lookup", labels=["n2"])
    rarely = price(0, proposal, trained(1, 30, "prompt_lookup", "n2"), CPU, max_depth=8)
    often = price(0, proposal, trained(30, 1, "prompt_lookup", "n2"), CPU, max_depth=8)
    assert len(rarely.tree) == 1 and paths(often.tree) == {(8,), (8, 9), (8, 9, 5), (8, 9, 5, 6), (8, 9, 5, 6, 7)}


def test_max_rows_and_max_depth_bound_the_plan():
    proposal = Proposal([[1, 2, 3, 4, 5]], "drafter", max_rows=3)
    assert paths(price(0, proposal, AcceptanceModel(), FLAT, max_depth=8).tree) == {(1,), (1, 2)}
    assert paths(price(0, Proposal([[1, 2, 3]], "d"), AcceptanceModel(), FLAT, max_depth=1).tree) == {(1,)}


def test_aux_blocks_are_priced_like_rows():
    proposal = Proposal([[1]], "drafter", windows=[("lookahead", window(4)), ("other", window(2))])
    assert price(0, proposal, AcceptanceModel(), FLAT, max_depth=8).windows == [0, 1]
    kept = price(0, proposal, AcceptanceModel(), STEEP, max_depth=8)
    assert kept.windows == [] and kept.rows == 1
    # A window whose owner lands nothing alone loses its value, and then its rows.
    acceptance = AcceptanceModel()
    for _ in range(30):
        acceptance.record_window("lookahead", decoded=True, landed=0)
    assert price(0, proposal, acceptance, CPU, max_depth=8).windows == [1]
    assert price(0, proposal, AcceptanceModel(), CPU, max_depth=8).windows == [0, 1]


def test_a_chain_model_gets_one_priced_chain_and_no_aux_rows():
    proposal = Proposal([[1, 2, 3], [1, 4], [5]], "drafter", aux=window(3))
    plan = price(0, proposal, trained(30, 1), FLAT, max_depth=8, chain=True)
    assert plan.tree.parents == list(range(-1, len(plan.tree) - 1)) and len(plan.tree) > 1  # a chain
    assert plan.windows == [] and plan.aux is None and plan.rows == len(plan.tree)
    steep = price(0, proposal, trained(30, 1), STEEP, max_depth=8, chain=True)
    assert len(steep.tree) == 1


def test_a_rollback_makes_a_chain_no_longer():
    proposal = Proposal([[1, 2, 3, 4, 5, 6]], "drafter")
    curve = CostModel([1, 2, 8], [1.0, 1.5, 1.8])
    for accepted, rejected in [(1, 1), (3, 1), (10, 1), (1, 3)]:
        acceptance = trained(accepted, rejected)
        plain = price(0, proposal, acceptance, curve, max_depth=8, chain=True)
        rolled = price(0, proposal, acceptance, curve, max_depth=8, chain=True, rollback=True)
        assert len(rolled.tree) <= len(plain.tree)


def test_unpriced_steps_keep_what_was_proposed():
    proposal = Proposal([[1, 2, 3], [1, 4], [5]], "drafter", aux=window(3))
    plan = as_proposed(0, proposal, max_depth=8, budget=100)
    assert paths(plan.tree) == {(1,), (1, 2), (1, 2, 3), (1, 4), (5,)} and plan.windows == [0]
    assert plan.rows == plan.offered == 9
    chain = as_proposed(0, proposal, max_depth=8, budget=100, chain=True)
    assert paths(chain.tree) == {(1,), (1, 2), (1, 2, 3)} and chain.windows == []


def test_each_kept_block_gets_its_own_rows_logits_and_a_dropped_one_none():
    parts = [("a", window(2)), ("b", window(3)), ("c", window(1))]
    plan = Plan(DraftTree.root_only(0), parts, [0, 2], offered=7)
    assert plan.rows == 4 and plan.aux.tokens == [10, 11, 10]
    logits = torch.arange(8.0).reshape(4, 2)  # root, then a's two rows, then c's row
    first, dropped, last = plan.aux_logits(logits)
    assert first.tolist() == [[2, 3], [4, 5]] and dropped is None and last.tolist() == [[6, 7]]


def test_learning_scores_every_proposed_token_whose_parent_was_reached():
    acceptance = AcceptanceModel()
    proposal = Proposal([[1, 2, 3], [1, 9], [5]], "d", windows=[("w", window(2))])
    plan = Plan(DraftTree.root_only(0), proposal.aux_parts(), [0], offered=7)
    learn(acceptance, proposal, plan, emitted=[1, 2, 7], accepted=2)
    assert acceptance.counts[("d", "", 1)] == [2.0, 1.0]  # 1 hit twice, 5 missed
    assert acceptance.counts[("d", "", 2)] == [1.0, 1.0]  # 2 hit, 9 missed
    assert acceptance.counts[("d", "", 3)] == [0.0, 1.0]  # 3 missed the model's 7
    assert acceptance.window_steps["w"] == 1 and acceptance.window_tokens["w"] == 0  # "w" drafted none of them


def test_a_node_several_drafters_propose_is_learned_and_priced_as_their_agreement():
    # "a" and "b" both propose 1 (then part ways); only "a" proposes 5.
    proposal = Proposal([[1, 2], [1, 3], [5]], sources=["a", "b", "a"], labels=["x", "y", "x"])
    acceptance = AcceptanceModel()
    for _ in range(8):  # "a" alone has been right every time at depth 1, "b" never
        acceptance.record("a", "x", 1, True)
        acceptance.record("b", "y", 1, False)
    kind = agreed_label(Node(acceptance.rate("a", "x", 1), "a", "x", {"a", "b"}))
    assert kind == "a+b|a:x"  # which drafters, and the likelier one's own kind
    before = {key: list(c) for key, c in acceptance.counts.items()}
    learn(acceptance, proposal, Plan(DraftTree.root_only(0), [], [], offered=5), emitted=[1, 3, 4], accepted=2)
    # The shared node 1 (hit) counts once, as the agreement, and for neither drafter alone; the
    # drafters' own nodes (2 missed, 3 hit, 5 missed) count for their own kinds.
    assert acceptance.counts[(AGREED, kind, 1)] == [1.0, 0.0]
    assert acceptance.counts[("a", "x", 1)] == [before[("a", "x", 1)][0], 1.0]  # 5 missed, 1 not counted
    assert acceptance.counts[("b", "y", 1)] == before[("b", "y", 1)]
    assert acceptance.counts[("a", "x", 2)] == [0.0, 1.0] and acceptance.counts[("b", "y", 2)] == [1.0, 0.0]
    for _ in range(20):  # agreement on depth 1 has been wrong since
        acceptance.record(AGREED, kind, 1, False)
    rates = node_rates(proposal, acceptance, max_depth=4)
    assert rates[(1,)][0] == acceptance.rate(AGREED, kind, 1) < acceptance.rate("a", "x", 1)
    assert rates[(1,)][1:] == ("a", "x")  # attributed to the likelier drafter
    assert rates[(5,)][0] == acceptance.rate("a", "x", 1)


def test_one_drafter_is_priced_by_its_own_kinds_alone():
    proposal = Proposal([[1, 2], [1, 3]], "d", labels=["x", "y"])  # one drafter, two candidates through 1
    acceptance = AcceptanceModel()
    learn(acceptance, proposal, Plan(DraftTree.root_only(0), [], [], offered=4), emitted=[1, 3, 4], accepted=2)
    assert not any(key[0] == AGREED for key in acceptance.counts)
    assert acceptance.counts[("d", "x", 1)] == [1.0, 0.0] and acceptance.counts[("d", "y", 1)] == [1.0, 0.0]


# ---- properties over random proposals, statistics and curves ---------------------------------
candidates = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), max_size=6)
curves = st.lists(st.floats(0.0, 3.0), min_size=2, max_size=6).map(
    lambda steps: CostModel([2 ** i for i in range(len(steps))], list(1.0 + np.cumsum([0.0, *steps[1:]]))))


@settings(max_examples=60, deadline=None)
@given(candidates=candidates, sources=st.lists(st.sampled_from(["a", "b"]), min_size=6, max_size=6),
       history=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 6), st.booleans()), max_size=40),
       curve=curves, chain=st.booleans(), max_rows=st.integers(1, 40))
def test_a_plan_is_a_subtree_of_the_proposal_and_pricing_is_pure(candidates, sources, history, curve, chain,
                                                                max_rows):
    proposal = Proposal(candidates, "a", sources=sources[: len(candidates)], max_rows=max_rows)
    acceptance = AcceptanceModel()
    for source, depth, hit in history:
        acceptance.record(source, None, depth, hit)
    before = copy.deepcopy(dict(acceptance.counts))
    plan = price(7, proposal, acceptance, curve, max_depth=8, chain=chain)
    assert price(7, proposal, acceptance, curve, max_depth=8, chain=chain).tree.tokens == plan.tree.tokens
    assert dict(acceptance.counts) == before  # statistics are read, never written
    offered = {tuple(c[:d]) for c in candidates for d in range(1, len(c) + 1)}
    kept = paths(plan.tree)
    assert kept <= offered and all(p[:-1] in kept or len(p) == 1 for p in kept)  # parents first
    assert plan.rows <= min(plan.offered, max_rows) and plan.offered == 1 + len(offered)
    assert not chain or plan.tree.parents == list(range(-1, len(plan.tree) - 1))
    assert plan.tree.tokens[0] == 7


@settings(max_examples=60, deadline=None)
@given(candidates=candidates, history=st.lists(st.tuples(st.integers(1, 6), st.booleans()), max_size=40),
       curve=curves, max_rows=st.integers(1, 40), windows=st.lists(st.integers(1, 6), max_size=2))
def test_the_curve_priced_at_once_plans_what_pricing_row_count_by_row_count_plans(candidates, history, curve,
                                                                                  max_rows, windows):
    """``CostModel.many`` (one array per step) against the curve called once per row count."""
    blocks = [(f"w{i}", window(n)) for i, n in enumerate(windows)]
    proposal = Proposal(candidates, "a", max_rows=max_rows, windows=blocks)
    acceptance = AcceptanceModel()
    for depth, hit in history:
        acceptance.record("a", None, depth, hit)
    rows = np.arange(0, 90)
    assert np.array_equal(curve.many(rows), [curve(int(r)) for r in rows])
    at_once = price(7, proposal, acceptance, curve, max_depth=8)
    one_by_one = price(7, proposal, acceptance, lambda rows: curve(rows), max_depth=8)
    assert at_once.tree.tokens == one_by_one.tree.tokens and at_once.tree.parents == one_by_one.tree.parents
    assert at_once.windows == one_by_one.windows


def test_siblings_share_one_token():
    reach = reach_probabilities({(1,): 0.5, (2,): 0.4, (1, 7): 0.5})
    assert np.isclose(reach[(1,)], 0.5)
    assert np.isclose(reach[(2,)], 0.4 * 0.5)  # a second guess counts only where the first failed
    assert np.isclose(reach[(1, 7)], 0.25)


@given(st.dictionaries(st.lists(st.integers(0, 3), min_size=1, max_size=4).map(tuple), st.floats(0.0, 1.0),
                       min_size=1, max_size=30))
def test_children_never_beat_parents(rates):
    rates = {path[:depth]: rates.get(path[:depth], 0.5) for path in rates for depth in range(1, len(path) + 1)}
    reach = reach_probabilities(rates)
    assert set(reach) == set(rates)
    for parent in {path[:-1] for path in reach}:
        siblings = [p for path, p in reach.items() if path[:-1] == parent]
        assert sum(siblings) <= reach.get(parent, 1.0) + 1e-9


def test_a_rarely_seen_label_is_smoothed_toward_its_source_not_toward_one_half():
    acceptance = AcceptanceModel()
    for hit in [True] * 50 + [False] * 5:  # this drafter's first tokens: right 9 times in 10
        acceptance.record("suffix", "r4+", 1, hit)
    acceptance.record("suffix", "r16+", 1, True)
    acceptance.record("suffix", "r16+", 1, True)
    assert acceptance.rate("suffix", "r16+", 1) > 0.9  # two hits of a new class: not (2 + 1) / (2 + 2)
    assert acceptance.rate("suffix", "r1", 1) == pytest.approx(53 / 59)  # never seen: the source's rate
    assert acceptance.rate("prompt_lookup", "3", 1) == 0.5  # another source, never seen: one half
    assert acceptance.rate("suffix", "r4+", 2) == 0.5  # another depth is another question


def test_a_batch_prices_a_requests_rows_further_along_the_curve():
    """``Shifted``: a request's k rows in a forward that carries ``others`` rows cost what the curve
    says of k + others rows, at any context the curve knows."""
    from specfree.pricer import Shifted

    curve = CostModel([1, 2, 4, 8, 16], [1.0, 1.1, 1.3, 1.8, 3.0], context=64, growth=[0.001] * 5)
    shifted = Shifted(curve, 3)
    assert shifted(1) == curve(4) and shifted(5) == curve(8)
    assert list(shifted.many(np.arange(1, 6))) == list(curve.many(np.arange(4, 9)))
    assert shifted.at(512)(2) == curve.at(512)(5) > curve(5)
    assert Shifted(lambda rows: float(rows), 2).many(np.array([1, 2])).tolist() == [3.0, 4.0]  # a plain callable
