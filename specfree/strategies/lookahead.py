"""Lookahead decoding (Fu et al., ICML 2024): a Jacobi window decoded alongside verification.

Every step the model decodes a 2D window of guesses (``masks/jacobi.py``) as auxiliary rows
in the same forward that verifies this step's candidates. The window's newest level becomes
one Jacobi iteration newer each step; each column then reads as an n-gram (first-level token
-> the tokens down the column + the new prediction), which goes into an n-gram pool. The
candidates verified are the pool's n-grams whose key is the root, merged into one tree.

Window life cycle, as in the reference implementation (``ALWAYS_FWD_ONE``): the window is
placed relative to the root and moves one position per step, however many tokens the
step accepted.

One departure, measured on a CPU where the row count prices a forward (``idle_every``): on a
step with no candidate to verify, the window rows would turn a 1-row forward into a
many-row one for n-grams that may never be used. ``idle_every=0`` decodes the window only
on steps that verify something (those already pay for a multi-row forward); the paper's
behaviour is ``idle_every=1``. Output is identical either way: window rows are never verified.

- ``begin``: level 0 holds ``window + ngram - 3`` prompt tokens (plus the root at column 0).
- warm-up (``ngram - 2`` steps): the argmax of the newest level, one column to the right,
  becomes a new level on top; every level drops its first column. Widths shrink to
  ``window`` columns as the levels grow to ``ngram - 1``.
- warm: column j yields the n-gram (cell (0, j), cells (1.., j), argmax of the newest cell);
  then level 0 goes, every level moves down one, and the argmaxes become the newest level.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from specfree.errors import ConfigError, check_int
from specfree.logits import greedy_ids
from specfree.masks.jacobi import max_offset, window_block
from specfree.strategies.base import Outcome, Strategy
from specfree.types import AuxBlock, Proposal

INITS = ("random", "recent")
# Chosen by a sweep on SmolLM2-135M, 2-thread CPU, 6 Spec-Bench prompts (one per task): small
# windows win there, because every extra row in a forward costs time and a 135M model's window
# n-grams are rarely accepted.
LOOKAHEAD_DEFAULTS = dict(window=2, ngram=3, guesses=2, pool_from_prompt=True, add_output=True,
                          init="recent", init_seed=0, pool_capacity=100_000, idle_every=0)


class Lookahead(Strategy):
    name = "lookahead"

    def __init__(self, pool, window: int = 2, ngram: int = 3, guesses: int | None = 2,
                 pool_from_prompt: bool = True, add_output: bool = True, init: str = "recent",
                 init_seed: int = 0, idle_every: int = 0):
        self.pool = pool
        self.window = check_int("lookahead.window", window, low=1)
        self.ngram = check_int("lookahead.ngram", ngram, low=2)
        self.guesses = check_int("lookahead.guesses", guesses, low=1, allow_none=True)
        if init not in INITS:
            raise ConfigError(f"lookahead.init must be one of {list(INITS)}, got {init!r}")
        self.init = init
        self.pool_from_prompt = bool(pool_from_prompt)
        self.add_output = bool(add_output)
        self.init_seed = check_int("lookahead.init_seed", init_seed, low=0)
        self.idle_every = check_int("lookahead.idle_every", idle_every, low=0)
        if idle_every == 0 and not (self.pool_from_prompt or self.add_output):
            raise ConfigError("lookahead.idle_every=0 decodes the window only on steps with candidates; with "
                              "pool_from_prompt and add_output both off the pool would never have any, so the "
                              "window would never run: set idle_every >= 1 or turn one of them on")
        self._idle = 0  # steps in a row with nothing to verify
        pool_ngram = getattr(pool, "ngram", None)
        if hasattr(pool, "add") and pool_ngram is not None and pool_ngram < ngram:
            raise ConfigError(f"lookahead.ngram={ngram} needs a pool that keeps {ngram}-grams; "
                              f"this pool keeps {pool_ngram}-grams (build it with ngram={ngram})")
        self.key_len = getattr(pool, "key_len", 1)
        # A pool that counts occurrences (trie) must be told where new tokens start.
        self._counts = "start" in inspect.signature(pool.update).parameters
        self.max_length = 1 << 62
        self.grid = np.zeros((1, 1), dtype=np.int64)  # [levels, columns]; (0, 0) is the root's slot
        self._step: tuple[int, bool, int, np.ndarray] | None = None  # root, decoded?, candidates, key lead
        self._seen = 0  # context tokens the pool has learned n-grams from
        self._last = {"window": 0.0, "levels": 0.0, "candidates": 0.0, "accepted": 0.0, "pool_size": 0.0}

    # ---- request lifecycle ---------------------------------------------------------------
    def setup(self, vocab_size: int, max_length: int) -> None:
        high = max_length - self.ngram + 1  # the widest window still fits after a 1-token prompt
        if high < 1:
            raise ConfigError(f"lookahead.ngram must be between 2 and {max_length} for a model whose "
                              f"context holds {max_length} tokens, got {self.ngram}")
        if self.window > high:
            raise ConfigError(f"lookahead.window must be between 1 and {high} for a model whose context "
                              f"holds {max_length} tokens (with ngram={self.ngram}), got {self.window}")
        self.max_length = max_length

    def begin(self, prompt: np.ndarray) -> None:
        # A pool may learn the prompt in begin_request (trie) or not (lru): giving it no prompt
        # there and learning it here keeps pool_from_prompt meaning the same for every pool.
        self.pool.begin_request(prompt[:0])
        if self.pool_from_prompt:
            self.pool.update(prompt, source="input")
        self._seen = len(prompt)
        columns = self.window + self.ngram - 2
        self.grid = np.zeros((1, columns), dtype=np.int64)
        self.grid[0, 1:] = self._initial_tokens(prompt, columns - 1)
        self._step = None
        self._idle = 0

    def _initial_tokens(self, prompt: np.ndarray, k: int) -> np.ndarray:
        if self.init == "random":
            return np.random.default_rng(self.init_seed).choice(prompt, size=k)
        return np.resize(prompt, max(k, len(prompt)))[-k:] if k else prompt[:0]  # the prompt's tail

    def end(self) -> None:
        self.pool.end_request()

    # ---- one step ------------------------------------------------------------------------
    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        depth = min(self.ngram - 1, max_depth)
        candidates: list[list[int]] = []
        if depth >= 1:
            g = self.guesses
            budget = self.max_length if g is None else g * depth
            candidates = self.pool.lookup(context, budget, depth)
            candidates = candidates if g is None else candidates[:g]
        levels, columns = self.grid.shape
        # Rows must sit inside the model's context; a window with nothing left to draft for
        # (the last token of the request) is not worth its rows.
        fits = len(context) + max_offset(columns, levels) < self.max_length
        aux = None
        self._idle = 0 if candidates else self._idle + 1
        idle_ok = bool(candidates) or (self.idle_every > 0 and self._idle % self.idle_every == 0)
        if fits and idle_ok and max_depth >= 1 and levels * columns > 1:
            block = window_block(columns, levels)
            aux = AuxBlock(self.grid.ravel()[1:].tolist(), block.offsets, block.attends, sees_root=True)
        lead = context[max(0, len(context) - self.key_len) : -1].copy()  # the key tokens before the root
        self._step = (int(context[-1]), aux is not None, len(candidates), lead)
        return Proposal(candidates, self.name, aux)

    def observe(self, outcome: Outcome) -> None:
        context = outcome.context
        if self.add_output and len(context) > self._seen:
            start = max(0, self._seen - self.key_len - self.ngram + 2)  # n-grams ending in new tokens
            if self._counts:
                self.pool.update(context[start:], source="output", start=self._seen - start)
            else:
                self.pool.update(context[start:], source="output")
        self._seen = len(context)
        if self._step is None:
            return
        root, decoded, candidates, lead = self._step
        rows = 0
        if decoded and outcome.aux_logits is not None:
            levels, columns = self.grid.shape
            block = window_block(columns, levels)
            rows = len(block)
            newest = np.asarray(greedy_ids(outcome.aux_logits[-block.top :]), dtype=np.int64)
            self.grid[0, 0] = root
            self._advance(newest, lead)
        self._last = {"window": float(rows), "levels": float(self.grid.shape[0]),
                      "candidates": float(candidates), "accepted": float(len(outcome.verdict.path)),
                      "pool_size": float(len(self.pool))}

    def _advance(self, newest: np.ndarray, lead: np.ndarray) -> None:
        """One Jacobi iteration: ``newest`` [top] are the argmaxes of the newest level's cells."""
        levels = self.grid.shape[0]
        if levels < self.ngram - 1:  # warm-up: grow a level, drop the first column
            new_level = newest if levels == 1 else newest[1:]
            self.grid = np.vstack([self.grid[:, 1:], new_level[None]])
            return
        if levels == 1:  # ngram == 2: the root's own prediction is no guess; keep a placeholder
            newest = np.concatenate([self.grid[0, :1], newest])
        ngrams = np.vstack([self.grid[1:], newest[None]]).T  # [columns, ngram - 1]
        self._harvest(ngrams, lead, first=1 if levels == 1 else 0)
        self.grid = np.vstack([self.grid[1:], newest[None]])

    def _harvest(self, ngrams: np.ndarray, lead: np.ndarray, first: int) -> None:
        """Column j's key: the ``key_len`` tokens ending at its first-level cell (``lead``: the
        up to key_len - 1 committed tokens before the root)."""
        k = self.key_len
        line = np.concatenate([lead, self.grid[0]]).tolist()  # ... root, (0,1), (0,2), ...
        shift = len(lead)
        add = getattr(self.pool, "add", None)
        for j in range(first, len(ngrams)):
            if j + shift + 1 < k:
                continue  # not enough tokens before this column for a key
            key = line[j + shift + 1 - k : j + shift + 1]
            cont = ngrams[j].tolist()
            if add is not None:
                add(key, cont)
            else:
                self.pool.update(key + cont, source="output")

    def stats(self) -> dict[str, float]:
        return dict(self._last)


