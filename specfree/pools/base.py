"""The contract every n-gram pool keeps.

A pool remembers token sequences and, given the context so far, returns candidate
continuations. Drafters own a pool; the engine never talks to pools directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from specfree.errors import SpecfreeError


class PoolFileError(SpecfreeError, ValueError):
    """A pool or datastore file is missing, truncated, or was not written by specfree."""


@runtime_checkable
class Pool(Protocol):
    def update(self, tokens: Sequence[int], *, source: str = "output") -> None:
        """Learn every n-gram of ``tokens``. ``source`` is "input" (prompt) or "output"."""

    def lookup(self, context: Sequence[int], max_nodes: int, max_depth: int) -> list[list[int]]:
        """Candidate continuations of ``context``, best first.

        Each candidate is the token list that would follow ``context``. Merged into a tree
        (shared prefixes counted once) they hold at most ``max_nodes`` tokens, and none is
        longer than ``max_depth``.
        """

    def begin_request(self, prompt: Sequence[int]) -> None:
        """A new request starts; ``prompt`` is its token ids."""

    def end_request(self) -> None:
        """The current request is over (pools may drop request-local state)."""

    def __len__(self) -> int:
        """How many entries (n-grams or trie nodes) the pool holds; bounded by its caps."""
