"""Hybrid drafting: several drafters propose, one tree is verified, sized by expected profit.

Every drafted node gets a probability of being emitted: the product, down its path, of the
rate at which the drafter's tokens of that kind (its label, e.g. the n-gram length of a prompt
match) at that depth were accepted so far, learned online, with siblings sharing one token's
worth of probability. Nodes are taken best first, and the tree stops growing where expected
tokens per second, (1 + sum p) / cost(rows), peaks, using the measured forward cost curve.
When no draft is worth its rows the step is a plain one-row forward: drafting that does not
pay costs almost nothing.

Members are any registered strategies, built by name through the registry with their own
knobs (``make_hybrid``). A member's auxiliary rows (lookahead's Jacobi window) join the step
after the tree, priced on the same cost curve and credited with the accepted tokens only that
member drafted, per decoded window; a window that does not pay is left out of the step, and its
member then gets no aux logits, so it knows the window was not decoded.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specfree.errors import ConfigError, check_int
from specfree.strategies.base import Outcome, Strategy
from specfree.types import AuxBlock, Proposal

if TYPE_CHECKING:
    from specfree.registry import Registry

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
                 adapt_costs: bool = False, labels: list[str] | None = None):
        if not drafters:
            raise ConfigError("hybrid needs at least one drafter")
        self.drafters = drafters
        # Who drafted what: each member's name, numbered where a name repeats (trie, trie#2).
        self.labels = labels or member_labels([d.name for d in drafters])
        if len(self.labels) != len(drafters) or len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"hybrid: member labels must be distinct, one per drafter; got {self.labels}")
        self.max_rows = check_int("hybrid.max_rows", max_rows, low=1)
        self.adapt_costs = bool(adapt_costs)  # True: live forward times refine the cost curve
        self.acceptance = acceptance or AcceptanceModel()
        self.costs = None
        self.windows = WindowLedger(len(drafters))
        self._proposed: list[tuple[str, str | None, list[int]]] = []
        self._aux_rows: list[tuple[int, int, int]] = []  # (member, first aux row, rows) decoded this step
        self._owners: dict[tuple[int, ...], int] = {}
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
        owners: dict[tuple[int, ...], int] = {}  # node -> bit mask of the members proposing it
        self._proposed = []
        windows: list[tuple[int, AuxBlock]] = []  # members asking for aux rows (a Jacobi window)
        for member, (drafter, source) in enumerate(zip(self.drafters, self.labels)):
            proposal = drafter.propose(context, max_depth)
            if proposal.aux is not None and len(proposal.aux):
                windows.append((member, proposal.aux))
            labels = proposal.labels or [None] * len(proposal.candidates)
            learned: dict[tuple[str | None, int], float] = {}  # this drafter's rates, looked up once a step
            for candidate, label in zip(proposal.candidates, labels):
                self._proposed.append((source, label, candidate))
                prefix: tuple[int, ...] = ()
                for depth, token in enumerate(candidate, 1):
                    prefix += (token,)
                    owners[prefix] = owners.get(prefix, 0) | (1 << member)
                    r = learned.get((label, depth))
                    if r is None:
                        r = learned[label, depth] = self.acceptance.rate(source, label, depth)
                    if r > rate.get(prefix, (0.0,))[0]:
                        rate[prefix] = (r, source, label)
        reach = reach_probabilities({prefix: r for prefix, (r, _, _) in rate.items()})
        # A child is never likelier than its parent, so any best-first prefix is a subtree.
        ranked = sorted(reach.items(), key=lambda item: (-item[1], len(item[0])))
        expected = 1.0 + np.cumsum([0.0] + [p for _, p in ranked])  # [k]: tokens expected from k nodes
        k, extra_rows, chosen = self._size(expected, windows)
        self._last_rows = k + 1 + extra_rows
        aux, self._aux_rows, first = None, [], 0
        for member, block in chosen:
            self._aux_rows.append((member, first, len(block)))
            first += len(block)
        if chosen:
            aux = stack_aux([block for _, block in chosen], [self.labels[m] for m, _ in chosen])
        self.windows.step([m for m, _ in windows], [m for m, _ in chosen])
        self._owners = owners
        # Every node as its own candidate, parents first: the tree then credits each node to the
        # member whose rate chose it (merge labels a node by the candidate that created it).
        nodes = [path for path, _ in ranked[:k]]
        return Proposal([list(path) for path in nodes], source=self.name, aux=aux,
                        sources=[rate[path][1] for path in nodes], labels=[rate[path][2] for path in nodes])

    def _size(self, expected: np.ndarray, windows: list[tuple[int, AuxBlock]]):
        """(tree nodes, aux rows, windows kept) maximising expected tokens per second.

        A window's rows are priced like tree rows and credited with the accepted tokens only its
        member has been drafting per decoded window, so a window that does not pay is dropped.
        """
        cost = self.costs or (lambda rows: 1.0 + 0.0 * rows)
        room = max(1, self.max_rows)

        def best(extra_rows: int, extra_tokens: float) -> tuple[float, int]:
            most = max(0, min(len(expected) - 1, room - 1 - extra_rows))
            rates = [(expected[k] + extra_tokens) / cost(k + 1 + extra_rows) for k in range(most + 1)]
            k = int(np.argmax(rates))
            return rates[k], k

        chosen: list[tuple[int, AuxBlock]] = []
        rows, tokens = 0, 0.0
        score, k = best(0, 0.0)
        for member, block in windows:
            with_window = best(rows + len(block), tokens + self.windows.value(member))
            if rows + len(block) < room and with_window[0] > score:
                chosen.append((member, block))
                rows += len(block)
                tokens += self.windows.value(member)
                score, k = with_window
        return k, rows, chosen

    def observe(self, outcome: Outcome) -> None:
        truth = outcome.verdict.tokens  # what the model emitted, depth by depth (bonus included)
        for source, label, candidate in self._proposed:
            # Score every proposed token whose parent the model reached, verified or not.
            for depth in range(1, min(len(candidate), len(truth)) + 1):
                accepted = candidate[depth - 1] == truth[depth - 1]
                self.acceptance.record(source, label, depth, accepted)
                if not accepted:
                    break
        # A window is worth the accepted tokens only its member drafted: what others drafted too
        # would have landed without it.
        alone = Counter()
        for depth in range(1, len(outcome.verdict.path) + 1):
            mask = self._owners.get(tuple(truth[:depth]), 0)
            if mask and mask & (mask - 1) == 0:
                alone[mask.bit_length() - 1] += 1
        self.windows.credit([alone.get(member, 0) for member in range(len(self.drafters))])
        # Each member sees only its own aux rows' logits; None tells it its window was not decoded.
        aux = {member: (first, rows) for member, first, rows in self._aux_rows}
        for member, drafter in enumerate(self.drafters):
            own = None
            if member in aux and outcome.aux_logits is not None:
                first, rows = aux[member]
                own = outcome.aux_logits[first : first + rows]
            drafter.observe(Outcome(outcome.tree, outcome.verdict, outcome.context, own, outcome.tree_logits))

    def stats(self) -> dict[str, float]:
        out = {"rows_planned": float(self._last_rows)}
        for member, (drafter, label) in enumerate(zip(self.drafters, self.labels)):
            out.update({f"{label}.{k}": v for k, v in drafter.stats().items()})
            if self.windows.offered[member]:
                out[f"{label}.window_value"] = self.windows.value(member)
        return out


class WindowLedger:
    """What each member's aux window (a Jacobi window) has been worth: the accepted tokens that
    member alone drafted, per step the window was decoded, smoothed with an optimistic prior so
    that a new window gets decoded and measured."""

    def __init__(self, members: int, prior_tokens: float = 2.0, prior_steps: float = 2.0):
        self.prior = (prior_tokens, prior_steps)
        self.tokens = [0.0] * members
        self.decoded = [0] * members
        self.offered = [0] * members

    def value(self, member: int) -> float:
        tokens, steps = self.prior
        return (self.tokens[member] + tokens) / (self.decoded[member] + steps)

    def step(self, offered: list[int], decoded: list[int]) -> None:
        for member in offered:
            self.offered[member] += 1
        for member in decoded:
            self.decoded[member] += 1

    def credit(self, landed: list[int]) -> None:
        """Accepted tokens only each member drafted this step (only members with a window count)."""
        for member, count in enumerate(landed):
            if self.offered[member]:
                self.tokens[member] += count


def member_labels(names: list[str]) -> list[str]:
    """Names, numbered from the second time one repeats: [trie, lookahead, trie] -> [trie, lookahead, trie#2]."""
    seen: Counter[str] = Counter()
    labels = []
    for name in names:
        seen[name] += 1
        labels.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return labels


def stack_aux(blocks: list[AuxBlock], owners: list[str]) -> AuxBlock:
    """Several members' aux rows as one block: rows one after the other, each block seeing only itself."""
    if len(blocks) == 1:
        return blocks[0]
    if len({b.sees_root for b in blocks}) > 1:
        raise ConfigError(f"hybrid members {owners} ask for aux rows that disagree on seeing the root; "
                          "use at most one of them")
    return AuxBlock([t for b in blocks for t in b.tokens], [o for b in blocks for o in b.offsets],
                    torch.block_diag(*[b.attends for b in blocks]), blocks[0].sees_root)


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


# The hybrid's tuned knobs for built-in members, applied under the member's own knobs.
# Chosen on SmolLM2-135M, 2-thread CPU: deep single drafts from prompt lookup, a wider trie
# than alone (the sizing prunes it), a recycling tree wide at the root. A lookahead member
# offers its window on every step (idle_every=1): the hybrid decides whether the rows pay.
MEMBER_DEFAULTS: dict[str, dict[str, Any]] = {
    "prompt_lookup": dict(max_ngram=4, min_ngram=1, draft_len=12, num_candidates=4),
    "trie": dict(decoding_length=24, branch_length=10, persist=True),
    "recycling": dict(successors=8, widths=[4, 2, 2, 1, 1, 1, 1, 1]),
    "retrieval": dict(max_nodes=24, max_depth=10),
    "lookahead": dict(idle_every=1),
}


def make_hybrid(drafters: list[Any] = ("prompt_lookup", "trie", "recycling"), max_rows: int = 32,
                datastore: str | None = None, prior_accepted: float = 1.0, prior_rejected: float = 1.0,
                adapt_costs: bool = False, registry: Registry | None = None) -> Hybrid:
    """Build the hybrid from member specs: registered strategy names or ``{name: ..., knobs...}``.

    Members are built through ``registry`` with the checks of a ``strategy=NAME`` node, over the
    hybrid's tuned defaults (``MEMBER_DEFAULTS``). ``datastore`` goes to every member that takes
    one and does not name its own.
    """
    from specfree.conf.nodes import as_node, checked_knobs

    if registry is None:
        raise ConfigError("the hybrid builds its members by name: build it through the registry "
                          "(Registry.make('strategy', 'hybrid', ...), Engine.from_model or a config)")
    if isinstance(drafters, (str, bytes)) or not isinstance(drafters, Sequence) or not drafters:
        raise ConfigError(f"hybrid.drafters must be a non-empty list of strategy names or {{name: ..., knobs}}, "
                          f"got {drafters!r}")
    members = []
    for i, spec in enumerate(drafters):
        where = f"hybrid.drafters[{i}]"
        node = as_node(spec, where)
        name = node["name"]
        if name not in registry.components["strategy"]:
            members = [n for n in registry.names("strategy") if not registry.get("strategy", n).composite]
            raise ConfigError(f"{where}: unknown strategy {name!r}; members can be: {', '.join(members)}")
        if registry.get("strategy", name).composite:
            raise ConfigError(f"{where} ({name}): a {name} cannot be a member of a hybrid; list its members "
                              "in this hybrid's drafters instead")
        knobs = checked_knobs(registry, "strategy", node, where, MEMBER_DEFAULTS.get(name, {}))
        if "datastore" in knobs and not knobs["datastore"] and datastore:
            knobs["datastore"] = datastore
        try:
            members.append(registry.make("strategy", name, **knobs))
        except ValueError as exc:  # the member's own refusal (a knob's range, a missing file)
            raise ConfigError(f"{where} ({name}): {exc}") from exc
    return Hybrid(members, max_rows=max_rows, acceptance=AcceptanceModel(prior_accepted, prior_rejected),
                  adapt_costs=adapt_costs)
