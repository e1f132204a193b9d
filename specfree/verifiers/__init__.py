"""Verifiers decide, from the target model's own logits, which drafted tokens are kept."""

from specfree.verifiers.greedy import GreedyVerifier
from specfree.verifiers.processors import build_processors
from specfree.verifiers.sampling import SamplingVerifier, position_uniform

__all__ = ["GreedyVerifier", "SamplingVerifier", "build_processors", "position_uniform"]
