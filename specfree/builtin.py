"""specfree's own components, registered through the same hook third-party plugins use."""

from __future__ import annotations

from specfree.hookspecs import hookimpl


@hookimpl
def specfree_register(registry) -> None:
    from specfree.adapters.compiled import make_adapter
    from specfree.masks.tree import tree_mask
    from specfree.pools.lru import LRUNGramPool
    from specfree.pools.prompt_index import suffix_array_pool
    from specfree.pools.suffix_automaton import SuffixAutomatonPool
    from specfree.pools.suffix_tree import SuffixTreePool
    from specfree.pools.trie import TriePool
    from specfree.strategies.autoregressive import Autoregressive
    from specfree.strategies.logit_spec import LogitSpec
    from specfree.strategies.lookahead import LOOKAHEAD_DEFAULTS, lookahead
    from specfree.strategies.hybrid import make_hybrid
    from specfree.strategies.prompt_lookup import PromptLookup
    from specfree.strategies.recycling import TokenRecycling
    from specfree.strategies.retrieval import make_retrieval
    from specfree.strategies.sam import make_sam
    from specfree.strategies.suffix import make_suffix
    from specfree.strategies.trie import make_trie
    from specfree.verifiers.factories import greedy, sampling

    registry.add("strategy", "autoregressive", Autoregressive)
    registry.add("strategy", "prompt_lookup", PromptLookup)
    registry.add("strategy", "lookahead", lookahead, config=LOOKAHEAD_DEFAULTS)
    registry.add("strategy", "trie", make_trie)
    registry.add("strategy", "retrieval", make_retrieval)
    registry.add("strategy", "recycling", TokenRecycling)
    registry.add("strategy", "hybrid", make_hybrid)
    registry.add("strategy", "sam", make_sam, member=True)  # builds its fallback by name; no hybrid
    registry.add("strategy", "logit_spec", LogitSpec)
    registry.add("strategy", "suffix", make_suffix)
    registry.add("pool", "lru", LRUNGramPool)
    registry.add("pool", "trie", TriePool)
    registry.add("pool", "suffix_automaton", SuffixAutomatonPool)
    registry.add("pool", "suffix_tree", SuffixTreePool)
    # A suffix array is built from token ids, not from knobs: a saved datastore, or each prompt.
    registry.add("pool", "suffix_array", suffix_array_pool)
    registry.add("verifier", "greedy", greedy)
    registry.add("verifier", "sampling", sampling)
    registry.add("adapter", "hf", make_adapter)  # eager HFAdapter, or compiled as `compile` says
    registry.add("mask", "tree", tree_mask)
