"""A suffix automaton over a growing token text: the longest suffix that occurred before, in O(1).

The automaton (Blumer et al.; the structure SAM-Decoding drafts from, Hu et al., ACL 2025) has
one state per class of substrings sharing their end positions; each state keeps its longest
length, its suffix link and the end of its FIRST occurrence, which never changes as the text
grows (a clone copies its original's). Appending a token costs amortised O(1), and so does
tracking the match: the longest suffix of the text that also ends at an earlier position. The
tokens that followed that earlier occurrence are a draft.

``SuffixAutomatonPool`` is the Pool contract over it: it follows the context it is asked about
(extending itself by the new tokens, rebuilding only when the context is not its text plus
more), so any drafter can ask it for the continuation of the context's longest earlier match.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specfree.errors import check_int
from specfree.pools._common import as_tokens


class SuffixAutomaton:
    """The automaton of ``text`` and the tracked match of the text's end.

    ``match_length`` is the length of the longest suffix of the text that also ends at an
    earlier position, ``match_state`` its state (0, the root, for none) and
    ``first_end(state)`` the end index of that substring's first occurrence.
    """

    def __init__(self, tokens: Sequence[int] = ()):
        self.next: list[dict[int, int]] = [{}]  # per state: token -> state
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first: list[int] = [-1]  # end index of the first occurrence
        self.text: list[int] = []
        self.last = 0  # the state of the whole text
        self.match_state, self.match_length = 0, 0
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.text)

    @property
    def states(self) -> int:
        return len(self.length)

    def step(self, state: int, length: int, token: int) -> tuple[int, int]:
        """The match (state, length) after appending ``token`` to a match (state, length): follow
        suffix links until ``token`` extends it; (0, 0) when no suffix does."""
        while state and token not in self.next[state]:
            state = self.link[state]
            length = self.length[state]
        nxt = self.next[state].get(token)
        return (nxt, length + 1) if nxt is not None else (0, 0)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in as_tokens(tokens):
            # The match is advanced over the text WITHOUT the new token: it then ends earlier.
            self.match_state, self.match_length = self.step(self.match_state, self.match_length, token)
            self._add(token)
            # Adding may have split the match's state; its shorter strings moved to the clone.
            while self.match_state and self.match_length <= self.length[self.link[self.match_state]]:
                self.match_state = self.link[self.match_state]

    def _new_state(self, length: int, link: int, first: int, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first.append(first)
        return len(self.length) - 1

    def _add(self, token: int) -> None:
        end = len(self.text)
        self.text.append(token)
        cur = self._new_state(end + 1, 0, end, {})
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:  # q holds strings of several lengths: split off the shorter ones
                clone = self._new_state(self.length[p] + 1, self.link[q], self.first[q], dict(self.next[q]))
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def first_end(self, state: int) -> int:
        return self.first[state]

    def continuation(self, state: int, length: int, max_tokens: int, climb: bool = True) -> tuple[list[int], int]:
        """(what followed the first occurrence of the match, the match length it belongs to).

        The first occurrence of a long match may end just before the text's end, leaving few
        tokens after it; with ``climb`` (as SAM-Decoding does) shorter suffixes are tried, whose
        first occurrence lies earlier, until ``max_tokens`` follow or the root is reached.
        """
        n = len(self.text)
        while climb and state and n - 1 - self.first[state] < max_tokens and self.link[state] > 0:
            state = self.link[state]
            length = self.length[state]
        if not state:
            return [], 0
        start = self.first[state] + 1
        return self.text[start : start + max_tokens], length


class SuffixAutomatonPool:
    """``pool=suffix_automaton``: the automaton of each request's context (prompt + output so far).

    ``lookup(context, ...)`` answers for ``context``: when it is the automaton's text plus new
    tokens, only those are added; anything else (another request) rebuilds it. ``max_tokens``
    bounds memory: past it, the automaton is rebuilt over the text's last ``max_tokens // 2``
    tokens, amortised O(1) per token still.
    """

    def __init__(self, max_tokens: int = 1 << 16, climb: bool = True):
        self.max_tokens = check_int("suffix_automaton.max_tokens", max_tokens, low=2)
        self.climb = climb
        self.sam = SuffixAutomaton()
        self._offset = 0  # context index of the automaton's first token (after a trim)

    def sync(self, context: Sequence[int]) -> SuffixAutomaton:
        """The automaton over ``context``: extended by its new tokens, or rebuilt."""
        ctx = np.asarray(context)
        known = len(self.sam)
        # A new request calls begin_request; within one, checking the newest tokens suffices.
        tail = min(known, 32)
        if len(ctx) < self._offset + known or not np.array_equal(
                ctx[self._offset + known - tail : self._offset + known], self.sam.text[known - tail :]):
            self._offset, self.sam = max(0, len(ctx) - self.max_tokens // 2), SuffixAutomaton()
            known = 0
        self.sam.extend(ctx[self._offset + known :])
        if len(self.sam) > self.max_tokens:
            self._offset = len(ctx) - self.max_tokens // 2
            self.sam = SuffixAutomaton(ctx[self._offset :])
        return self.sam

    def draft(self, context: Sequence[int], max_depth: int) -> tuple[list[int], int]:
        """(continuation of the longest earlier match of ``context``'s end, that match's length)."""
        sam = self.sync(context)
        return sam.continuation(sam.match_state, sam.match_length, max_depth, self.climb)

    # --- the Pool protocol ------------------------------------------------------------------

    def lookup(self, context: Sequence[int], max_nodes: int, max_depth: int) -> list[list[int]]:
        tokens, _ = self.draft(context, min(max_nodes, max_depth))
        return [tokens] if tokens else []

    def update(self, tokens: Sequence[int], *, source: str = "output") -> None:
        """Append ``tokens`` to the text (``lookup`` also follows its context by itself)."""
        self.sam.extend(tokens)

    def begin_request(self, prompt: Sequence[int]) -> None:
        self._offset, self.sam = 0, SuffixAutomaton()
        self.sync(prompt)

    def end_request(self) -> None:
        self._offset, self.sam = 0, SuffixAutomaton()

    def __len__(self) -> int:
        """States in the automaton (at most twice the tokens it holds)."""
        return self.sam.states
