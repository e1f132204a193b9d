"""Hybrid drafting: several drafters propose, and their drafts are merged into one proposal.

Members are any registered strategies, built by name through the registry with their own knobs
(``make_hybrid``). Every member's candidates go into one proposal, each labelled with its member
(``trie``, ``trie#2``...) and the member's own label, and every member's auxiliary rows
(lookahead's Jacobi window) go in as a block of their own. The engine prices that proposal like
any other (``specfree.pricing``): each node's probability is learned per member, label and depth,
siblings from disagreeing members share one token's probability, the tree grows only while
expected tokens per second rises, and a member's window is kept only while it pays. A member
whose window was left out gets no aux logits, so it knows the window was not decoded.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from specfree.errors import ConfigError, check_int
from specfree.strategies.base import Outcome, Strategy
from specfree.types import AuxBlock, Proposal

if TYPE_CHECKING:
    from specfree.registry import Registry


class Hybrid(Strategy):
    name = "hybrid"

    def __init__(self, drafters: list[Strategy], max_rows: int = 32, labels: list[str] | None = None):
        if not drafters:
            raise ConfigError("hybrid needs at least one drafter")
        self.drafters = drafters
        # Who drafted what: each member's name, numbered where a name repeats (trie, trie#2).
        self.labels = labels or member_labels([d.name for d in drafters])
        if len(self.labels) != len(drafters) or len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"hybrid: member labels must be distinct, one per drafter; got {self.labels}")
        self.max_rows = check_int("hybrid.max_rows", max_rows, low=1)
        self._window_members: list[int] = []  # the member of each aux block of the last proposal

    def bind_tokenizer(self, tokenizer) -> None:
        for drafter in self.drafters:
            drafter.bind_tokenizer(tokenizer)

    def setup(self, vocab_size: int, max_length: int) -> None:
        for drafter in self.drafters:
            drafter.setup(vocab_size, max_length)

    def begin(self, prompt: np.ndarray) -> None:
        for drafter in self.drafters:
            drafter.begin(prompt)

    def end(self) -> None:
        for drafter in self.drafters:
            drafter.end()

    def fork(self) -> Hybrid:
        """Each member forked (a suffix member keeps sharing its store)."""
        twin = copy.copy(self)
        twin.drafters = [drafter.fork() for drafter in self.drafters]
        twin._window_members = []
        return twin

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        candidates: list[list[int]] = []
        sources: list[str] = []
        labels: list[str | None] = []
        windows: list[tuple[str, AuxBlock]] = []
        self._window_members = []
        for member, (drafter, source) in enumerate(zip(self.drafters, self.labels)):
            proposal = drafter.propose(context, max_depth)
            candidates += proposal.candidates
            sources += [source] * len(proposal.candidates)
            labels += proposal.labels or [None] * len(proposal.candidates)
            if proposal.aux is not None and len(proposal.aux):
                windows.append((source, proposal.aux))
                self._window_members.append(member)
        return Proposal(candidates, self.name, sources=sources, labels=labels, windows=windows,
                        max_rows=self.max_rows)

    def observe(self, outcome: Outcome) -> None:
        # Each member sees only its own aux rows' logits; None tells it its window was not decoded.
        own = dict(zip(self._window_members, outcome.window_logits or []))
        for member, drafter in enumerate(self.drafters):
            drafter.observe(Outcome(outcome.tree, outcome.verdict, outcome.context, own.get(member),
                                    outcome.tree_logits))

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for drafter, label in zip(self.drafters, self.labels):
            out.update({f"{label}.{k}": v for k, v in drafter.stats().items()})
        return out


def with_member(proposal: Proposal, member: Proposal) -> Proposal:
    """``proposal`` with a member's candidates after its own, labelled with the member's source
    (how the engine adds a request's grammar drafter to any proposal)."""
    if not member.candidates:
        return proposal
    labels = (proposal.labels or [None] * len(proposal.candidates)) + (member.labels or [None] * len(member.candidates))
    return replace(proposal, candidates=proposal.candidates + member.candidates,
                   sources=proposal.candidate_sources() + [member.source] * len(member.candidates), labels=labels)


def member_labels(names: list[str]) -> list[str]:
    """Names, numbered from the second time one repeats: [trie, lookahead, trie] -> [trie, lookahead, trie#2]."""
    seen: Counter[str] = Counter()
    labels = []
    for name in names:
        seen[name] += 1
        labels.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return labels


# The hybrid's tuned knobs for built-in members, applied under the member's own knobs.
# Chosen on SmolLM2-135M, 2-thread CPU: deep single drafts from prompt lookup, a wider trie
# than alone (pricing prunes it), a recycling tree wide at the root. A lookahead member
# offers its window on every step (idle_every=1): pricing decides whether the rows pay.
MEMBER_DEFAULTS: dict[str, dict[str, Any]] = {
    "prompt_lookup": dict(max_ngram=4, min_ngram=1, draft_len=12, num_candidates=4),
    "trie": dict(decoding_length=24, branch_length=10, persist=True),
    "recycling": dict(successors=8, widths=[4, 2, 2, 1, 1, 1, 1, 1]),
    "retrieval": dict(max_nodes=24, max_depth=10),
    "lookahead": dict(idle_every=1),
    "sam": dict(fallback=None),  # the hybrid's other members draft where its match is short
}


# The default members: prompt lookup and SuffixDecoding. Replayed on Spec-Bench and code-edit runs
# (SmolLM2, Intel Xeon), with each step's drafting time added to its modelled forward, they beat
# the earlier default (prompt lookup, trie, recycling) by 3% and each member alone by 0.2-1%; on a
# curve as flat as float32 panels on Zen 3 too
# (docs/bench/history.md#the-hybrids-members-prompt-lookup-and-suffixdecoding-by-default-intel-xeon-2026-11-27).
DEFAULT_MEMBERS = ("prompt_lookup", "suffix")


def make_hybrid(drafters: list[Any] = DEFAULT_MEMBERS, max_rows: int = 32,
                datastore: str | None = None, registry: Registry | None = None) -> Hybrid:
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
            members = [n for n in registry.names("strategy") if registry.get("strategy", n).hybrid_member]
            raise ConfigError(f"{where}: unknown strategy {name!r}; members can be: {', '.join(members)}")
        if not registry.get("strategy", name).hybrid_member:
            raise ConfigError(f"{where} ({name}): a {name} cannot be a member of a hybrid; list its members "
                              "in this hybrid's drafters instead")
        knobs = checked_knobs(registry, "strategy", node, where, MEMBER_DEFAULTS.get(name, {}))
        if "datastore" in knobs and not knobs["datastore"] and datastore:
            knobs["datastore"] = datastore
        try:
            members.append(registry.make("strategy", name, **knobs))
        except ValueError as exc:  # the member's own refusal (a knob's range, a missing file)
            raise ConfigError(f"{where} ({name}): {exc}") from exc
    return Hybrid(members, max_rows=max_rows)
