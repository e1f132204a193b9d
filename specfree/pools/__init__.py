"""N-gram pools behind the drafters: an LRU n-gram dict, a token trie, a suffix array.

The pools load on first use (PEP 562): the suffix array brings numba, about 0.1 s of start-up,
which a decode whose drafters keep no suffix array should not pay."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specfree.lazy_names import lazy_names

if TYPE_CHECKING:
    from specfree.pools.base import Pool, PoolFileError
    from specfree.pools.lru import LRUNGramPool
    from specfree.pools.suffix_array import SuffixArrayPool
    from specfree.pools.trie import TriePool

_HOMES = {"Pool": "specfree.pools.base", "PoolFileError": "specfree.pools.base", "LRUNGramPool": "specfree.pools.lru",
          "SuffixArrayPool": "specfree.pools.suffix_array", "TriePool": "specfree.pools.trie"}
__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_names(globals(), _HOMES)