def lookahead(window: int = 2, ngram: int = 3, guesses: int | None = 2, pool: Any = None,
              pool_from_prompt: bool = True, add_output: bool = True, init: str = "recent",
              init_seed: int = 0, pool_capacity: int | None = 100_000, idle_every: int = 0) -> Lookahead:
    """Build the strategy from plain knobs (what configs and the registry pass).

    ``pool``: the n-gram pool (``pool=lru|trie`` in a config). Without one, an LRU pool sized
    for the window: ``pool_capacity`` keys, each keeping at most ``guesses`` n-grams (None:
    unbounded).
    """
    from specfree.pools.lru import LRUNGramPool
    from specfree.pools.trie import TriePool

    ngram = check_int("lookahead.ngram", ngram, low=2)
    guesses = check_int("lookahead.guesses", guesses, low=1, allow_none=True)
    pool_capacity = check_int("lookahead.pool_capacity", pool_capacity, low=1, allow_none=True)
    if pool is None:
        pool = LRUNGramPool(key_len=1, max_per_key=guesses, max_keys=pool_capacity, ngram=ngram)
    elif not isinstance(pool, (LRUNGramPool, TriePool)):
        raise ConfigError(f"lookahead learns n-grams from its window into a pool that keeps them: use pool=lru or "
                          f"pool=trie, got {type(pool).__name__}")
    return Lookahead(pool, window=window, ngram=ngram, guesses=guesses, pool_from_prompt=pool_from_prompt,
                     add_output=add_output, init=init, init_seed=init_seed, idle_every=idle_every)
