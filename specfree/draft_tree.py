"""Draft trees: candidate continuations merged so shared prefixes are verified once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class DraftTree:
    """Node 0 is the root (the last committed token); every other node is a drafted token.

    Nodes are in topological order (a parent precedes its children), so ``depth`` and the
    ancestor sets can be built in one pass.
    """

    tokens: list[int]
    parents: list[int]  # parents[0] == -1
    depths: list[int]
    children: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node
    sources: list[str] = field(default_factory=list)  # which drafter proposed each node

    @classmethod
    def root_only(cls, root_token: int) -> "DraftTree":
        return cls([root_token], [-1], [0], {}, ["root"])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    def add(self, parent: int, token: int, source: str = "") -> int:
        """Return the child of ``parent`` carrying ``token``, creating it if needed."""
        node = self.children.get((parent, token))
        if node is None:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.children[(parent, token)] = node
            self.sources.append(source)
        return node

    def chain(self, max_depth: int | None = None) -> "DraftTree":
        """The path of first children from the root, at most ``max_depth`` deep: candidates are
        merged best first, so it is the best candidate (for models that verify one chain a step)."""
        first_child: dict[int, int] = {}
        for node in range(len(self.tokens) - 1, 0, -1):
            first_child[self.parents[node]] = node  # walking backwards, the lowest index wins
        chain = DraftTree.root_only(self.tokens[0])
        node = tip = 0
        while node in first_child and (max_depth is None or chain.depths[tip] < max_depth):
            node = first_child[node]
            tip = chain.add(tip, self.tokens[node], self.sources[node] if self.sources else "")
        return chain

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to ``node`` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def merge(root_token: int, candidates: Iterable[tuple[Sequence[int], str]], budget: int,
          max_depth: int | None = None) -> DraftTree:
    """Merge candidate continuations, best first, into one tree of at most ``budget`` drafted nodes.

    A candidate that no longer fits is cut where the budget runs out (its prefix is still
    worth verifying); shared prefixes cost nothing extra.
    """
    tree = DraftTree.root_only(root_token)
    for tokens, source in candidates:
        node = 0
        for depth, token in enumerate(tokens, start=1):
            if max_depth is not None and depth > max_depth:
                break
            if (node, token) not in tree.children and tree.num_drafted >= budget:
                break
            node = tree.add(node, int(token), source)
        if tree.num_drafted >= budget and budget > 0:
            # Nothing new can be added; later candidates may still share prefixes, but they
            # would add no node, so stop early.
            break
    return tree
