"""A ``Request``: what one caller asks of the decoding loop, typed and checked once.

The library (``Engine.generate``, ``stream``, ``generate_batch``) and ``serve`` both build
``Request``s and hand them to the one loop (``batching.Batch``): a request carries everything that
is its own (its prompt ids, its verifier, its stops, its budget), so nothing the loop shares, the
engine's verifier included, is ever swapped for one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specfree.errors import check_int


@dataclass(frozen=True)
class Request:
    """One request: its prompt ``ids`` (already checked against the model, ``Engine.check_ids``)
    and how to decode them.

    ``verifier``: this request's own (greedy or seeded sampling with its processors; None: the
    engine's), built for the call when it starts (``generation.for_call``); ``seed``: the sampling
    verifier's seed for this request; ``stop``: strings that end it; ``max_new_tokens``: its budget;
    ``ignore_eos``; ``logprobs``: None, or how many alternatives each token's log-probability
    carries; ``cache_prompt=False``: prefill the whole prompt even where a held prefix could be
    reused; ``constraint``: a structured-output constraint, handed to its ``Decoding``."""

    ids: tuple[int, ...]
    max_new_tokens: int = 128
    verifier: object | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_prompt: bool = True
    constraint: object | None = None

    def __post_init__(self):
        # A frozen dataclass sets its normalized fields through object.__setattr__.
        object.__setattr__(self, "ids", tuple(self.ids))
        object.__setattr__(self, "stop", _stops(self.stop))
        check_int("max_new_tokens", self.max_new_tokens, low=1)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, low=0)
        if self.seed is not None:
            check_int("seed", self.seed, low=0)  # the same range the sampling verifier's own seed takes


def _stops(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
