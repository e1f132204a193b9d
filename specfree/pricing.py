"""Pricing a step: which of a proposal's rows are worth their cost, for any drafter.

Every drafted node gets a probability of being emitted: the product, down its path, of the rate
at which tokens of its kind (drafter, label such as a prompt match's n-gram length, depth) were
accepted so far, learned online, with siblings sharing one token's worth of probability. A node
several drafters propose is a kind of its own, learned per set of drafters: agreement says more
than either drafter's own rate (a hybrid's lone depth-1 guesses landed 3% of the time on
Spec-Bench, those of two drafters 20%, of three 47%). Nodes
are kept best first while expected tokens per second, (1 + sum p) / cost(rows), rises on the
measured forward-cost curve. An aux block (lookahead's Jacobi window) is priced the same way,
credited with the accepted tokens only its drafter proposed per decoded block. A step whose drafts
do not pay is a plain one-row forward.

``price`` is a pure function of the proposal, the statistics and the curve; ``specfree.pricer``
holds the engine's state around it (``Pricer``: the statistics, learned after each step) and the
unpriced step (``as_proposed``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specfree.draft_tree import DraftTree
from specfree.types import AuxBlock, Proposal

MAX_DEPTH_BUCKET = 6
Path = tuple[int, ...]  # a drafted node, as the tokens from the root's first child down to it


class AcceptanceModel:
    """What drafts have been worth so far: P(a drafted token is accepted | its parent was), per
    (source, label, depth), Beta-smoothed; and per aux-block owner, the accepted tokens only that
    owner drafted per step its block was decoded, with an optimistic prior so a new block gets tried.

    A (source, label, depth) seen a few times is smoothed toward its source's rate at that depth
    over every label, not toward one half: a path's reach is a product over its depths, and a
    half-way prior at each of them made the deep nodes of a long copied span look several times
    less likely than they were (vLLM's chains, SuffixDecoding's labels: 5% predicted, 70% accepted).
    """

    def __init__(self, prior_accepted: float = 1.0, prior_rejected: float = 1.0,
                 window_prior_tokens: float = 2.0, window_prior_steps: float = 2.0):
        self.prior = (prior_accepted, prior_rejected)
        self.window_prior = (window_prior_tokens, window_prior_steps)
        self.counts: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.pooled: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])  # over labels
        self.window_tokens: Counter[str] = Counter()
        self.window_steps: Counter[str] = Counter()

    @staticmethod
    def key(source: str, label: str | None, depth: int) -> tuple[str, str, int]:
        return source, label or "", min(depth, MAX_DEPTH_BUCKET)

    def rate(self, source: str, label: str | None, depth: int) -> float:
        key = self.key(source, label, depth)
        accepted, rejected = self.counts.get(key, (0.0, 0.0))
        a, r = self.prior
        pooled_accepted, pooled_rejected = self.pooled.get((source, key[2]), (0.0, 0.0))
        mean = (pooled_accepted + a) / (pooled_accepted + pooled_rejected + a + r)
        return (accepted + (a + r) * mean) / (accepted + rejected + a + r)

    def record(self, source: str, label: str | None, depth: int, accepted: bool) -> None:
        key = self.key(source, label, depth)
        self.counts[key][0 if accepted else 1] += 1.0
        self.pooled[key[0], key[2]][0 if accepted else 1] += 1.0

    def window_value(self, owner: str) -> float:
        tokens, steps = self.window_prior
        return (self.window_tokens[owner] + tokens) / (self.window_steps[owner] + steps)

    def record_window(self, owner: str, decoded: bool, landed: int) -> None:
        """A step where ``owner`` offered a block: ``landed`` accepted tokens only it drafted."""
        self.window_tokens[owner] += landed
        self.window_steps[owner] += int(decoded)


@dataclass
class Plan:
    """The rows one step verifies and decodes, out of those its proposal offered."""

    tree: DraftTree  # root + the drafted nodes kept (parents first)
    parts: list[tuple[str, AuxBlock]]  # every aux block offered, with its owner (``Proposal.aux_parts``)
    windows: list[int]  # indices into ``parts`` of the blocks kept
    offered: int  # rows offered: root + distinct drafted nodes + every aux row
    nodes: dict[Path, Node] | None = None  # the proposal's drafted nodes as priced (``drafted_nodes``)
    # What pricing predicted (None: an unpriced plan, or rows priced as free): the forward's seconds
    # on the curve the step was priced on, and the drafted tokens expected accepted, in all and per
    # drafter (a node's drafter as the tree records it); the step's record puts them beside the
    # forward's measured time and the tokens accepted.
    predicted_s: float | None = None
    expected: float | None = None
    expected_by: dict[str, float] | None = None
    # The drafted nodes kept, each with the reach it was priced at and the reach its rates alone gave
    # (before ``Calibration``: what a calibration learns from).
    kept: list[tuple[Path, float, float]] | None = None

    @property
    def aux(self) -> AuxBlock | None:
        """The kept blocks as one block of aux rows, after the tree's."""
        kept = [self.parts[i] for i in self.windows]
        return AuxBlock.stack([block for _, block in kept], [owner for owner, _ in kept]) if kept else None

    @property
    def rows(self) -> int:
        return len(self.tree) + sum(len(self.parts[i][1]) for i in self.windows)

    def aux_logits(self, logits: torch.Tensor) -> list[torch.Tensor | None] | None:
        """Per offered block: its rows' logits out of the step's [rows, V], None for a block left out."""
        if not self.parts:
            return None
        out, first = [], len(self.tree)
        for index, (_, block) in enumerate(self.parts):
            kept = index in self.windows
            out.append(logits[first : first + len(block)] if kept else None)
            first += len(block) if kept else 0
        return out


