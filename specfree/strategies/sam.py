"""SAM-Decoding (Hu et al., ACL 2025): draft what followed the longest earlier match of the text.

Two sources are matched against the end of the current text every step:
- dynamic: a suffix automaton over the request's own text (prompt + output), extended by each
  accepted token; the match is tracked incrementally (``specfree.pools.suffix_automaton``);
- static (optional): a corpus, the ``datastore`` file of ``python -m specfree datastore build``.
  Its suffix array answers the same longest-match query by binary search (instead of the
  paper's static automaton), bounded incrementally: a match can grow by at most the tokens
  added since the last step.

As in the paper's code, the draft is the ``draft_len`` tokens after the match's first occurrence,
the dynamic match wins unless the static one is longer by more than ``bias``, and when the chosen
match is shorter than ``threshold`` the step is drafted by the ``fallback`` strategy instead
(Token Recycling, as the paper; any registered strategy, or none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from specfree.errors import ConfigError, check_int
from specfree.pools.suffix_automaton import SuffixAutomatonPool
from specfree.strategies.base import Outcome, Strategy
from specfree.types import Proposal

if TYPE_CHECKING:  # the suffix array brings numba: imported where a corpus is loaded
    from specfree.pools.suffix_array import SuffixArrayPool
    from specfree.registry import Registry


def length_class(length: int) -> str:
    """A match length as a confidence class for pricing: 1, 2-3, 4-7, 8-15, 16+."""
    return str(1 << min(4, max(0, length.bit_length() - 1)))


class SamDrafter(Strategy):
    name = "sam"

    def __init__(self, pool: SuffixAutomatonPool, corpus: SuffixArrayPool | None = None,
                 fallback: Strategy | None = None, draft_len: int = 10, threshold: int = 4, bias: int = 4,
                 max_query_length: int = 64):
        self.pool = pool
        self.corpus = corpus
        self.fallback = fallback
        self.draft_len = check_int("sam.draft_len", draft_len, low=1)
        self.threshold = check_int("sam.threshold", threshold, low=1)
        self.bias = check_int("sam.bias", bias, low=0)
        self.max_query_length = check_int("sam.max_query_length", max_query_length, low=1)
        self._static_len = 0  # the static match's length at the last step
        self._seen = 0  # context length at the last step
        self._used_fallback = False
        self.counts = {"dynamic": 0, "static": 0, "fallback": 0}

    def setup(self, vocab_size: int, max_length: int) -> None:
        if self.corpus is not None and int(self.corpus.text.max()) >= vocab_size:
            raise ConfigError(f"sam: the datastore holds token id {int(self.corpus.text.max())} but the model's "
                              f"vocabulary has {vocab_size} ids: it was built with another tokenizer; rebuild it")
        if self.fallback is not None:
            self.fallback.setup(vocab_size, max_length)

    def begin(self, prompt: np.ndarray) -> None:
        self.pool.begin_request(prompt)
        self._static_len, self._seen = self.max_query_length, 0
        if self.fallback is not None:
            self.fallback.begin(prompt)

    def end(self) -> None:
        self.pool.end_request()
        if self.fallback is not None:
            self.fallback.end()

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        depth = min(self.draft_len, max_depth)
        self._used_fallback = False
        if depth <= 0:
            return Proposal(source=self.name)
        tokens, length = self.pool.draft(context, depth)
        kind = "dyn"
        static, static_len = self._static(context, depth)
        if static and static_len - self.bias > length:
            tokens, length, kind = static, static_len, "static"
        if tokens and length >= self.threshold:
            self.counts["dynamic" if kind == "dyn" else "static"] += 1
            return Proposal([tokens], source=self.name, labels=[f"{kind}{length_class(length)}"])
        if self.fallback is None:
            return Proposal(source=self.name)
        self._used_fallback = True
        self.counts["fallback"] += 1
        proposal = self.fallback.propose(context, max_depth)
        labels = [f"{self.fallback.name}:{label or ''}" for label in
                  (proposal.labels or [None] * len(proposal.candidates))]
        return Proposal(proposal.candidates, source=self.name, labels=labels, aux=proposal.aux)

    def _static(self, context: np.ndarray, depth: int) -> tuple[list[int], int]:
        """(what followed the first occurrence of the longest context suffix in the corpus, its length)."""
        if self.corpus is None:
            return [], 0
        # The longest match grows by at most the tokens added since the last step.
        bound = min(self.max_query_length, len(context), self._static_len + len(context) - self._seen)
        self._seen = len(context)
        length, first = self.corpus.longest_match(context, bound) if bound else (0, -1)
        self._static_len = length
        if not length:
            return [], 0
        start = first + length  # after the first occurrence, as on the dynamic side
        after = self.corpus.text[start : start + depth]
        stop = np.flatnonzero(after < 0)  # a document's end
        return after[: stop[0] if stop.size else len(after)].tolist(), length

    def observe(self, outcome: Outcome) -> None:
        if self.fallback is not None:
            # Its aux rows were decoded only on a step it drafted.
            aux = outcome.aux_logits if self._used_fallback else None
            self.fallback.observe(Outcome(outcome.tree, outcome.verdict, outcome.context, aux, outcome.tree_logits))

    def stats(self) -> dict[str, float]:
        out = {f"{k}_steps": float(v) for k, v in self.counts.items()}
        out["automaton_states"] = float(len(self.pool))
        if self.fallback is not None:
            out.update({f"{self.fallback.name}.{k}": v for k, v in self.fallback.stats().items()})
        return out


def make_sam(draft_len: int = 10, threshold: int = 4, bias: int = 4, fallback: str | None = "recycling",
             datastore: str | None = None, max_query_length: int = 64, pool: Any = None,
             registry: Registry | None = None) -> SamDrafter:
    """``strategy=sam``: ``fallback`` names a registered strategy (built at its own defaults) or is
    null for none; ``datastore`` is the static corpus; ``pool`` (``pool=suffix_automaton``) the
    dynamic automaton with its own knobs."""
    from specfree.pools.prompt_index import suffix_array_pool

    if pool is None:
        pool = SuffixAutomatonPool()
    elif not isinstance(pool, SuffixAutomatonPool):
        raise ConfigError(f"sam drafts from a suffix automaton: use pool=suffix_automaton (or no pool), "
                          f"got {type(pool).__name__}")
    corpus = None
    if datastore:
        corpus = suffix_array_pool(datastore)  # the pool group's loader, with its file checks
    built = None
    if fallback not in (None, "", "none"):
        if registry is None:
            raise ConfigError("sam builds its fallback by name: build it through the registry "
                              "(Registry.make('strategy', 'sam', ...), Engine.from_model or a config)")
        if fallback not in registry.components["strategy"] or registry.get("strategy", fallback).composite:
            simple = [n for n in registry.names("strategy") if not registry.get("strategy", n).composite]
            raise ConfigError(f"sam.fallback must be null or a strategy that holds no members: "
                              f"{', '.join(simple)}; got {fallback!r}")
        try:
            built = registry.make("strategy", fallback)
        except ValueError as exc:  # e.g. retrieval without a datastore
            raise ConfigError(f"sam.fallback={fallback}: {exc}") from exc
    return SamDrafter(pool, corpus, built, draft_len, threshold, bias, max_query_length)
