"""The drafter contract: propose candidate continuations, then observe what was accepted."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from specfree.draft_tree import DraftTree
from specfree.types import Proposal, Verdict


@dataclass
class Outcome:
    """What a drafter learns after a step."""

    tree: DraftTree
    verdict: Verdict
    context: np.ndarray  # committed ids after this step (the last one is the next root)
    aux_logits: torch.Tensor | None  # [A, V] logits of the drafter's aux rows, if it had any
    tree_logits: torch.Tensor | None = None  # [T, V] logits of the tree rows (root first)
    # Per aux block of the proposal (``Proposal.aux_parts()``): its rows' logits, None where pricing
    # left it out of the step (a hybrid hands each member its own).
    window_logits: list[torch.Tensor | None] | None = None


class Strategy:
    """Base drafter: proposes nothing (which is plain autoregressive decoding).

    Subclasses override ``propose`` and, when they learn, ``observe``. ``begin``/``end`` bracket
    a request; state that should outlive requests (a persistent pool) survives ``end``.
    """

    name = "autoregressive"

    def bind_tokenizer(self, tokenizer) -> None:
        """Called by the engine before ``setup`` with its tokenizer (None with token ids only), for
        state that must match it (a saved store's fingerprint)."""

    def setup(self, vocab_size: int, max_length: int) -> None:
        """Called once by the engine with the model's limits, to validate knobs against them."""

    def begin(self, prompt: np.ndarray) -> None:
        """A request starts; ``prompt`` holds its ids."""

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        """Candidates to follow ``context`` (ids ending with the root), none deeper than ``max_depth``."""
        return Proposal(source=self.name)

    def observe(self, outcome: Outcome) -> None:
        """Learn from the step's result."""

    def end(self) -> None:
        """The request is over."""

    def fork(self) -> "Strategy":
        """A drafter for another request decoded at the same time (a batch's other places). The
        default is an independent copy; a drafter whose state outlives requests may share it
        instead, so that concurrent requests learn from each other (the suffix drafter's store)."""
        return copy.deepcopy(self)

    def stats(self) -> dict[str, float]:
        """Drafter-specific numbers recorded with each step (pool size, window...)."""
        return {}