def reach_probabilities(rate: dict[Path, float]) -> dict[Path, float]:
    """P(the model emits node's path) from each node's acceptance rate given its parent.

    Siblings exclude each other: the model emits one token. Rates learned per drafter are scaled
    accordingly, likeliest first (a second guess only counts where the first failed), so three
    drafters disagreeing do not add up to more than one expected token.
    """
    children: dict[Path, list[tuple[float, Path]]] = defaultdict(list)
    for path, r in rate.items():
        children[path[:-1]].append((r, path))
    reach: dict[Path, float] = {}
    frontier: list[tuple[Path, float]] = [((), 1.0)]
    while frontier:
        parent, p_parent = frontier.pop()
        left = 1.0  # probability mass the earlier siblings did not take
        for r, path in sorted(children.get(parent, ()), reverse=True):
            share = r * left
            left -= share
            reach[path] = p_parent * share
            frontier.append((path, reach[path]))
    return reach


AGREED = "agreed"  # the source of nodes several drafters propose (label: which ones, and the best one's kind)


@dataclass(slots=True)
class Node:
    """A distinct drafted node: the best rate of any candidate proposing it, that candidate's
    source and label, and every drafter proposing it."""

    rate: float
    source: str
    label: str | None
    sources: set[str]


def drafted_nodes(proposal: Proposal, acceptance: AcceptanceModel) -> dict[Path, Node]:
    """Every distinct drafted node, in one pass over the candidates (parents before children)."""
    nodes: dict[Path, Node] = {}
    labels = proposal.labels or [None] * len(proposal.candidates)
    learned: dict[tuple[str, str | None, int], float] = {}  # looked up once a step, by depth bucket
    for candidate, source, label in zip(proposal.candidates, proposal.candidate_sources(), labels):
        prefix: Path = ()
        tokens = candidate.tolist() if isinstance(candidate, np.ndarray) else candidate
        for depth, token in enumerate(tokens, 1):
            prefix += (int(token),)
            bucket = min(depth, MAX_DEPTH_BUCKET)
            r = learned.get((source, label, bucket))
            if r is None:
                r = learned[source, label, bucket] = acceptance.rate(source, label, bucket)
            node = nodes.get(prefix)
            if node is None:
                nodes[prefix] = Node(r, source, label, {source})
            else:
                node.sources.add(source)
                if r > node.rate:
                    node.rate, node.source, node.label = r, source, label
    return nodes


def agreed_label(node: Node) -> str:
    """The kind of a node several drafters propose: which drafters, and the kind of the likeliest
    one's own guess (two drafters agreeing after a long match are not two agreeing after one token)."""
    return f"{'+'.join(sorted(node.sources))}|{node.source}:{node.label or ''}"


def node_rates(proposal: Proposal, acceptance: AcceptanceModel, max_depth: int | None = None,
               nodes: dict[Path, Node] | None = None) -> dict[Path, tuple[float, str, str | None]]:
    """Every distinct drafted node (to ``max_depth``) -> (its rate, its source, label): the best rate
    any candidate proposing it has, or where several drafters propose it, the rate of their
    agreement (the source and label then the likeliest drafter's own, for the step's records)."""
    nodes = drafted_nodes(proposal, acceptance) if nodes is None else nodes
    rates = {}
    for path, node in nodes.items():
        if max_depth is not None and len(path) > max_depth:
            continue
        rate = node.rate
        if len(node.sources) > 1:  # only a hybrid's proposal has several drafters
            rate = acceptance.rate(AGREED, agreed_label(node), len(path))
        rates[path] = (rate, node.source, node.label)
    return rates


