"""Verifiers built from plain sampling knobs (what configs and ``Engine.from_pretrained`` pass)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import LogitsProcessor

from specfree.errors import check_int
from specfree.verifiers.greedy import GreedyVerifier
from specfree.verifiers.processors import build_processors
from specfree.verifiers.sampling import SamplingVerifier


def greedy(repetition_penalty: float = 1.0, logits_processors: Sequence[LogitsProcessor] = ()) -> GreedyVerifier:
    return GreedyVerifier(build_processors(repetition_penalty=repetition_penalty, extra=logits_processors))


def sampling(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
             seed: int = 0, logits_processors: Sequence[LogitsProcessor] = ()) -> SamplingVerifier:
    processors = build_processors(temperature, top_k, top_p, repetition_penalty, logits_processors)
    return SamplingVerifier(processors, seed=check_int("seed", seed, low=0))
