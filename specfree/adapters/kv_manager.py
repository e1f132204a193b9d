"""The KV manager: the one owner of a model's KV, giving each sequence its entries.

A ``KVManager`` holds one set of KV buffers (``kv_buffers``: a growing cache for eager forwards, or
a compiled runner's static slots) and which sequence each entry belongs to (``owner``). Sequences
join (``join``) and leave (``leave``); a forward appends each sequence's rows after all the entries
(``forward``, or ``run`` with the mask built for several sequences); ``commit`` keeps what each
sequence accepted and drops the rest; ``truncate`` cuts a lone sequence back to a prefix. The
runner a forward goes through is given the buffers with the call and keeps none; attention reads
the cache the forward is given. A store (``stores.GrowingStore``, ``stores.SlotStore``) is one
sequence of a manager; a batch (``batching.Batch``) is several, over the same class: the eager
path's batch over a manager of its own, the compiled path's over its adapter's (one set of slots).

Several sequences in one cache: a step's mask lets each row see only its own sequence's entries
(and, among the step's rows, its own tree's): the mask one sequence would get alone
(``Windows.mask``), spread over the columns where its entries sit. Keeping the accepted rows moves
them down, in order; a sequence that leaves marks its entries dead, and the cache is compacted, in
order. So a sequence's entries are always in position order, though other sequences' entries sit
between them. That is all the row-exact attention operator needs to give each row the bits it has
alone: a row's result is a fixed sequence of operations over the keys it sees, in the order they
sit, whatever their slot (``kernels/tree_attention.cpp``); the linear kernels give each row the same
bits whatever the other rows.

A sequence that leaves may be held (``leave(seq, ids)``): its entries stay, and the next sequence
whose prompt starts with the same ids adopts them (``join(ids)``), which is the prompt cache of a
batch and of one request alike (a lone store's ``hold`` and ``resume``). At most ``max_held`` are
held, the oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from specfree.adapters.kv_buffers import GrowingBuffers, StaticSlots

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


class KVManager:
    """The KV of one or more sequences in one set of buffers, run through ``runner`` (see the
    module's docstring); ``windows``: the model's attention windows, which shape each sequence's mask."""

    holds_steps = True  # a held sequence keeps its steps' rows too, not only its prompt's

    def __init__(self, buffers: GrowingBuffers | StaticSlots, runner, windows, max_held: int = 0):
        self.buffers, self.runner, self.windows, self.max_held = buffers, runner, windows, max_held
        self.device = buffers.device
        self.owner = np.zeros(0, dtype=np.int64)  # [entries]: the sequence each entry belongs to
        self.held: OrderedDict[int, np.ndarray] = OrderedDict()  # seq -> the ids its entries hold
        self._next = 0

    @property
    def max_rows(self) -> int:
        """The most rows one forward takes with every row exact (``runners``' ``exact_rows``)."""
        return self.runner.exact_rows

    @property
    def entries(self) -> int:
        return len(self.owner)

    def length(self, seq: int) -> int:
        """Entries (tokens whose KV is kept) of ``seq``."""
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

    def only(self, seq: int) -> None:
        """Drop every sequence but ``seq``, held ones too (a store's steps run alone in their manager)."""
        self.held.clear()
        self.owner[self.owner != seq] = DEAD
        self._compact()

    def drop_unheld(self) -> None:
        """Drop every entry no held sequence owns (what a lone store's steps left), before a batch."""
        self.owner[~np.isin(self.owner, list(self.held))] = DEAD
        self._compact()

    def _drop(self, seq: int) -> None:
        self.owner[self.owner == seq] = DEAD
        self._compact()

    def _compact(self) -> None:
        """Move the live entries down, in order, and cut the rest (all dead: fresh buffers)."""
        live = np.flatnonzero(self.owner != DEAD)
        if len(live) == len(self.owner):
            return
        if not len(live):
            self.buffers.reset()
        else:
            self.buffers.keep(live.tolist(), 0)
            self.buffers.set_length(len(live))
        self.owner = self.owner[live]

    def columns(self, rows: int) -> int:
        """The mask's width for a forward of ``rows`` more rows (room made for them)."""
        return self.buffers.room(self.entries + rows)

    def forward(self, parts: list[tuple[int, int]], tokens: torch.Tensor, positions: torch.Tensor, mask,
                prompt: bool = False) -> torch.Tensor | None:
        """One forward of rows already laid out: per (sequence, rows) in ``parts``, its rows in order;
        tokens, positions [B]; ``mask`` over ``columns(B)`` columns (``None``: plainly causal rows
        of a lone sequence, where the buffers can run them so). Returns logits [B, V] (``prompt``:
        prompt chunks, [1, V] of the last row, or None where the buffers keep none). Their KV is
        appended; ``commit`` keeps what each sequence accepted."""
        past = self.entries
        try:
            logits = self.buffers.forward(self.runner, tokens.to(self.device)[None], positions.to(self.device)[None],
                                          mask, prompt)
        except BaseException:
            self.buffers.set_length(past)  # layers the failed forward reached hold its rows: drop them
            raise
        self.owner = np.concatenate([self.owner, *[np.full(rows, seq) for seq, rows in parts]])
        return None if logits is None else logits[0]

    @torch.inference_mode()
    def run(self, parts: list[Rows], prompt: bool = False) -> torch.Tensor | None:
        """One forward of every part's rows, in order, each over its own sequence's entries and its
        own tree (the mask built here): logits [sum of rows, V], as ``forward``."""
        past, total = self.entries, sum(len(p.tokens) for p in parts)
        width = self.columns(total)
        dtype = self.buffers.dtype
        lowest = torch.finfo(dtype).min
        masks: dict | None = None  # per layer kind, where the model has several
        start = past
        for part in parts:
            q = len(part.tokens)
            columns = torch.from_numpy(np.concatenate([np.flatnonzero(self.owner == part.seq),
                                                       np.arange(start, start + q)]))
            own = self.windows.mask(part.allowed, len(columns) - q, part.positions, dtype, torch.device("cpu"))
            own = own if isinstance(own, dict) else {None: own}
            if masks is None:
                masks = {kind: torch.full((1, 1, total, width), lowest, dtype=dtype) for kind in own}
            for kind, mask in own.items():
                masks[kind][0, 0, start - past : start - past + q, columns] = mask[0, 0]
            start += q
        masks = {kind: m.to(self.device) for kind, m in masks.items()}
        mask = masks[None] if None in masks else masks
        return self.forward([(p.seq, len(p.tokens)) for p in parts], torch.cat([p.tokens for p in parts]),
                            torch.cat([p.positions for p in parts]), mask, prompt)

    def prefill(self, parts: list[Rows]) -> None:
        """Keep the KV of every part's prompt rows (plainly causal, each over its own sequence)."""
        self.run(parts, prompt=True)
        total = sum(len(p.tokens) for p in parts)
        self.commit(total, [(0, list(range(total)))])

    @torch.inference_mode()
    def commit(self, rows: int, keeps: list[tuple[int, list[int]]]) -> None:
        """Of the last forward's ``rows`` rows, keep, per (first row of a part, its rows to keep),
        those rows; the rest are dropped. Every sequence's kept rows stay in order."""
        start = self.entries - rows
        keep = [first + k for first, kept in keeps for k in kept]
        if keep:
            self.buffers.keep(keep, start)
        self.buffers.set_length(start + len(keep))
        self.owner = np.concatenate([self.owner[:start], self.owner[start:][keep]])

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` entries only (a lone sequence cut back to a prefix of itself)."""
        self.buffers.set_length(length)
        self.owner = self.owner[:length]

    @torch.inference_mode()
    def reset(self) -> None:
        """Empty: every sequence and held prompt gone."""
        self.buffers.reset()
        self.owner = np.zeros(0, dtype=np.int64)
        self.held.clear()
