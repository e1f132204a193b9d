"""The engine's pricing state around ``pricing.price``: ``Pricer`` holds a request's acceptance
statistics, calibration and curve and learns after each step (``learn``); ``Shifted`` prices a
request's rows inside a batch's forward; ``as_proposed`` is the unpriced step, a method exactly at
its knobs, as its paper ran it.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specfree.cost import Corrected, Correction, prices
from specfree.draft_tree import merge
from specfree.pricing import (AGREED, AcceptanceModel, Calibration, Path, Plan, agreed_label, drafted_nodes,
                              price)
from specfree.types import Proposal


def as_proposed(root: int, proposal: Proposal, *, max_depth: int, budget: int, chain: bool = False,
                max_chain: int | None = None) -> Plan:
    """The unpriced step: every candidate (up to ``budget`` nodes and ``proposal.max_rows`` rows) and
    every aux block, as the drafter asked; a chain-verifying model takes the first candidate alone."""
    parts = proposal.aux_parts()
    if proposal.max_rows is not None:
        budget = min(budget, max(0, proposal.max_rows - 1 - sum(len(b) for _, b in parts)))
    everything = merge(root, zip(proposal.candidates, proposal.candidate_sources()), budget=1 << 30,
                       max_depth=max_depth)
    offered = len(everything) + sum(len(block) for _, block in parts)
    tree = merge(root, zip(proposal.candidates, proposal.candidate_sources()), budget=budget, max_depth=max_depth)
    if chain:  # recurrent layers cannot branch: one chain, no auxiliary rows
        return Plan(tree.chain(max_chain), parts, [], offered)
    return Plan(tree, parts, list(range(len(parts))), offered)


@dataclass
class Shifted:
    """A request's price for its own rows when a batch's other rows send ``others`` more through the
    same forward: the curve read ``others`` rows further on."""

    curve: Callable[[int], float]
    others: int

    def __call__(self, rows: int) -> float:
        return self.curve(rows + self.others)

    def many(self, rows: np.ndarray) -> np.ndarray:
        return prices(self.curve, np.asarray(rows) + self.others)

    def at(self, context: int) -> "Shifted":
        """The same shift on the curve at ``context`` tokens (where the curve knows contexts)."""
        at = getattr(self.curve, "at", None)
        return Shifted(at(context), self.others) if at is not None else self


def at_context(curve, context: int | None):
    """``curve`` at ``context`` tokens, where it knows contexts (``CostModel.at``) and one is given."""
    at = getattr(curve, "at", None)
    return at(context) if at is not None and context is not None else curve


class Pricer:
    """The engine's pricing state: the acceptance statistics, learned from every step's verdict,
    and the forward-cost curve; ``plan`` prices one proposal.

    ``calibration``: each kind of node's expected tokens against what steps got (``Calibration``);
    ``correction``: the curve's price against the forwards' measured times (``cost.Correction``),
    fed by ``timed``. None leaves the rates, or the curve, as they are."""

    def __init__(self, cost: Callable[[int], float] | None, acceptance: AcceptanceModel | None = None, *,
                 calibration: Calibration | None = None, correction: Correction | None = None):
        self.cost = cost
        self.acceptance = acceptance or AcceptanceModel()
        self.calibration = calibration
        self.correction = correction

    @classmethod
    def calibrated(cls, cost: Callable[[int], float] | None, acceptance: AcceptanceModel | None = None, *,
                   correct: bool = True) -> "Pricer":
        """The engine's pricer: its rates calibrated by what drafts got, and (``correct``) its curve by
        what forwards took."""
        return cls(cost, acceptance, calibration=Calibration(), correction=Correction() if correct else None)

    def curve_at(self, context: int | None) -> Callable[[int], float] | None:
        """The pricer's own curve at ``context`` tokens (where the curve knows it), corrected."""
        curve = at_context(self.cost, context)
        return Corrected(curve, self.correction) if curve is not None and self.correction is not None else curve

    def plan(self, root: int, proposal: Proposal, *, max_depth: int, chain: bool = False,
             rollback: bool = False, context: int | None = None, cost: Callable[[int], float] | None = None,
             shared_tokens: float = 0.0) -> Plan:
        """Price ``proposal`` on the curve at ``context`` committed tokens (where the curve knows it);
        ``cost``: a curve to price this step on instead of the pricer's own (vLLM's step time, shifted
        by the batch's other rows; not corrected); ``shared_tokens``: see ``price``."""
        curve = self.curve_at(context) if cost is None else at_context(cost, context)
        return price(root, proposal, self.acceptance, curve, max_depth=max_depth, chain=chain, rollback=rollback,
                     shared_tokens=shared_tokens, calibration=self.calibration)

    def timed(self, rows: int, seconds: float, context: int | None = None) -> None:
        """A forward of ``rows`` rows took ``seconds`` at ``context``: the correction follows it."""
        if self.correction is not None and self.cost is not None:
            self.correction.observe(rows, seconds, at_context(self.cost, context)(rows))

    @contextlib.contextmanager
    def rebasing(self, context: int | None):
        """Inside the block the curve may learn from a step (a new point, or points moved): the
        correction's ratios are then re-based onto the curve as it is after, so that each count's
        corrected price stays what its steps measured (else a count learned from its first steps
        is priced at its measured time times the ratio of that time to the old guess: twice)."""
        snapshot = getattr(self.cost, "snapshot", None)
        if self.correction is None or snapshot is None:  # a curve that does not learn
            yield
            return
        before = snapshot()
        yield
        counts = self.correction.counts()
        if len(counts) and not before.same_as(self.cost):
            self.correction.rebase(counts, prices(at_context(before, context), counts)
                                   / prices(at_context(self.cost, context), counts))

    def observe(self, proposal: Proposal, plan: Plan, emitted: Sequence[int], accepted: int) -> None:
        """Learn from a step: ``emitted`` tokens (accepted drafts, then the model's own), the first
        ``accepted`` of them drafted."""
        learn(self.acceptance, proposal, plan, emitted, accepted)
        if self.calibration is not None:
            self.calibration.record(plan, emitted, accepted)


