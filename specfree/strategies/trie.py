"""Trie drafting (Zhao et al., KDD 2024): a multi-branch draft tree from a token trie.

The trie holds n-grams of the current prompt and of past outputs; each step the longest
matching context suffix yields up to ``decoding_length`` nodes, best-first by frequency, as
one tree verified in a single forward. With ``persist`` the output n-grams outlive a request,
so the engine gets better at text like what it produced before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specfree.errors import ConfigError, check_float, check_int
from specfree.pools.trie import TriePool
from specfree.strategies.base import Outcome, Strategy
from specfree.types import Proposal


class TrieDrafter(Strategy):
    name = "trie"

    def __init__(self, pool: TriePool, decoding_length: int = 16, branch_length: int = 8,
                 persist: bool = True):
        self.pool = pool
        self.decoding_length = check_int("trie.decoding_length", decoding_length, low=1)
        self.branch_length = check_int("trie.branch_length", branch_length, low=1)
        self.persist = persist
        self._seen = 0  # committed tokens already inserted into the trie

    def begin(self, prompt: np.ndarray) -> None:
        if not self.persist:
            self.pool = TriePool(self.pool.max_nodes, self.pool.branch_length, self.pool.max_query_length,
                                 self.pool.decay)
        self.pool.begin_request(prompt.tolist())
        self._seen = len(prompt)

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        depth = min(self.branch_length, max_depth)
        if depth <= 0:
            return Proposal(source=self.name)
        return Proposal(self.pool.lookup(context, self.decoding_length, depth), source=self.name)

    def observe(self, outcome: Outcome) -> None:
        # Insert the windows that end in this step's new tokens, with enough history before them.
        history = self.pool.branch_length - 1
        lo = max(0, self._seen - history)
        self.pool.update(outcome.context[lo:].tolist(), source="output", start=self._seen - lo)
        self._seen = len(outcome.context)

    def end(self) -> None:
        self.pool.end_request()

    def stats(self) -> dict[str, float]:
        return {"pool_size": float(len(self.pool))}


def make_trie(decoding_length: int = 16, branch_length: int = 8, max_query_length: int = 8,
              max_nodes: int = 200_000, decay: float = 0.5, persist: bool = True,
              pool_file: str | None = None, pool: Any = None) -> TrieDrafter:
    """Build the strategy and its pool from plain knobs (``pool_file`` loads a saved trie).

    ``pool`` (``pool=trie`` in a config) replaces the pool these knobs would build: its own
    ``max_nodes``, ``branch_length``, ``max_query_length`` and ``decay`` apply instead.
    """
    if pool is not None:
        if not isinstance(pool, TriePool):
            raise ConfigError(f"the trie strategy drafts from a token trie: use pool=trie (or no pool), "
                              f"got {type(pool).__name__}")
        if pool_file:
            raise ConfigError("trie: give pool_file or a pool, not both")
    elif pool_file:
        pool = TriePool.load(pool_file)
    else:
        # Checked here, under the names the user typed; the pool's own checks would say trie_pool.
        check_int("trie.branch_length", branch_length, low=1)
        check_int("trie.max_query_length", max_query_length, low=1)
        check_int("trie.max_nodes", max_nodes, low=1)
        check_float("trie.decay", decay, low=0.0, high=1.0, low_open=True, high_open=True)
        # The trie must be deep enough to hold the matched query plus the draft after it.
        pool = TriePool(max_nodes=max_nodes, branch_length=max_query_length + branch_length,
                        max_query_length=max_query_length, decay=decay)
    return TrieDrafter(pool, decoding_length, branch_length, persist)
