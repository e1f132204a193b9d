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

Where the entries live: ``GrowingKV`` (eager forwards over a growing cache) or ``SlotKV`` (a
compiled runner's static slots: steps through its AOTInductor package, prompt chunks eagerly, as
the compiled path runs them alone; its rows equal the one-row compiled step's bit for bit).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from specfree.adapters.capabilities import Capabilities
from specfree.adapters.kv_buffers import StaticSlots, keep_rows
from specfree.adapters.stores import GrowingStore
from specfree.kernels.tree_attention import LONG_ROWS

DEAD = -1  # the owner of an entry no sequence reads any more


def shared_prefix(held: np.ndarray, ids, most: int) -> int:
    """How many leading ids ``held`` and ``ids`` share, at most ``most`` (a prompt cache reuses at
    most all of a prompt but its last id, the next step's root)."""
    m = min(len(held), len(ids), most)
    if m <= 0:
        return 0
    differ = np.flatnonzero(held[:m] != np.asarray(ids[:m], dtype=np.int64))
    return int(differ[0]) if differ.size else m


@dataclass
class Rows:
    """One sequence's rows in a step: tokens [q], which of them each sees [q, q], positions [q]."""

    seq: int
    tokens: torch.Tensor
    allowed: torch.Tensor
    positions: torch.Tensor


class GrowingKV:
    """Entries in a cache of ``GrowingLayer``s, run by eager forwards (the eager path's)."""

    max_rows = LONG_ROWS  # rows a forward takes through the row-exact operator

    def __init__(self, model, caps: Capabilities, runner):
        self.store = GrowingStore(model, caps, runner)
        self.dtype, self.device = self.store.dtype, self.store.device

    def columns(self, entries: int) -> int:
        """The mask's width for a forward that brings the cache to ``entries`` entries."""
        return entries

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask, past: int, prefill: bool) -> torch.Tensor:
        return self.store._forward(tokens, positions, mask, logits_to_keep=1 if prefill else 0)

    def keep(self, keep: list[int], start: int) -> None:
        keep_rows(self.store.cache.layers, keep, start, self.device)

    def cut(self, length: int) -> None:
        self.store.crop(length)

    def reset(self) -> None:
        self.store.reset()


class SlotKV:
    """Entries in a compiled adapter's static slots (its ``SlotStore``'s, borrowed while the batch
    runs): steps through its runner's package, prompt chunks eagerly, as the store runs them alone."""

    def __init__(self, runner, slots: StaticSlots):
        from specfree.adapters.packaged import MAX_ROWS

        self.runner, self.slots = runner, slots
        self.dtype, self.device = self.slots.dtype, self.slots.device
        self.max_rows = min(LONG_ROWS, MAX_ROWS)  # more rows would leave the package for eager code

    def columns(self, entries: int) -> int:
        self.slots.room(entries)
        return self.slots.capacity

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask, past: int, prefill: bool) -> torch.Tensor:
        # Fresh inference tensors: a graph's guards tell them from tensors made outside inference mode.
        ids, positions = tokens.to(self.device).clone()[None], positions.to(self.device).clone()[None]
        if prefill:
            logits = self.runner.eager(ids, positions, mask, self.slots, logits_to_keep=1)
            self.slots.set_length(past + ids.shape[1])
        else:
            logits, _ = self.runner(ids, positions, mask, self.slots)
            self.slots.past = past + ids.shape[1]
        return logits[0]

    def keep(self, keep: list[int], start: int) -> None:
        keep_rows(self.slots.cache.layers, keep, start, self.device)

    def cut(self, length: int) -> None:
        self.slots.set_length(length)

    def reset(self) -> None:
        self.slots.reset()


class KVArena:
    """The KV of several sequences in one cache (``kv``: a ``GrowingKV`` or a ``SlotKV``)."""

    def __init__(self, kv: GrowingKV | SlotKV, windows, max_held: int = 4):
        self.kv, self.windows = kv, windows
        self.dtype, self.device = kv.dtype, kv.device
        self.owner = np.zeros(0, dtype=np.int64)  # [entries]: the sequence each cache entry belongs to
        self.max_held = max_held
        self.held: OrderedDict[int, np.ndarray] = OrderedDict()  # seq -> the ids its entries hold
        self._next = 0

    @property
    def max_rows(self) -> int:
        """The most rows one forward takes with every row exact."""
        return self.kv.max_rows

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
                common = shared_prefix(held, ids, len(ids) - 1)
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

    def _drop(self, seq: int) -> None:
        self.owner[self.owner == seq] = DEAD
        self._compact()

    def _compact(self) -> None:
        """Move the live entries down, in order, and cut the rest (all dead: a fresh cache)."""
        live = np.flatnonzero(self.owner != DEAD)
        if len(live) == len(self.owner):
            return
        if not len(live):
            self.kv.reset()
        else:
            self.kv.keep(live.tolist(), 0)
            self.kv.cut(len(live))
        self.owner = self.owner[live]

    @torch.inference_mode()
    def run(self, parts: list[Rows], prefill: bool = False) -> torch.Tensor:
        """One forward of every part's rows, in order, each over its own sequence's entries:
        logits [sum of rows, V] (``prefill``: prompt chunks, only the last row's logits). The rows'
        KV is appended; ``commit`` keeps what each sequence accepted."""
        past, total = self.entries, sum(len(p.tokens) for p in parts)
        width = self.kv.columns(past + total)
        lowest = torch.finfo(self.dtype).min
        masks: dict | None = None  # per layer kind, where the model has several
        start = past
        for part in parts:
            q = len(part.tokens)
            columns = torch.from_numpy(np.concatenate([np.flatnonzero(self.owner == part.seq),
                                                       np.arange(start, start + q)]))
            own = self.windows.mask(part.allowed, len(columns) - q, part.positions, self.dtype, torch.device("cpu"))
            own = own if isinstance(own, dict) else {None: own}
            if masks is None:
                masks = {kind: torch.full((1, 1, total, width), lowest, dtype=self.dtype) for kind in own}
            for kind, mask in own.items():
                masks[kind][0, 0, start - past : start - past + q, columns] = mask[0, 0]
            start += q
        masks = {kind: m.to(self.device) for kind, m in masks.items()}
        mask = masks[None] if None in masks else masks
        tokens = torch.cat([p.tokens for p in parts])
        positions = torch.cat([p.positions for p in parts])
        try:
            logits = self.kv.forward(tokens, positions, mask, past, prefill)
        except BaseException:
            self.kv.cut(past)  # layers the failed forward reached hold its rows: drop them
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
            self.kv.keep(keep, start)
        self.kv.cut(start + len(keep))
        self.owner = np.concatenate([self.owner[:start], self.owner[start:][keep]])

    @torch.inference_mode()
    def reset(self) -> None:
        self.kv.reset()
        self.owner = np.zeros(0, dtype=np.int64)
        self.held.clear()
