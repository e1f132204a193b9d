"""One step's plan, and what the step teaches: written once for the engine's loop, ``bench``'s
replay and the vLLM proposer.

A ``StepPlanner`` takes a step's proposal and prices it (``specfree.pricing``, on a cost curve) or,
unpriced, takes it as proposed; after the step it folds the forward's time into the curve (where
asked) and teaches the pricer what was accepted. What differs between its callers is fixed when
it is built: whether the model verifies one chain a step (and how long), whether a cut chain is
replayed, and whether each step is priced at its own context.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from specfree.pricer import Pricer, as_proposed
from specfree.pricing import Plan
from specfree.types import Proposal


class Timing(Protocol):
    """What a step's forward time is folded into (``CostModel.observe`` and the like)."""

    def observe(self, rows: int, seconds: float, *, context: int | None = None) -> None: ...


class StepPlanner:
    """Plans and learns one step at a time.

    ``pricer``: the pricing state (None: every step as proposed, the method exactly at its knobs).
    ``chain``: the model verifies one chain a step, at most ``max_chain`` deep, with no aux rows;
    ``rollback``: a cut chain is replayed (priced one more forward of its kept rows).
    ``budget``: the drafted nodes an unpriced step may keep (None: as many as the step's depth).
    ``price_context``: price (and time) each step at its own context, where the curve knows it.
    ``timing``: what each step's forward time is folded into (the engine's curve), or None.
    ``max_rows``: the most rows a step runs (the adapter's ``exact_rows``: past them a row's bits
    could depend on the others, and a verify row would no longer equal the one-row forward).
    """

    def __init__(self, pricer: Pricer | None, *, chain: bool = False, max_chain: int | None = None,
                 rollback: bool = False, budget: int | None = None, price_context: bool,
                 timing: Timing | None = None, max_rows: int | None = None):
        self.pricer = pricer
        self.max_rows = max_rows
        self.chain, self.max_chain, self.rollback = chain, max_chain, rollback
        self.budget = budget
        self.price_context = price_context
        self.timing = timing

    @classmethod
    def for_adapter(cls, pricer: Pricer | None, adapter, *, price_context: bool,
                    timing: Timing | None = None) -> "StepPlanner":
        """The engine's planner: chains, their cap and rollback as the adapter's model needs them."""
        caps = adapter.capabilities
        return cls(pricer, chain=caps.chain_only, max_chain=caps.max_chain, rollback=caps.rollback,
                   budget=adapter.max_length, price_context=price_context, timing=timing,
                   max_rows=getattr(adapter, "exact_rows", None))  # a plugin's adapter may not say

    def plan(self, root: int, proposal: Proposal, *, max_depth: int, context: int | None = None,
             cost: Callable[[int], float] | None = None, shared_tokens: float = 0.0) -> Plan:
        """The rows this step runs: those worth their cost (priced), or all the strategy asked for.

        ``context``: committed tokens (priced there with ``price_context``); ``cost``: a curve to price
        on instead of the pricer's own; ``shared_tokens``: tokens other requests gain from the step.
        """
        if self.max_rows is not None and (proposal.max_rows is None or proposal.max_rows > self.max_rows):
            proposal = dataclasses.replace(proposal, max_rows=self.max_rows)
        if self.pricer is None:
            budget = max_depth if self.budget is None else self.budget
            return as_proposed(root, proposal, max_depth=max_depth, budget=budget, chain=self.chain,
                               max_chain=self.max_chain)
        depth = max_depth if not self.chain or self.max_chain is None else min(max_depth, self.max_chain)
        return self.pricer.plan(root, proposal, max_depth=depth, chain=self.chain, rollback=self.rollback,
                                context=context if self.price_context else None, cost=cost,
                                shared_tokens=shared_tokens)

    def timed(self, rows: int, seconds: float, context: int | None = None) -> None:
        """A forward of ``rows`` rows took ``seconds`` at ``context`` tokens (folded into ``timing``, and
        into the pricer's correction of its curve)."""
        context = context if self.price_context else None
        if self.pricer is not None:  # before the curve learns a new point from it: the price this step had
            self.pricer.timed(rows, seconds, context)
        if self.timing is not None:
            with self.pricer.rebasing(context) if self.pricer is not None else contextlib.nullcontext():
                self.timing.observe(rows, seconds, context=context)

    def learn(self, proposal: Proposal, plan: Plan, emitted: Sequence[int], accepted: int) -> None:
        """The step emitted ``emitted`` tokens, the first ``accepted`` of them drafted."""
        if self.pricer is not None:
            self.pricer.observe(proposal, plan, emitted, accepted)
