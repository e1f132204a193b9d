"""Token recycling (Luo et al., 2024): reuse the candidates every forward already computed.

Each row of every forward yields the model's top-k next tokens after that row's token. They
are kept in an adjacency matrix (token -> its latest top-k successors), and each step a
draft tree is grown from the root by following it: wide near the root, narrow deeper.
Nothing is trained and the table costs V x k ints.
"""

from __future__ import annotations

import numpy as np

from specfree.errors import ConfigError, check_int
from specfree.logits import top_ids
from specfree.strategies.base import Outcome, Strategy
from specfree.types import Proposal


class TokenRecycling(Strategy):
    name = "recycling"

    def __init__(self, successors: int = 8, widths: tuple[int, ...] | list[int] = (2, 1, 1, 1)):
        self.successors = check_int("recycling.successors", successors, low=1)
        widths = tuple(widths)
        if not widths or any(isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= successors
                             for w in widths):
            raise ConfigError(f"recycling.widths must be a non-empty list of integers between 1 and "
                              f"successors={successors}, got {list(widths)}")
        self.widths = widths
        self.table: np.ndarray | None = None  # [V, successors]: latest top successors, -1 where unknown
        self.known = 0  # tokens with a row in the table

    def setup(self, vocab_size: int, max_length: int) -> None:
        if self.table is None or self.table.shape[0] != vocab_size:
            self.table = np.full((vocab_size, self.successors), -1, dtype=np.int64)
            self.known = 0

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        candidates, labels = [], []
        widths, table = self.widths[: max(0, max_depth)], self.table
        # Depth-first over the static shape; a path is emitted when it cannot grow further.
        stack = [([], int(context[-1]), 0)]
        while stack:
            path, token, rank = stack.pop()
            depth = len(path)
            nexts = [t for t in table[token, : widths[depth]].tolist() if t >= 0] if depth < len(widths) else ()
            if not nexts and path:
                candidates.append(path)
                labels.append(f"rank{min(rank, 2)}")
            for r, t in reversed(list(enumerate(nexts))):
                stack.append((path + [t], t, max(rank, r)))
        return Proposal(candidates, source=self.name, labels=labels)

    def observe(self, outcome: Outcome) -> None:
        if outcome.tree_logits is None:
            return
        top = top_ids(outcome.tree_logits, self.successors).cpu().numpy()  # [T, k]
        tokens = np.asarray(outcome.tree.tokens)
        self.known += int(np.unique(tokens[self.table[tokens, 0] < 0]).size)
        # Later rows overwrite earlier ones for the same token: the deepest context wins.
        self.table[tokens] = top

    def stats(self) -> dict[str, float]:
        return {"known_tokens": float(self.known)}