def best_chain(reach: dict[Path, float]) -> list[Path]:
    """The chain that follows the likeliest child from the root (for models verifying one chain)."""
    chain: list[Path] = []
    tip: Path = ()
    while True:
        children = [(p, path) for path, p in reach.items() if path[:-1] == tip]
        if not children:
            return chain
        tip = max(children)[1]
        chain.append(tip)


def price(root: int, proposal: Proposal, acceptance: AcceptanceModel, cost: Callable[[int], float] | None, *,
          max_depth: int, chain: bool = False, rollback: bool = False, shared_tokens: float = 0.0,
          calibration: Calibration | None = None, alone: bool = True) -> Plan:
    """The rows of ``proposal`` that maximise expected tokens per second, as a plan.

    ``shared_tokens``: tokens that other requests emit from the same step (a batch shares one
    forward), so a row is worth its cost to all of them, not to this request alone.

    ``cost(rows)`` is a forward's time (None: rows are free); ``proposal.max_rows`` caps the rows.
    ``chain``: the model verifies one chain, with no aux rows; with ``rollback`` a cut chain is
    priced one more forward of its kept rows (the model replays them). ``calibration``: what each
    kind of node's expected tokens turned out to be worth (None: as the rates say).

    A proposal of several drafters (a hybrid's) is also priced as each drafter's tree alone, with
    the same rates, its siblings its own: where one of them pays more than the merged tree, that
    tree runs. So the merged proposal never plans a step worse than its best member would
    (``alone=False``: the merged tree only, to measure what this buys).
    """
    parts = proposal.aux_parts()
    if not proposal.candidates and not parts:  # nothing offered (every plain step): the root alone
        return Plan(DraftTree.root_only(root), [], [], 1, {}, None if cost is None else cost(1), 0.0, {})
    nodes = drafted_nodes(proposal, acceptance)  # kept in the plan: learn reads the same table
    rates = node_rates(proposal, acceptance, max_depth, nodes)
    offered = 1 + len(rates) + sum(len(block) for _, block in parts)
    cost = StepPrices.of(cost)
    choice = Choice(cost, proposal.max_rows or 1 << 30, chain, rollback, shared_tokens, acceptance, calibration)
    best = choice.tree(rates, nodes, parts, range(len(parts)))
    members = dict.fromkeys(proposal.sources) if alone and proposal.sources is not None else {}
    if len(members) > 1:
        for member in members:
            own = {path: r for path, r in rates.items() if member in nodes[path].sources}
            lone = choice.tree(own, nodes, parts, [i for i, (owner, _) in enumerate(parts) if owner == member])
            if lone.score > best.score:
                best = lone
    tree = DraftTree.root_only(root)
    node_of: dict[Path, int] = {(): 0}
    expected_by: Counter[str] = Counter()
    for path, q, _ in best.nodes:
        node_of[path] = tree.add(node_of[path[:-1]], path[-1], rates[path][1])
        expected_by[rates[path][1]] += q
    return Plan(tree, parts, best.windows, offered, nodes, cost(best.rows) if cost is not None else None,
                float(sum(q for _, q, _ in best.nodes)), dict(expected_by), best.nodes)


