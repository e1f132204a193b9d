"""The hybrid: members' drafts merged into one proposal, which the engine prices like any other."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from specfree import Engine
from specfree.cost import CostModel
from specfree.draft_tree import DraftTree
from specfree.pricing import AcceptanceModel, Option, Plan, price, proposal_without
from specfree.strategies.hybrid import Hybrid
from specfree.strategies.member_choice import MemberChoice
from specfree.strategies.prompt_lookup import PromptLookup
from tests.tiny_models import reference_greedy, tiny_model

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


def test_pricing_prices_the_step_without_each_member_the_proposal_asks_about():
    members = [PromptLookup(max_ngram=2, min_ngram=1, draft_len=3, num_candidates=2), PromptLookup(draft_len=1)]
    hybrid = Hybrid(members, max_rows=7, check_every=1)
    context = np.array([5, 6, 7, 8, 5, 6, 9, 5, 6], dtype=np.int64)
    hybrid.begin(context)
    proposal = hybrid.propose(context, max_depth=8)
    assert proposal.leave_out == ("prompt_lookup", "prompt_lookup#2")
    curve = CostModel([1, 2, 4, 8], [1.0, 1.1, 1.3, 1.8])
    acceptance = AcceptanceModel()
    plan = price(6, proposal, acceptance, curve, max_depth=8)
    assert plan.option.seconds == curve(plan.rows) and plan.option.tokens == 1.0 + plan.expected
    for member in proposal.leave_out:  # each: the plan of the proposal the others alone would have made
        alone = price(6, proposal_without(proposal, member), acceptance, curve, max_depth=8)
        assert plan.without[member] == alone.option
        assert member not in alone.tree.sources and alone.without is None
    assert price(6, replace(proposal, leave_out=()), acceptance, curve, max_depth=8).without is None


class Clock:
    """Seconds that pass only where a test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowLookup(PromptLookup):
    """A member whose every draft takes ``seconds`` of ``clock``'s time."""

    def __init__(self, clock: Clock, seconds: float, **knobs):
        super().__init__(**knobs)
        self.clock, self.seconds, self.calls = clock, seconds, 0

    def propose(self, context, max_depth):
        self.clock.now += self.seconds
        self.calls += 1
        return super().propose(context, max_depth)


def plan_of(tokens: float, seconds: float, without: dict[str, tuple[float, float]]) -> Plan:
    return Plan(DraftTree.root_only(0), [], [], 1, option=Option(tokens, seconds),
                without={member: Option(*option) for member, option in without.items()})


def test_a_member_whose_draft_costs_more_than_its_tokens_are_worth_is_left_out_until_the_next_check():
    clock = Clock()
    choice = MemberChoice(every=4, warm=1, clock=clock)
    choice.begin()
    assert choice.step()  # the request's first step is a check
    # The step took 10 s: without "slow" it would have expected 1.9 of its 2.0 tokens, in 10 - 3 (its
    # draft) - (4 - 3.5) (its rows' forward) = 6.5 s; without "fast", 1.0 token in 10 - 0.1 - 1 s.
    choice.checked(plan_of(2.0, 4.0, {"slow": (1.9, 3.5), "fast": (1.0, 3.0)}), {"slow": 3.0, "fast": 0.1})
    clock.now += 10.0
    assert [choice.step() for _ in range(3)] == [False, False, True]  # a check every 4 steps
    assert choice.left_out == "slow"
    # At the next check every member drafted again, and the slow one's tokens now pay for its time.
    choice.checked(plan_of(4.0, 4.0, {"slow": (1.5, 3.5), "fast": (1.0, 3.0)}), {"slow": 3.0, "fast": 0.1})
    clock.now += 10.0
    choice.step()
    assert choice.left_out is None
    choice.begin()  # a new request learns anew, every member drafting
    assert choice.left_out is None and choice.step()


def test_the_hybrid_drafts_without_a_member_that_does_not_pay_and_its_output_is_plain_decoding():
    model = tiny_model("llama")
    clock = Clock()
    slow = SlowLookup(clock, 5.0, draft_len=1)  # five seconds for one token's guess a step
    hybrid = Hybrid([PromptLookup(max_ngram=3, min_ngram=1, draft_len=6, num_candidates=2), slow],
                    check_every=4, clock=clock)
    engine = Engine.from_model(model, None, hybrid, costs=CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4]))
    prompt = [5, 6, 7, 8, 9] * 3 + [5, 6]
    result = engine.generate(prompt, 40, ignore_eos=True)
    assert result.tokens == reference_greedy(model, prompt, 40, ignore_eos=True)
    steps = len(result.steps)
    checks = 2 + sum(1 for step in range(3, steps + 1) if step % 4 == 0)
    assert steps > 6 and slow.calls == checks  # it drafted at the checks only
    assert [s.extra["members_drafting"] for s in result.steps][2:4] == [1.0, 1.0]


def test_check_every_zero_keeps_every_member_drafting_every_step():
    clock = Clock()
    slow = SlowLookup(clock, 5.0, draft_len=1)
    hybrid = Hybrid([PromptLookup(draft_len=4), slow], check_every=0, clock=clock)
    engine = Engine.from_model(tiny_model("llama"), None, hybrid)
    result = engine.generate([5, 6, 7, 8, 9] * 3, 20, ignore_eos=True)
    assert slow.calls == len(result.steps)
