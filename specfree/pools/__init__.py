"""N-gram pools behind the drafters: an LRU n-gram dict, a token trie, a suffix array."""

from specfree.pools.base import Pool, PoolFileError
from specfree.pools.lru import LRUNGramPool
from specfree.pools.suffix_array import SuffixArrayPool
from specfree.pools.trie import TriePool

__all__ = ["LRUNGramPool", "Pool", "PoolFileError", "SuffixArrayPool", "TriePool"]
