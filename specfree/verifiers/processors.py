"""Logits processors, built from plain knobs, in the order transformers' generate applies them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
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


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's presence and frequency penalties: a token's score less ``presence`` once it has
    appeared and ``frequency`` times the number of times it appeared, counted over the generated
    tokens only (the ids past the first ``prompt_len``)."""

    def __init__(self, presence: float, frequency: float, prompt_len: int):
        self.presence, self.frequency, self.prompt_len = float(presence), float(frequency), int(prompt_len)

    def __call__(self, input_ids, scores):
        made = input_ids[:, self.prompt_len :]
        if made.numel() == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, made, torch.ones_like(made, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class LogitBias(LogitsProcessor):
    """OpenAI's ``logit_bias``: a fixed amount added to chosen tokens' scores (-100 bans, 100 forces)."""

    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.ids.to(scores.device)] += self.values.to(scores.device, scores.dtype)
        return scores
