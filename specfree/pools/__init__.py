"""N-gram pools behind the drafters: an LRU n-gram dict, a token trie, a suffix array.

The pools load on first use (PEP 562): the suffix array brings numba, about 0.1 s of start-up,
which a decode whose drafters keep no suffix array should not pay."""

from importlib import import_module

_HOMES = {"Pool": "base", "PoolFileError": "base", "LRUNGramPool": "lru", "SuffixArrayPool": "suffix_array",
          "TriePool": "trie"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
