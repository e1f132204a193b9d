"""specfree's own components, registered through the same hook third-party plugins use."""

from __future__ import annotations

from specfree.hookspecs import hookimpl


@hookimpl
def specfree_register(registry) -> None:
    from specfree.adapters.hf import HFAdapter
    from specfree.masks.tree import build_layout
    from specfree.strategies.autoregressive import Autoregressive
    from specfree.strategies.prompt_lookup import PromptLookup
    from specfree.verifiers.factories import greedy, sampling

    registry.add("strategy", "autoregressive", Autoregressive)
    registry.add("strategy", "prompt_lookup", PromptLookup)
    registry.add("verifier", "greedy", greedy)
    registry.add("verifier", "sampling", sampling)
    registry.add("adapter", "hf", HFAdapter)
    registry.add("mask", "tree", build_layout)