class StepPrices:
    """A curve that prices many row counts at once (``many``), read once per step: the seconds of
    1..n rows computed together on first use, and looked up while the step is priced (a hybrid's
    step prices several trees on the same curve). The same numbers: every curve's ``many`` prices
    each count on its own."""

    def __init__(self, curve):
        self.curve = curve
        self._table = np.empty(0)

    @classmethod
    def of(cls, curve):
        return cls(curve) if getattr(curve, "many", None) is not None else curve

    def __call__(self, rows: int) -> float:
        return float(self.many(np.array([rows]))[0])

    def many(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        top = int(rows.max()) if len(rows) else 0
        if top > len(self._table):
            self._table = self.curve.many(np.arange(1, max(top, 2 * len(self._table)) + 1))
        return self._table[rows - 1]


def node_kind(node: Node) -> str:
    """What a drafted node's expected tokens are calibrated as: its drafter, or agreement."""
    return AGREED if len(node.sources) > 1 else node.source


class Calibration:
    """What each kind of node (``node_kind``) turned out to be worth: the tokens accepted over the
    tokens its reach probabilities expected, over the nodes steps ran, Beta-like smoothed toward 1.

    The rates are learned per drafter, label and depth, but a step's nodes are the ones that looked
    best, beside siblings from other drafters the reach model treats as independent: what they
    expect and what they get can part, per drafter. A node's reach is scaled by its kind's factor
    (never above its parent's)."""

    def __init__(self, prior_tokens: float = 4.0, low: float = 0.25, high: float = 2.0, memory: float | None = 30.0):
        self.prior, self.low, self.high = prior_tokens, low, high
        self.keep = 1.0 if memory is None else 1.0 - 1.0 / memory
        self.expected: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()

    def factor(self, kind: str) -> float:
        ratio = (self.accepted[kind] + self.prior) / (self.expected[kind] + self.prior)
        return min(self.high, max(self.low, ratio))

    def scaled(self, reach: dict[Path, float], nodes: dict[Path, Node]) -> dict[Path, float]:
        out: dict[Path, float] = {}
        factors: dict[str, float] = {}  # a step's nodes are of a few kinds
        for path in sorted(reach, key=len):  # parents first
            kind = node_kind(nodes[path])
            factor = factors.get(kind)
            if factor is None:
                factor = factors[kind] = self.factor(kind)
            out[path] = min(reach[path] * factor, out.get(path[:-1], 1.0))
        return out

    def record(self, plan: Plan, emitted: Sequence[int], accepted: int) -> None:
        """A step ran ``plan``'s tree; its first ``accepted`` emitted tokens were drafted."""
        if plan.nodes is None or plan.kept is None:
            return
        path = tuple(emitted[:accepted])
        if self.keep < 1.0:
            for counts in (self.expected, self.accepted):
                for kind in counts:
                    counts[kind] *= self.keep
        for node, _, raw in plan.kept:  # against the rates' own reach: the factor is what they lack
            kind = node_kind(plan.nodes[node])
            self.expected[kind] += raw
            self.accepted[kind] += float(path[: len(node)] == node)


@dataclass
class Candidate:
    """One tree a step could run: its nodes best first with their reach, its windows, rows and score."""

    nodes: list[tuple[Path, float, float]]  # best first: each with its reach as priced, and uncalibrated
    windows: list[int]
    rows: int
    score: float  # expected tokens per second


@dataclass
class Choice:
    """How a step's candidate trees are priced: the curve, the room, the model's verification."""

    cost: Callable[[int], float] | None
    room: int
    chain: bool
    rollback: bool
    shared_tokens: float
    acceptance: AcceptanceModel
    calibration: Calibration | None

    def tree(self, rates: dict[Path, tuple[float, str, str | None]], nodes: dict[Path, Node],
             parts: list[tuple[str, AuxBlock]], windows: Sequence[int]) -> Candidate:
        """The best tree out of ``rates``' nodes and the blocks ``windows`` of ``parts``."""
        raw = reach_probabilities({path: r for path, (r, _, _) in rates.items()})
        reach = raw if self.calibration is None else self.calibration.scaled(raw, nodes)
        if self.chain:
            ranked = [(path, reach[path]) for path in best_chain(reach)]
            windows = []
        else:
            # A child is never likelier than its parent, so any best-first prefix is a subtree.
            ranked = sorted(reach.items(), key=lambda item: (-item[1], len(item[0])))
        p = np.array([0.0] + [q for _, q in ranked])
        expected = 1.0 + np.cumsum(p)  # [k]: tokens expected from the first k nodes
        cost = self.cost or (lambda rows: 1.0)
        room, rollback = self.room, self.rollback

        def rate_of(k: int, extra_rows: int, extra_tokens: float) -> float:
            seconds = cost(k + 1 + extra_rows)
            if rollback:  # P(the chain is cut after exactly j nodes): its j + 1 kept rows run again
                seconds += sum(((p[j] if j else 1.0) - p[j + 1]) * cost(j + 1) for j in range(k))
            return (expected[k] + extra_tokens) / seconds

        many = getattr(cost, "many", None)  # a CostModel prices every k at once

        def best(extra_rows: int, extra_tokens: float) -> tuple[float, int]:
            most = max(0, min(len(ranked), room - 1 - extra_rows))
            if many is not None and not rollback:  # the same numbers as rate_of's, in one array
                rates_per_k = (expected[: most + 1] + extra_tokens) / many(np.arange(most + 1) + 1 + extra_rows)
            else:
                rates_per_k = [rate_of(k, extra_rows, extra_tokens) for k in range(most + 1)]
            k = int(np.argmax(rates_per_k))
            return float(rates_per_k[k]), k

        kept_windows: list[int] = []
        rows, tokens = 0, float(self.shared_tokens)
        score, k = best(0, tokens)
        for index in windows:
            owner, block = parts[index]
            value = self.acceptance.window_value(owner)
            with_window = best(rows + len(block), tokens + value)
            if rows + len(block) < room and with_window[0] > score:
                kept_windows.append(index)
                rows += len(block)
                tokens += value
                score, k = with_window
        return Candidate([(path, q, raw[path]) for path, q in ranked[:k]], kept_windows, k + 1 + rows, score)
