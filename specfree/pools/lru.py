"""The lookahead-decoding n-gram pool (Fu et al. 2024): key tokens -> recent continuations.

Two levels of LRU keep memory bounded by ``max_keys * max_per_key`` continuations: each key
holds its ``max_per_key`` most recent continuations, and the table holds the ``max_keys``
most recently used keys. Both levels are OrderedDicts whose END is the most recent entry,
because appending and ``move_to_end`` are the cheap operations there (adds happen up to
W times per decoding step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from specfree.errors import check_int
from specfree.pools._common import as_tokens, fit_candidates

_NAME = "ngram_pool"


class LRUNGramPool:
    """Maps the last ``key_len`` tokens to up to ``max_per_key`` continuations of ``ngram-1`` tokens.

    A continuation moves to the front when it is added again; a key becomes most recent when
    it is added to or looked up. The pool lives across requests: make a new one for a cold start.
    """

    def __init__(self, key_len: int = 1, max_per_key: int | None = 8,
                 max_keys: int | None = 100_000, ngram: int = 4):
        self.key_len = check_int(f"{_NAME}.key_len", key_len, low=1)
        self.max_per_key = check_int(f"{_NAME}.max_per_key", max_per_key, low=1, allow_none=True)
        self.max_keys = check_int(f"{_NAME}.max_keys", max_keys, low=1, allow_none=True)
        self.ngram = check_int(f"{_NAME}.ngram", ngram, low=2)
        self._table: OrderedDict[tuple[int, ...], OrderedDict[tuple[int, ...], None]] = OrderedDict()
        self._size = 0  # continuations stored, over all keys

    def add(self, key: Sequence[int], continuation: Sequence[int]) -> None:
        """Remember that ``continuation`` (1 to ngram-1 tokens) followed ``key`` (key_len tokens)."""
        k, c = tuple(as_tokens(key)), tuple(as_tokens(continuation))
        if len(k) != self.key_len:
            raise ValueError(f"{_NAME}: key must hold key_len={self.key_len} tokens, got {len(k)}")
        if not 1 <= len(c) <= self.ngram - 1:
            raise ValueError(f"{_NAME}: continuation must hold 1 to ngram-1={self.ngram - 1} "
                             f"tokens, got {len(c)}")
        self._add(k, c)

    def _add(self, k: tuple[int, ...], c: tuple[int, ...]) -> None:
        table = self._table
        conts = table.get(k)
        if conts is None:
            conts = table[k] = OrderedDict()
            if self.max_keys is not None and len(table) > self.max_keys:
                _, evicted = table.popitem(last=False)
                self._size -= len(evicted)
        else:
            table.move_to_end(k)
        if c in conts:
            conts.move_to_end(c)
            return
        conts[c] = None
        self._size += 1
        if self.max_per_key is not None and len(conts) > self.max_per_key:
            conts.popitem(last=False)
            self._size -= 1

    def update(self, tokens: Sequence[int], *, source: str = "output") -> None:
        """Add every complete n-gram of ``tokens`` (``source`` is not used: all n-grams count alike)."""
        toks = as_tokens(tokens)
        kl, span = self.key_len, self.key_len + self.ngram - 1
        for i in range(len(toks) - span + 1):
            self._add(tuple(toks[i : i + kl]), tuple(toks[i + kl : i + span]))

    def lookup(self, context: Sequence[int], max_nodes: int, max_depth: int) -> list[list[int]]:
        if max_nodes < 1 or max_depth < 1 or len(context) < self.key_len:
            return []
        k = tuple(as_tokens(context[len(context) - self.key_len :]))
        conts = self._table.get(k)
        if not conts:
            return []
        self._table.move_to_end(k)  # a key that drafts is a key worth keeping
        return fit_candidates(reversed(conts), max_nodes, max_depth)

    def continuations(self, key: Sequence[int]) -> list[tuple[int, ...]]:
        """The continuations stored for ``key``, most recent first (does not touch LRU order)."""
        conts = self._table.get(tuple(as_tokens(key)))
        return list(reversed(conts)) if conts else []

    def keys(self) -> list[tuple[int, ...]]:
        """Stored keys, most recently used first."""
        return list(reversed(self._table))

    def begin_request(self, prompt: Sequence[int]) -> None:
        """Nothing to do: the drafter decides whether prompt n-grams go in (via ``update``)."""

    def end_request(self) -> None:
        """Nothing to do: n-grams stay for later requests."""

    def clear(self) -> None:
        self._table.clear()
        self._size = 0

    def __len__(self) -> int:
        return self._size
