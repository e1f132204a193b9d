"""Logits processors, built from plain knobs, in the order transformers' generate applies them."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specfree.errors import check_float, check_int


def build_processors(
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    extra: Sequence[LogitsProcessor] = (),
) -> LogitsProcessorList:
    """Processors first (penalties, user-supplied), then warpers, like ``generate``."""
    check_float("temperature", temperature, low=0.0, low_open=True)
    check_int("top_k", top_k, low=0)
    check_float("top_p", top_p, low=0.0, high=1.0, low_open=True)
    check_float("repetition_penalty", repetition_penalty, low=0.0, low_open=True)
    procs = LogitsProcessorList()
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    procs.extend(extra)
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs
