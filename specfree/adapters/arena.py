"""The KV of several sequences in one cache, so that one forward runs rows of all of them.

Every cache entry belongs to one sequence (``owner``). A step appends the rows of each sequence
after all the entries, and a mask lets each row see only its own sequence's entries (and, among the
step's rows, its own tree's): the mask one sequence would get alone (``Windows.mask``), spread over
the columns where its entries sit. Keeping the accepted rows moves them down, in order; a sequence
that leaves marks its entries dead, and the cache is compacted, in order. So a sequence's entries
are always in position order, though other sequences' entries sit between them.

That is all the row-exact attention operator needs to give each row the bits it has alone: a row's
result is a fixed sequence of operations over the keys it sees, in the order they sit, whatever
their slot (``kernels/tree_attention.cpp``); the linear kernels give each row the same bits
whatever the other rows. Sequences are numbered by the arena (``join``).

A sequence that leaves may be held (``leave(seq, ids)``): its entries stay, and the next sequence
whose prompt starts with the same ids adopts them (``join(ids)``), which is the prompt cache of a
batch. At most ``max_held`` are held, the oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from specfree.adapters.capabilities import Capabilities
from specfree.adapters.kv_buffers import keep_rows
from specfree.adapters.stores import GrowingStore

DEAD = -1  # the owner of an entry no sequence reads any more


@dataclass
class Rows:
    """One sequence's rows in a step: tokens [q], which of them each sees [q, q], positions [q]."""

    seq: int
    tokens: torch.Tensor
    allowed: torch.Tensor
    positions: torch.Tensor


class KVArena:
    """The KV of several sequences in one growing cache (``GrowingStore`` over the model's eager runner)."""

    def __init__(self, model, caps: Capabilities, runner, max_held: int = 4):
        self.store = GrowingStore(model, caps, runner)
        self.windows, self.dtype, self.device = caps.windows, self.store.dtype, self.store.device
        self.owner = np.zeros(0, dtype=np.int64)  # [entries]: the sequence each cache entry belongs to
        self.max_held = max_held
        self.held: OrderedDict[int, np.ndarray] = OrderedDict()  # seq -> the ids its entries hold
        self._next = 0

    @property
    def entries(self) -> int:
        return len(self.owner)

    def length(self, seq: int) -> int:
        """Tokens of ``seq`` whose KV is kept."""
        return int(np.count_nonzero(self.owner == seq))

    @torch.inference_mode()
    def join(self, ids: np.ndarray | None = None) -> tuple[int, int]:
        """A new sequence, and how many leading ``ids`` it already holds (adopted from a held
        sequence whose ids share that prefix; at most all but the last)."""
        seq, self._next = self._next, self._next + 1
        best, reused = None, 0
        if ids is not None:
            for other, held in self.held.items():
                m = min(len(held), len(ids) - 1)
                differ = np.flatnonzero(held[:m] != ids[:m])
                common = int(differ[0]) if differ.size else m
                if common > reused:
                    best, reused = other, common
        if best is not None:
            self.held.pop(best)
            mine = np.flatnonzero(self.owner == best)
            self.owner[mine[:reused]] = seq
            self.owner[mine[reused:]] = DEAD
            self._compact()
        return seq, reused

    @torch.inference_mode()
    def leave(self, seq: int, ids: np.ndarray | None = None) -> None:
        """``seq`` is over: its entries are dropped, or the first ``len(ids)`` held for a later prompt
        that starts with ``ids`` (the ids of those entries, in order; the rest are dropped)."""
        mine = np.flatnonzero(self.owner == seq)
        if ids is None or not self.max_held or not 0 < len(ids) <= len(mine):
            self._drop(seq)
            return
        self.owner[mine[len(ids):]] = DEAD
        self._compact()
        self.held[seq] = np.asarray(ids, dtype=np.int64).copy()
        while len(self.held) > self.max_held:
            self._drop(self.held.popitem(last=False)[0])

    @torch.inference_mode()
    def clear_held(self) -> None:
        for seq in list(self.held):
            self._drop(self.held.pop(seq))

    def _drop(self, seq: int) -> None:
        self.owner[self.owner == seq] = DEAD
        self._compact()

    def _compact(self) -> None:
        """Move the live entries down, in order, and cut the rest (all dead: a fresh cache)."""
        live = np.flatnonzero(self.owner != DEAD)
        if len(live) == len(self.owner):
            return
        if not len(live):
            self.store.reset()
        else:
            keep_rows(self.store.cache.layers, live.tolist(), 0, self.device)
            self.store.crop(len(live))
        self.owner = self.owner[live]

    @torch.inference_mode()
    def run(self, parts: list[Rows], logits_to_keep: int = 0) -> torch.Tensor:
        """One forward of every part's rows, in order, each over its own sequence's entries:
        logits [sum of rows, V] (``logits_to_keep``: only the last rows'). The rows' KV is
        appended; ``commit`` keeps what each sequence accepted."""
        past, total = self.entries, sum(len(p.tokens) for p in parts)
        lowest = torch.finfo(self.dtype).min
        masks: dict | None = None  # per layer kind, where the model has several
        start = past
        for part in parts:
            q = len(part.tokens)
            columns = torch.from_numpy(np.concatenate([np.flatnonzero(self.owner == part.seq), np.arange(start, start + q)]))
            own = self.windows.mask(part.allowed, len(columns) - q, part.positions, self.dtype, torch.device("cpu"))
            own = own if isinstance(own, dict) else {None: own}
            if masks is None:
                masks = {kind: torch.full((1, 1, total, past + total), lowest, dtype=self.dtype) for kind in own}
            for kind, mask in own.items():
                masks[kind][0, 0, start - past : start - past + q, columns] = mask[0, 0]
            start += q
        mask = {kind: m.to(self.device) for kind, m in masks.items()}
        tokens = torch.cat([p.tokens for p in parts])
        positions = torch.cat([p.positions for p in parts])
        try:
            logits = self.store._forward(tokens, positions, mask.get(None, mask), logits_to_keep=logits_to_keep)
        except BaseException:
            self.store.crop(past)  # layers the failed forward reached hold its rows: drop them
            raise
        self.owner = np.concatenate([self.owner, *[np.full(len(p.tokens), p.seq) for p in parts]])
        return logits

    @torch.inference_mode()
    def commit(self, rows: int, keeps: list[tuple[int, list[int]]]) -> None:
        """Of the last step's ``rows`` rows, keep, per (first row of a part, its rows to keep), those
        rows; the rest are dropped. Every sequence's kept rows stay in order."""
        start = self.entries - rows
        keep = [first + k for first, kept in keeps for k in kept]
        if keep:
            keep_rows(self.store.cache.layers, keep, start, self.device)
        self.store.crop(start + len(keep))
        self.owner = np.concatenate([self.owner[:start], self.owner[start:][keep]])

    @torch.inference_mode()
    def reset(self) -> None:
        self.store.reset()
        self.owner = np.zeros(0, dtype=np.int64)
        self.held.clear()