def learn(acceptance: AcceptanceModel, proposal: Proposal, plan: Plan, emitted: Sequence[int],
          accepted: int) -> None:
    """Record into ``acceptance`` how the proposal's drafts and aux blocks fared against ``emitted``."""
    labels = proposal.labels or [None] * len(proposal.candidates)
    owners: dict[Path, set[str]] = defaultdict(set)
    # The nodes as priced (the statistics have not moved since); an unpriced plan has none yet,
    # and only a hybrid's proposal has nodes that several drafters propose.
    nodes = plan.nodes
    if nodes is None:
        nodes = drafted_nodes(proposal, acceptance) if proposal.sources is not None else {}
    shared = {path: node for path, node in nodes.items() if len(node.sources) > 1}
    for candidate, source, label in zip(proposal.candidates, proposal.candidate_sources(), labels):
        # Score every proposed token whose parent the model reached, verified or not; a node
        # several drafters propose is scored once, as their agreement.
        prefix: Path = ()
        for depth in range(1, min(len(candidate), len(emitted)) + 1):
            hit = candidate[depth - 1] == emitted[depth - 1]
            prefix += (int(candidate[depth - 1]),)
            if prefix not in shared:
                acceptance.record(source, label, depth, hit)
            if not hit:
                break
            owners[tuple(emitted[:depth])].add(source)
    for path, node in shared.items():
        if len(path) <= len(emitted) and tuple(emitted[: len(path) - 1]) == path[:-1]:
            acceptance.record(AGREED, agreed_label(node), len(path), emitted[len(path) - 1] == path[-1])
    parts = proposal.aux_parts()
    if parts:
        # A block is worth the accepted tokens only its owner drafted: what others drafted too
        # would have landed without it.
        alone = Counter(next(iter(s)) for depth in range(1, accepted + 1)
                        if len(s := owners.get(tuple(emitted[:depth]), set())) == 1)
        for index, (owner, _) in enumerate(parts):
            acceptance.record_window(owner, index in plan.windows, alone.get(owner, 0))
