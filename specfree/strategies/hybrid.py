"""Hybrid drafting: several drafters propose, one tree is verified, sized by expected profit.

Every drafted node gets a probability of being emitted: the product, down its path, of the
rate at which the drafter's tokens of that kind (its label, e.g. the n-gram length of a prompt
match) at that depth were accepted so far, learned online, with siblings sharing one token's
worth of probability. Nodes are taken best first, and the tree stops growing where expected
tokens per second, (1 + sum p) / cost(rows), peaks, using the measured forward cost curve.
When no draft is worth its rows the step is a plain one-row forward: drafting that does not
pay costs almost nothing.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from specfree.errors import ConfigError, check_int
from specfree.strategies.base import Outcome, Strategy
from specfree.types import Proposal

MAX_DEPTH_BUCKET = 6


class AcceptanceModel:
    """P(a drafted token is accepted | its parent was), per (drafter, label, depth), Beta-smoothed."""

    def __init__(self, prior_accepted: float = 1.0, prior_rejected: float = 1.0):
        self.prior = (prior_accepted, prior_rejected)
        self.counts: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])

    @staticmethod
    def key(source: str, label: str | None, depth: int) -> tuple[str, str, int]:
        return source, label or "", min(depth, MAX_DEPTH_BUCKET)

    def rate(self, source: str, label: str | None, depth: int) -> float:
        accepted, rejected = self.counts.get(self.key(source, label, depth), (0.0, 0.0))
        a, r = self.prior
        return (accepted + a) / (accepted + rejected + a + r)

    def record(self, source: str, label: str | None, depth: int, accepted: bool) -> None:
        self.counts[self.key(source, label, depth)][0 if accepted else 1] += 1.0


class Hybrid(Strategy):
    name = "hybrid"
    wants_costs = True  # the engine hands over its measured CostModel as ``self.costs``

    def __init__(self, drafters: list[Strategy], max_rows: int = 32, acceptance: AcceptanceModel | None = None,
                 adapt_costs: bool = False):
        if not drafters:
            raise ConfigError("hybrid needs at least one drafter")
        self.drafters = drafters
        self.max_rows = check_int("hybrid.max_rows", max_rows, low=1)
        self.adapt_costs = bool(adapt_costs)  # True: live forward times refine the cost curve
        self.acceptance = acceptance or AcceptanceModel()
        self.costs = None
        self._proposed: list[tuple[str, str | None, list[int]]] = []
        self._last_rows = 1

    def setup(self, vocab_size: int, max_length: int) -> None:
        for drafter in self.drafters:
            drafter.setup(vocab_size, max_length)

    def begin(self, prompt: np.ndarray) -> None:
        for drafter in self.drafters:
            drafter.begin(prompt)

    def end(self) -> None:
        for drafter in self.drafters:
            drafter.end()

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        # Every proposed node: the best rate any drafter proposing it has at its depth.
        rate: dict[tuple[int, ...], tuple[float, str, str | None]] = {}
        self._proposed = []
        for drafter in self.drafters:
            proposal = drafter.propose(context, max_depth)
            labels = proposal.labels or [None] * len(proposal.candidates)
            learned: dict[tuple[str | None, int], float] = {}  # this drafter's rates, looked up once a step
            for candidate, label in zip(proposal.candidates, labels):
                self._proposed.append((drafter.name, label, candidate))
                prefix: tuple[int, ...] = ()
                for depth, token in enumerate(candidate, 1):
                    prefix += (token,)
                    r = learned.get((label, depth))
                    if r is None:
                        r = learned[label, depth] = self.acceptance.rate(drafter.name, label, depth)
                    if r > rate.get(prefix, (0.0,))[0]:
                        rate[prefix] = (r, drafter.name, label)
        if not rate:
            self._last_rows = 1
            return Proposal(source=self.name)
        reach = reach_probabilities({prefix: r for prefix, (r, _, _) in rate.items()})
        # A child is never likelier than its parent, so any best-first prefix is a subtree.
        ranked = sorted(reach.items(), key=lambda item: (-item[1], len(item[0])))[: self.max_rows - 1]
        expected = 1.0 + np.cumsum([p for _, p in ranked])
        cost = self.costs or (lambda rows: 1.0 + 0.0 * rows)
        rates = [1.0 / cost(1)] + [expected[k - 1] / cost(k + 1) for k in range(1, len(ranked) + 1)]
        k = int(np.argmax(rates))
        self._last_rows = k + 1
        inner = {path[:-1] for path, _ in ranked[:k]}
        leaves = [path for path, _ in ranked[:k] if path not in inner]
        return Proposal([list(path) for path in leaves], source=self.name,
                        sources=[rate[path][1] for path in leaves], labels=[rate[path][2] for path in leaves])

    def observe(self, outcome: Outcome) -> None:
        truth = outcome.verdict.tokens  # what the model emitted, depth by depth (bonus included)
        for source, label, candidate in self._proposed:
            # Score every proposed token whose parent the model reached, verified or not.
            for depth in range(1, min(len(candidate), len(truth)) + 1):
                accepted = candidate[depth - 1] == truth[depth - 1]
                self.acceptance.record(source, label, depth, accepted)
                if not accepted:
                    break
        for drafter in self.drafters:
            drafter.observe(outcome)

    def stats(self) -> dict[str, float]:
        out = {"rows_planned": float(self._last_rows)}
        for drafter in self.drafters:
            out.update({f"{drafter.name}.{k}": v for k, v in drafter.stats().items()})
        return out


def reach_probabilities(rate: dict[tuple[int, ...], float]) -> dict[tuple[int, ...], float]:
    """P(the model emits node's path) from each node's acceptance rate given its parent.

    Siblings exclude each other: the model emits one token. Rates learned per drafter are
    scaled accordingly, likeliest first (a second guess only counts where the first failed),
    so three drafters disagreeing do not add up to more than one expected token.
    """
    children: dict[tuple[int, ...], list[tuple[float, tuple[int, ...]]]] = defaultdict(list)
    for path, r in rate.items():
        children[path[:-1]].append((r, path))
    reach: dict[tuple[int, ...], float] = {}
    frontier = [((), 1.0)]
    while frontier:
        parent, p_parent = frontier.pop()
        left = 1.0  # probability mass the earlier siblings did not take
        for r, path in sorted(children.get(parent, ()), reverse=True):
            share = r * left
            left -= share
            reach[path] = p_parent * share
            frontier.append((path, reach[path]))
    return reach


def make_hybrid(drafters: list[str] | tuple[str, ...] = ("prompt_lookup", "trie", "recycling"),
                max_rows: int = 32, datastore: str | None = None, prior_accepted: float = 1.0,
                prior_rejected: float = 1.0, adapt_costs: bool = False) -> Hybrid:
    """Build the hybrid from drafter names with their hybrid-tuned knobs."""
    from specfree.strategies.prompt_lookup import PromptLookup
    from specfree.strategies.recycling import TokenRecycling
    from specfree.strategies.retrieval import make_retrieval
    from specfree.strategies.trie import make_trie

    builders = {
        "prompt_lookup": lambda: PromptLookup(max_ngram=4, min_ngram=1, draft_len=12, num_candidates=4),
        "trie": lambda: make_trie(decoding_length=24, branch_length=10, persist=True),
        "recycling": lambda: TokenRecycling(successors=8, widths=(4, 2, 2, 1, 1, 1, 1, 1)),
        "retrieval": lambda: make_retrieval(datastore, max_nodes=24, max_depth=10),
    }
    unknown = [d for d in drafters if d not in builders]
    if unknown:
        raise ConfigError(f"hybrid.drafters: unknown {unknown}; choose from {sorted(builders)}")
    if "retrieval" in drafters and not datastore:
        raise ConfigError("hybrid with the retrieval drafter needs strategy.datastore=PATH")
    return Hybrid([builders[d]() for d in drafters], max_rows=max_rows,
                  acceptance=AcceptanceModel(prior_accepted, prior_rejected), adapt_costs=adapt_costs)
