"""Prompt lookup: copy what followed earlier occurrences of the context's last n tokens.

Several matches are verified together as one tree, so when the text repeats itself in more
than one way the right continuation is still among the candidates. Over long prompts,
``pool=suffix_array`` finds the matches inside the prompt with a suffix array of it instead of
scanning it every step; the matches, and so the drafts, are the same.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from specfree.errors import ConfigError, check_int
from specfree.pools.prompt_index import PromptIndex
from specfree.strategies.base import Strategy
from specfree.types import Proposal

MATCH_ORDERS = ("recent", "longest", "frequent")


class PromptLookup(Strategy):
    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, draft_len: int = 10,
                 num_candidates: int = 1, match: str = "recent", pool: Any = None):
        self.max_ngram = check_int("prompt_lookup.max_ngram", max_ngram, low=1)
        self.min_ngram = check_int("prompt_lookup.min_ngram", min_ngram, low=1, high=max_ngram)
        self.draft_len = check_int("prompt_lookup.draft_len", draft_len, low=1)
        self.num_candidates = check_int("prompt_lookup.num_candidates", num_candidates, low=1)
        if match not in MATCH_ORDERS:
            raise ConfigError(f"prompt_lookup.match must be one of {list(MATCH_ORDERS)}, got {match!r}")
        self.match = match
        if pool is not None and not isinstance(pool, PromptIndex):
            raise ConfigError("prompt_lookup copies from the context itself; the one pool it takes is pool=suffix_array "
                              f"without pool.path (an index of the prompt), got {type(pool).__name__}")
        self.pool = pool
        self._prompt_len = 0

    def begin(self, prompt: np.ndarray) -> None:
        self._prompt_len = len(prompt)
        if self.pool is not None:
            self.pool.begin_request(prompt)

    def end(self) -> None:
        if self.pool is not None:
            self.pool.end_request()

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        depth = min(self.draft_len, max_depth)
        if depth <= 0:
            return Proposal(source=self.name)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            starts = self._match_starts(context, n)
            if starts.size:
                candidates, origins = self._rank(context, starts, n, depth)
                # Copying from the answer itself (a list, a repeated phrase) lands more often than from the prompt.
                labels = [f"n{n}{'out' if s >= self._prompt_len else ''}" for s in origins]
                return Proposal(candidates, source=self.name, labels=labels)
        return Proposal(source=self.name)

    def _match_starts(self, context: np.ndarray, n: int) -> np.ndarray:
        """Start indices i < len-n where context[i:i+n] equals the last n tokens, newest first."""
        if self.pool is None:
            return _scan(context, n, 0)
        # Windows that end inside the prompt come from its suffix array; later ones are scanned.
        first_scanned = max(0, self._prompt_len - n + 1)
        scanned = _scan(context, n, first_scanned)
        indexed = self.pool.occurrences(context[-n:])
        indexed = indexed[indexed < min(first_scanned, len(context) - n)]
        return np.concatenate([scanned, indexed[::-1]])

    def _rank(self, context: np.ndarray, starts: np.ndarray, n: int, depth: int):
        """(up to num_candidates distinct continuations, the match start each was copied from)."""
        if self.match == "recent":  # the newest distinct ones: read no further back than they are
            found: dict[tuple[int, ...], int] = {}
            for s in starts.tolist():
                found.setdefault(tuple(context[s + n : s + n + depth].tolist()), s)
                if len(found) == self.num_candidates:
                    break
            return [list(c) for c in found], list(found.values())
        pairs = [(context[s + n : s + n + depth].tolist(), int(s)) for s in starts]  # newest first
        newest: dict[tuple[int, ...], int] = {}  # continuation -> where its newest copy starts
        for continuation, start in pairs:
            newest.setdefault(tuple(continuation), start)
        if self.match == "longest":
            # Rank by how far the agreement with the context extends backwards (stable: newest on ties).
            pairs.sort(key=lambda pair: -self._agreement(context, pair[1] + n))
        elif self.match == "frequent":
            counts = Counter(tuple(c[:k]) for c, _ in pairs for k in (1, 2, 3))
            pairs.sort(key=lambda pair: [-counts[tuple(pair[0][:k])] for k in (1, 2, 3)])
        unique = list(dict.fromkeys(tuple(c) for c, _ in pairs))[: self.num_candidates]
        return [list(c) for c in unique], [newest[c] for c in unique]

    @staticmethod
    def _agreement(context: np.ndarray, end: int, cap: int = 64) -> int:
        """Length of the common suffix of context[:end] and context (at most ``cap``)."""
        a = context[max(0, end - cap) : end][::-1]
        b = context[len(context) - len(a) :][::-1]
        diff = np.flatnonzero(a != b)
        return int(diff[0]) if diff.size else len(a)


def _scan(context: np.ndarray, n: int, start: int) -> np.ndarray:
    """Start indices i >= start of windows of context[:-1] equal to its last n tokens, newest first."""
    stop = len(context) - n  # the last window ends just before the final token
    if stop <= start:
        return np.empty(0, dtype=np.int64)
    tail = context[-n:]
    # Positions of the first token, then narrowed one token at a time: a handful survive the first
    # comparison, where comparing every window whole costs an [L, n] array each step.
    starts = np.flatnonzero(context[start:stop] == tail[0]) + start
    for j in range(1, n):
        starts = starts[context[starts + j] == tail[j]]
    return starts[::-1]
