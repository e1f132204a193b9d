"""A suffix array over each request's prompt: where the context's last tokens occurred in it.

Prompt lookup scans the whole context for its last n tokens every step; over a prompt of
many thousand tokens (RAG, summarization) that scan is the drafter's cost. With this pool it
binary-searches the prompt's suffix array instead and scans only the output, giving the same
match positions. ``pool=suffix_array`` without ``pool.path`` is this pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specfree.errors import ConfigError

if TYPE_CHECKING:  # imported where first used: it brings numba, which a decode without it need not load
    from specfree.pools.suffix_array import SuffixArrayPool


class PromptIndex:
    """The Pool contract over a suffix array rebuilt at every ``begin_request``."""

    def __init__(self) -> None:
        self.index: SuffixArrayPool | None = None
        self.prompt_len = 0

    def begin_request(self, prompt: Sequence[int]) -> None:
        from specfree.pools.suffix_array import SuffixArrayPool

        ids = np.asarray(prompt, dtype=np.int64)
        self.prompt_len = len(ids)
        self.index = SuffixArrayPool.build([ids], min_query_length=1) if len(ids) else None

    def end_request(self) -> None:
        self.index = None  # a long prompt's index is not worth keeping between requests

    def occurrences(self, pattern: Sequence[int]) -> np.ndarray:
        """Sorted start positions of ``pattern`` inside the prompt."""
        if self.index is None:
            return np.empty(0, dtype=np.int64)
        return self.index.occurrences(pattern)

    def lookup(self, context: Sequence[int], max_nodes: int, max_depth: int) -> list[list[int]]:
        return [] if self.index is None else self.index.lookup(context, max_nodes, max_depth)

    def update(self, tokens: Sequence[int], *, source: str = "output") -> None:
        """No-op: only the prompt is indexed (the output is short enough to scan)."""

    def __len__(self) -> int:
        return self.prompt_len


def suffix_array_pool(path: str | None = None, mmap: bool = True, verify: bool = True) -> SuffixArrayPool | PromptIndex:
    """``pool=suffix_array``: a saved datastore with ``path`` (strategy=retrieval), else an index of
    each request's prompt (strategy=prompt_lookup over long prompts)."""
    if path is None:
        return PromptIndex()
    if not Path(path).expanduser().is_file():
        raise ConfigError(f"datastore file not found: {path} "
                          "(build one with: python -m specfree datastore build input=CORPUS out=PATH)")
    from specfree.pools.suffix_array import SuffixArrayPool

    return SuffixArrayPool.load(Path(path).expanduser(), mmap=mmap, verify=verify)
