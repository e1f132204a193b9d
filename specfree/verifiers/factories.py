"""Verifiers built from plain sampling knobs (what configs and ``Engine.from_pretrained`` pass).

A knob left at ``None`` is unset: the engine fills it from the model's ``generation_config``
(``specfree.generation``), else it changes nothing (temperature 1, no top-k, top-p 1, no penalty).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import LogitsProcessor

from specfree.errors import check_int
from specfree.verifiers.greedy import GreedyVerifier
from specfree.verifiers.processors import build_processors
from specfree.verifiers.sampling import SamplingVerifier


def greedy(repetition_penalty: float | None = None,
           logits_processors: Sequence[LogitsProcessor] = ()) -> GreedyVerifier:
    return GreedyVerifier(build_processors(repetition_penalty=_or(repetition_penalty, 1.0), extra=logits_processors))


def sampling(temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             repetition_penalty: float | None = None, seed: int = 0,
             logits_processors: Sequence[LogitsProcessor] = ()) -> SamplingVerifier:
    processors = build_processors(_or(temperature, 1.0), _or(top_k, 0), _or(top_p, 1.0),
                                  _or(repetition_penalty, 1.0), logits_processors)
    return SamplingVerifier(processors, seed=check_int("seed", seed, low=0))


def _or(value, neutral):
    return neutral if value is None else value
