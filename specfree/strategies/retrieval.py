"""Retrieval drafting (REST-like, training-free): continuations found in a token datastore.

The datastore is a suffix array over tokenized corpora, built once with
``python -m specfree datastore build``; each step the longest context suffix found in it
yields the most frequent continuations as one draft tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from specfree.errors import ConfigError, check_int
from specfree.pools.prompt_index import suffix_array_pool
from specfree.strategies.base import Strategy
from specfree.types import Proposal

if TYPE_CHECKING:
    from specfree.pools.suffix_array import SuffixArrayPool


class RetrievalDrafter(Strategy):
    name = "retrieval"

    def __init__(self, pool: SuffixArrayPool, max_nodes: int = 12, max_depth: int = 8):
        self.pool = pool
        self.max_nodes = check_int("retrieval.max_nodes", max_nodes, low=1)
        self.max_depth = check_int("retrieval.max_depth", max_depth, low=1)

    def setup(self, vocab_size: int, max_length: int) -> None:
        top = int(self.pool.text.max())
        if top >= vocab_size:
            raise ConfigError(f"the datastore holds token id {top} but the model's vocabulary has {vocab_size} "
                              "ids: it was built with another tokenizer; rebuild it for this model")

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        depth = min(self.max_depth, max_depth)
        if depth <= 0:
            return Proposal(source=self.name)
        return Proposal(self.pool.lookup(context, self.max_nodes, depth), source=self.name)

    def stats(self) -> dict[str, float]:
        return {"datastore_tokens": float(len(self.pool))}


def make_retrieval(datastore: str | None = None, max_nodes: int = 12, max_depth: int = 8,
                   max_query_length: int = 16, min_query_length: int = 2, pool: Any = None) -> RetrievalDrafter:
    """``pool`` (``pool=suffix_array pool.path=PATH`` in a config) is the datastore, instead of ``datastore``."""
    if pool is not None:
        from specfree.pools.suffix_array import SuffixArrayPool  # numba: loaded where a retrieval is built

        if not isinstance(pool, SuffixArrayPool):
            raise ConfigError("retrieval drafts from a datastore: give strategy.datastore=PATH (or pool=suffix_array "
                              f"pool.path=PATH), got a {type(pool).__name__} pool")
        if datastore:
            raise ConfigError("retrieval: give strategy.datastore or a pool=suffix_array, not both")
    elif not datastore:
        raise ConfigError("strategy=retrieval needs a datastore file: strategy.datastore=PATH "
                          "(build one with: python -m specfree datastore build input=CORPUS out=PATH)")
    else:
        pool = suffix_array_pool(datastore)  # the pool group's loader, with its file checks
    pool.max_query_length = check_int("retrieval.max_query_length", max_query_length, low=1)
    pool.min_query_length = check_int("retrieval.min_query_length", min_query_length, low=1,
                                      high=max_query_length)
    return RetrievalDrafter(pool, max_nodes, max_depth)
