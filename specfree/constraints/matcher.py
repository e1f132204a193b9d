"""One request's grammar state, kept in step with the tokens it has produced.

The verifier asks at every tree node it walks for the tokens allowed after that node's prefix
(``ConstraintMask``); the step's plan asks how much of each draft the grammar allows and what text
it forces next. The matcher follows whatever prefix it is asked about, consuming and rolling
back (llguidance's rollback keeps the whole history, so it costs the tokens undone, not the answer).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specfree.errors import ConfigError
from specfree.types import Proposal


class ConstraintError(RuntimeError):
    """The grammar rejected a token the decoding produced: a bug (the mask allows none such), so
    not a ``SpecfreeError`` (serve answers it with a 500, not a 400)."""


class Matcher:
    """llguidance's matcher for one request, with the tokens it has consumed (``consumed``) and the
    time spent in it (``spent_s``)."""

    def __init__(self, matcher, vocab_size: int, constraint):
        self._matcher, self.vocab_size, self.constraint = matcher, vocab_size, constraint
        self.consumed: list[int] = []
        # Tokens taken once the grammar had stopped (EOS only): llguidance accepts them without a step
        # it can roll back (rollback(k) would then undo k real tokens), so they are counted here instead.
        self._past_stop = 0
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._allowed: torch.Tensor | None = None  # the mask at ``consumed``, until it moves
        self._allowed_ids: np.ndarray | None = None  # its allowed ids, ascending
        self.spent_s = 0.0  # time in the grammar so far (following, masks, checks of drafts)

    def follow(self, tokens: Sequence[int]) -> None:
        """Move to the state after ``tokens`` (the answer so far), from wherever it is."""
        start = time.perf_counter()
        try:
            self._follow(tokens)
        finally:
            self.spent_s += time.perf_counter() - start

    def _follow(self, tokens: Sequence[int]) -> None:
        common = 0
        for mine, theirs in zip(self.consumed, tokens):
            if mine != theirs:
                break
            common += 1
        if common == len(self.consumed) == len(tokens):
            return
        self._allowed = self._allowed_ids = None
        if common < len(self.consumed):
            undo = len(self.consumed) - common
            past_stop = min(undo, self._past_stop)
            self._past_stop -= past_stop
            if undo > past_stop:
                self._matcher.rollback(undo - past_stop)
            del self.consumed[common:]
        for token in tokens[common:]:
            if self._matcher.is_stopped():
                if not self.allowed()[int(token)]:
                    raise ConstraintError(f"the {self.constraint.kind} is complete; it rejected token {token}")
                self._past_stop += 1  # the state, and so its mask, stays as it was
            elif not self._matcher.consume_token(int(token)):
                raise ConstraintError(f"the {self.constraint.kind} rejected token {token}: "
                                      f"{self._matcher.get_error()}")
            self.consumed.append(int(token))

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (EOS only where the answer may end)."""
        if self._allowed is None:
            start = time.perf_counter()
            self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size]
            self._allowed = torch.from_numpy(bits.astype(bool))
            self.spent_s += time.perf_counter() - start
        return self._allowed

    def allowed_ids(self) -> np.ndarray:
        """The ids ``allowed()`` allows, ascending."""
        if self._allowed_ids is None:
            self._allowed_ids = np.flatnonzero(self.allowed().numpy())
        return self._allowed_ids

    def allows(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here (without moving)."""
        if not len(tokens):
            return 0
        start = time.perf_counter()
        kept = self._matcher.validate_tokens([int(t) for t in tokens])
        self.spent_s += time.perf_counter() - start
        return kept

    def forced_bytes(self) -> bytes:
        """The bytes every answer allowed from here continues with."""
        start = time.perf_counter()
        forced = self._matcher.compute_ff_bytes()
        self.spent_s += time.perf_counter() - start
        return forced

    @property
    def stopped(self) -> bool:
        """Nothing but EOS can follow: the answer is complete."""
        return self._matcher.is_stopped()


class ConstraintMask(LogitsProcessor):
    """The first of a constrained request's processors: the scores of the tokens the grammar does
    not allow after ``input_ids`` set to -inf (``input_ids``: one row, the prompt then the answer)."""

    def __init__(self, matcher: Matcher, prompt_len: int):
        self.matcher, self.prompt_len = matcher, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._follow(input_ids)
        return scores.masked_fill(~self.matcher.allowed().to(scores.device), float("-inf"))

    def argmax(self, input_ids: torch.Tensor, scores: np.ndarray) -> int:
        """The argmax of ``scores`` [V] (float32) under the mask after ``input_ids``: the first maximal
        allowed entry, as ``self(input_ids, scores).argmax()`` finds it, read off the allowed ids
        alone (a fill of the whole row and an argmax over it cost several times the grammar's mask)."""
        self._follow(input_ids)
        ids = self.matcher.allowed_ids()
        return int(ids[scores[ids].argmax()]) if len(ids) else 0  # none allowed: the masked row's argmax, 0

    def _follow(self, input_ids: torch.Tensor) -> None:
        if input_ids.shape[0] != 1:
            raise ValueError("ConstraintMask follows one request: pass one row of ids")
        self.matcher.follow(input_ids[0, self.prompt_len :].tolist())


def prune(proposal: Proposal, matcher: Matcher) -> Proposal:
    """``proposal`` with each candidate cut where the grammar stops accepting it (no row is spent
    on a token the mask would forbid), and the candidates left empty dropped."""
    labels = proposal.labels or [None] * len(proposal.candidates)
    kept = [(list(c[: matcher.allows(c)]), source, label)
            for c, source, label in zip(proposal.candidates, proposal.candidate_sources(), labels)]
    kept = [k for k in kept if k[0]]
    return replace(proposal, candidates=[c for c, _, _ in kept], sources=[s for _, s, _ in kept],
                   labels=[label for _, _, label in kept] if proposal.labels is not None else None)


def masked(verifier, mask: ConstraintMask):
    """A copy of ``verifier`` whose processors start with the constraint's mask (the grammar first:
    penalties, temperature, top-k and top-p then see only the tokens it allows)."""
    if not hasattr(verifier, "processors"):
        raise ConfigError(f"the verifier {type(verifier).__name__} takes no logits processors, so it cannot "
                          "follow a constraint; use the greedy or sampling verifier")
    verifier = copy.copy(verifier)
    verifier.processors = LogitsProcessorList([mask, *verifier.processors])
    return verifier
