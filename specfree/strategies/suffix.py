"""SuffixDecoding (Oliaro et al., NeurIPS 2025; vLLM's ``suffix`` method).

Two suffix trees: one over the current request (prompt and output so far, extended per
accepted token) and a global one over previous requests' outputs (``SuffixTreePool``, bounded by
``max_cached_requests``). Each step, every suffix of the recent tokens that occurs in a tree
(up to ``max_tree_depth`` long) grows a speculation tree greedily by the continuations'
empirical frequencies, at most ``max_spec_factor * match length + max_spec_offset`` nodes, none
below ``min_token_prob``; the tree with the most expected accepted tokens is drafted.

The global store outlives requests: across ``generate`` calls of one engine, ``bench``'s prompts
and ``generate()`` calls through ``speculative_generate`` (they keep one drafter). With
``state_file`` it also outlives the process (a ``decode -m`` sweep's runs): loaded at setup if
the file exists, saved atomically when a request ends.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

from specfree.errors import ConfigError, check_float, check_int
from specfree.pools.suffix_tree import Draft, SuffixTreePool, SuffixTrie, tokenizer_fingerprint
from specfree.strategies.base import Outcome, Strategy
from specfree.types import Proposal


def match_bucket(match_len: int) -> str:
    """Match lengths by confidence class: 1, 2, 3, 4-7, 8-15, 16+ (pricing learns per class)."""
    for low in (16, 8, 4):
        if match_len >= low:
            return f"{low}+"
    return str(match_len)


def likeliest_first(draft: Draft) -> list[list[int]]:
    """The draft's root-to-leaf paths, the one that follows the likeliest child at every node first
    (what a model verifying one chain should get), then the others by the same order."""
    prob: dict[tuple[int, ...], float] = {}
    paths: list[tuple[int, ...]] = []
    for token, parent, p in zip(draft.tokens, draft.parents, draft.probs):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        prob[paths[-1]] = p
    # At the first depth two paths part, the likelier node wins (no leaf path is another's prefix).
    return sorted(draft.candidates(), key=lambda path: [-prob[tuple(path[: d + 1])] for d in range(len(path))])


class SuffixDecoding(Strategy):
    name = "suffix"

    def __init__(self, pool: SuffixTreePool, max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, num_speculative_tokens: int | None = None,
                 state_file: str | None = None, reset: bool = False, live_outputs: bool = True):
        self.pool = pool
        self.live_outputs = bool(live_outputs)
        self._response: int | None = None  # this request's output, streaming into the global tree
        self.max_spec_factor = check_float("suffix.max_spec_factor", max_spec_factor, low=0.0)
        self.max_spec_offset = check_float("suffix.max_spec_offset", max_spec_offset)
        self.min_token_prob = check_float("suffix.min_token_prob", min_token_prob, low=0.0, high=1.0)
        self.num_speculative_tokens = check_int("suffix.num_speculative_tokens", num_speculative_tokens, low=1,
                                                allow_none=True) or pool.max_tree_depth
        self.state_file = Path(state_file).expanduser() if state_file else None
        self.reset_state = reset
        self.local = SuffixTrie(pool.max_tree_depth)
        self._tokenizer = None
        self._fingerprint = b""
        self._vocab_size: int | None = None
        self._loaded = False
        self._seen = 0  # committed ids already in the request's trie
        self._output: list[int] = []

    def bind_tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def setup(self, vocab_size: int, max_length: int) -> None:
        # Called by every engine built around this drafter (``generate()`` builds one per call):
        # the state file is read once, then the store in memory is the state.
        self._vocab_size = vocab_size
        if self._loaded or self.state_file is None:
            return
        self._fingerprint = tokenizer_fingerprint(self._tokenizer)
        if self.state_file.exists() and not self.reset_state:
            self.pool.load(self.state_file, vocab_size, self._fingerprint)
        self._loaded = True

    def reset(self) -> None:
        """Forget every previous request (the state file is overwritten when the next request ends)."""
        self.pool.clear()

    def begin(self, prompt: np.ndarray) -> None:
        self.local = SuffixTrie(self.pool.max_tree_depth)
        self.local.append(prompt)
        self._seen = len(prompt)
        self._output = []
        self._response = self.pool.open_response() if self.live_outputs else None

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        if max_depth <= 0:
            return Proposal(source=self.name)
        knobs = (self.num_speculative_tokens, self.max_spec_factor, self.max_spec_offset, self.min_token_prob,
                 max_depth)
        # Every suffix of what the tries grew occurs: only the global trie's longer ones are searched.
        mine = len(context) == self._seen
        best, where = self.local.speculate(context, *knobs, matches=self.local.own_matches() if mine else None), "r"
        if len(self.pool):
            known = self.pool.response_matches(self._response) if mine else ()
            shared = self.pool.trie.speculate(context, *knobs, matches=self.pool.trie.matches(context, known))
            if shared.score > best.score:
                best, where = shared, "g"
        return self._proposal(best, where)

    def _proposal(self, draft: Draft, where: str) -> Proposal:
        candidates = likeliest_first(draft)
        # The tree (request or global) and the match length are the draft's confidence class; the
        # likeliest path and the branches off it are classes of their own, or a branch's misses
        # would teach pricing that the likeliest continuation is as unsure as the branches.
        label = f"{where}{match_bucket(draft.match_len)}"
        return Proposal(candidates, source=self.name, labels=[label] + [f"{label}~"] * (len(candidates) - 1))

    def observe(self, outcome: Outcome) -> None:
        new = outcome.context[self._seen :]
        self.local.append(new)
        self._seen = len(outcome.context)
        if self._response is not None:  # the output is held by the pool's open response
            self.pool.extend_response(self._response, new)
        else:
            self._output += new.tolist()

    def end(self) -> None:
        # The bonus token of the last step is the request's last output token: add it too.
        if self._response is not None:
            self.pool.close_response(self._response)
            self._response = None
        else:
            self.pool.add_request(self._output)
        self._output = []
        if self.state_file is not None and self._vocab_size is not None:
            self.pool.save(self.state_file, self._vocab_size, self._fingerprint)

    def fork(self) -> SuffixDecoding:
        """The same global store (its open responses keep concurrent requests apart, and each
        drafts from the others' outputs as they are written); a request trie of its own."""
        twin = copy.copy(self)
        twin.local, twin._response, twin._output, twin._seen = SuffixTrie(self.pool.max_tree_depth), None, [], 0
        return twin

    def stats(self) -> dict[str, float]:
        return {"global_nodes": float(len(self.pool)), "cached_requests": float(len(self.pool.requests)),
                "request_nodes": float(len(self.local))}


def make_suffix(max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                max_spec_offset: float = 0.0, min_token_prob: float = 0.1, num_speculative_tokens: int | None = None,
                max_nodes: int = 400_000, state_file: str | None = None, reset: bool = False,
                live_outputs: bool = True, pool: Any = None) -> SuffixDecoding:
    """Build the strategy and its global store from plain knobs (vLLM's names and defaults).

    ``max_nodes`` caps the global store's trie beside vLLM's request count (oldest requests go
    first). ``live_outputs``: each request's output enters the global tree as it is written (as in
    vLLM's ``suffix``), so concurrent requests draft from each other; false: only when it ends.
    ``pool`` (``pool=suffix_tree``) is a global store to use instead (its own ``max_tree_depth``,
    ``max_cached_requests`` and ``max_nodes`` apply).
    """
    if pool is not None:
        if not isinstance(pool, SuffixTreePool):
            raise ConfigError(f"the suffix strategy drafts from suffix trees: use pool=suffix_tree (or no pool), "
                              f"got {type(pool).__name__}")
    else:
        check_int("suffix.max_tree_depth", max_tree_depth, low=1)
        check_int("suffix.max_cached_requests", max_cached_requests, low=0)
        check_int("suffix.max_nodes", max_nodes, low=1)
        pool = SuffixTreePool(max_tree_depth, max_cached_requests, max_nodes)
    return SuffixDecoding(pool, max_spec_factor, max_spec_offset, min_token_prob, num_speculative_tokens,
                          state_file, reset, live_outputs)
