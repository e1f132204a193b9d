"""LogitSpec (Liu et al., 2025): the last logits also guess the token after next.

The row that produced the root (the last step's bonus token) ranks every token as the root's
successor; its argmax is the root itself, and its runners-up are decent guesses of the token
after the root. Each step drafts, as one tree under the root:
- the continuation retrieved for the context itself (an n-gram table over prompt + output);
- for each of the row's top tokens (ranked, the root skipped), that token followed by the
  continuation retrieved for context + token, cut to a length that shrinks with the rank;
until ``draft_tree_capacity`` drafted tokens. Knob names are the paper code's. With a
``datastore`` (a ``datastore build`` file), a query the text has no n-gram for is looked up there
(the continuation of its longest suffix's first occurrence), as the paper's retrieval allows.

The n-gram table (``NGramTable``) maps every 1..``max_ngram_size``-gram of the text to the
``num_pred_tokens`` tokens after its latest occurrence that has the most of them, kept up to
date as tokens are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specfree.errors import ConfigError, check_int
from specfree.logits import top_ids
from specfree.pools._common import as_tokens
from specfree.strategies.base import Outcome, Strategy
from specfree.types import Proposal

if TYPE_CHECKING:  # the suffix array brings numba: imported where a corpus is loaded
    from specfree.pools.suffix_array import SuffixArrayPool


class NGramTable:
    """n-gram -> what followed its latest occurrence (the longest such continuation, newest on ties)."""

    def __init__(self, max_ngram_size: int, num_pred_tokens: int):
        self.max_ngram_size = max_ngram_size
        self.num_pred_tokens = num_pred_tokens
        self.text: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}

    def reset(self, tokens: Sequence[int]) -> None:
        self.text, self.table = [], {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        old = len(self.text)
        self.text += as_tokens(tokens)
        text, top = self.text, len(self.text)
        # Entries whose continuation grew (it ended within num_pred_tokens of the old end) or are new.
        for end in range(max(1, old - self.num_pred_tokens + 1), top):
            after = text[end : end + self.num_pred_tokens]
            for n in range(1, min(self.max_ngram_size, end) + 1):
                key = tuple(text[end - n : end])
                if len(after) >= len(self.table.get(key, ())):
                    self.table[key] = after

    def lookup(self, tail: Sequence[int]) -> tuple[list[int], int]:
        """(the continuation of the longest of ``tail``'s last 1..max_ngram_size tokens that has one, n)."""
        for n in range(min(self.max_ngram_size, len(tail)), 0, -1):
            found = self.table.get(tuple(tail[len(tail) - n :]))
            if found is not None:
                return found, n
        return [], 0


def rank_class(rank: int) -> str:
    """A top-k rank as a confidence class for pricing: 1, 2, 3-4, 5-8, 9-32, 33+."""
    for bound in (1, 2, 4, 8, 32):
        if rank <= bound:
            return str(bound)
    return "33+"


class LogitSpec(Strategy):
    name = "logit_spec"

    def __init__(self, max_ngram_size: int = 3, num_pred_tokens: int = 20, draft_tree_capacity: int = 64,
                 rank_bounds: Sequence[int] = (8, 32), rank_lengths: Sequence[int] = (4, 3, 1),
                 datastore: str | None = None):
        self.max_ngram_size = check_int("logit_spec.max_ngram_size", max_ngram_size, low=1)
        self.num_pred_tokens = check_int("logit_spec.num_pred_tokens", num_pred_tokens, low=1)
        self.draft_tree_capacity = check_int("logit_spec.draft_tree_capacity", draft_tree_capacity, low=1)
        self.rank_bounds, self.rank_lengths = list(rank_bounds), list(rank_lengths)
        if (len(self.rank_lengths) != len(self.rank_bounds) + 1
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                       for v in self.rank_bounds + self.rank_lengths)
                or self.rank_bounds != sorted(set(self.rank_bounds))):
            raise ConfigError(f"logit_spec.rank_lengths must hold one more length than rank_bounds has bounds "
                              f"(increasing), all whole numbers >= 1; got rank_bounds={self.rank_bounds}, "
                              f"rank_lengths={self.rank_lengths}")
        self.table = NGramTable(self.max_ngram_size, self.num_pred_tokens)
        self.corpus: SuffixArrayPool | None = None
        if datastore:
            from specfree.pools.prompt_index import suffix_array_pool

            self.corpus = suffix_array_pool(datastore)  # the pool group's loader, with its file checks
        self._top: list[int] = []  # the root's row's top tokens, best first
        self._top_for = -1  # the context length they belong to
        self._k = self.draft_tree_capacity

    def setup(self, vocab_size: int, max_length: int) -> None:
        self._k = min(self.draft_tree_capacity, vocab_size)
        if self.corpus is not None and int(self.corpus.text.max()) >= vocab_size:
            raise ConfigError(f"logit_spec: the datastore holds token id {int(self.corpus.text.max())} but the "
                              f"model's vocabulary has {vocab_size} ids: it was built with another tokenizer; rebuild it")

    def begin(self, prompt: np.ndarray) -> None:
        self.table.reset(prompt)
        self._top, self._top_for = [], -1

    def length_for(self, rank: int) -> int:
        """Tokens drafted for the guess of rank ``rank`` (0: the row's argmax), the guess included."""
        for bound, length in zip(self.rank_bounds, self.rank_lengths):
            if rank <= bound:
                return length
        return self.rank_lengths[-1]

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        if max_depth <= 0:
            return Proposal(source=self.name)
        if len(context) > len(self.table.text):  # a caller that skipped observe (the first step)
            self.table.extend(context[len(self.table.text):])
        tail = as_tokens(context[-self.max_ngram_size:])
        room = self.draft_tree_capacity
        candidates, labels = [], []
        found, n = self.lookup(tail)
        if found:
            first = found[: min(room, max_depth)]
            candidates.append(first)
            labels.append(f"next:{n}")
            room -= len(first)
        root = int(context[-1])
        guesses = self._top if self._top_for == len(context) else []
        for rank, token in enumerate(guesses):
            if room <= 0:
                break
            if token == root:  # the row's argmax (greedy): the root itself
                continue
            found, n = self.lookup(tail[1:] + [token] if len(tail) == self.max_ngram_size else tail + [token])
            draft = ([token] + found)[: min(self.length_for(rank), room, max_depth)]
            candidates.append(draft)
            labels.append(f"top{rank_class(rank)}:{n}")
            room -= len(draft)
        return Proposal(candidates, source=self.name, labels=labels)

    def lookup(self, tail: list[int]) -> tuple[list[int], str]:
        """(a continuation of ``tail``, its label: n-gram size, ``ds`` when from the datastore)."""
        found, n = self.table.lookup(tail)
        if found or self.corpus is None:
            return found, f"n{n}"
        n, start = self.corpus.longest_match(tail, self.max_ngram_size)
        if not n:
            return [], "n0"
        after = self.corpus.text[start + n : start + n + self.num_pred_tokens]
        stop = np.flatnonzero(after < 0)  # a document's end
        return after[: stop[0] if stop.size else len(after)].tolist(), f"ds{n}"

    def observe(self, outcome: Outcome) -> None:
        context = outcome.context
        self.table.extend(context[len(self.table.text):])
        self._top, self._top_for = [], -1
        if outcome.tree_logits is None:
            return
        path = outcome.verdict.path
        row = path[-1] if path else 0  # the row whose logits gave the bonus token, the next root
        self._top = top_ids(outcome.tree_logits[row : row + 1], self._k)[0].tolist()
        self._top_for = len(context)

    def stats(self) -> dict[str, float]:
        return {"ngrams": float(len(self.table.table))}
