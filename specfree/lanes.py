"""A lane of one: the KV manager's interface (``join``, ``prefill``, ``run``, ``commit``, ``leave``)
over an adapter's own steps, for a batch capped at one request.

``batching.Batch`` runs every request. Several share a forward over the adapter's KV manager
(``kv_manager.KVManager``); one request alone runs through the adapter (``Adapter.prefill``,
``forward``, ``commit``) instead, the steps every adapter has: recurrent and hybrid families,
torch.compile graphs that pad rows to buckets, and rows that are not exact cannot share a forward,
and a lone request's plain causal rows need no mask. Its prefix reuse is still the KV manager's:
``Adapter.resume`` and ``hold`` adopt and hold a prefix through the store's manager.
"""

from __future__ import annotations

import numpy as np
import torch

from specfree.adapters.kv_manager import Rows
from specfree.adapters.protocol import Adapter


class SoloLane:
    """One sequence at a time over ``adapter``'s own steps; ``holding``: a finished request's KV is
    held for the next prompt that starts the same way (the prompt cache)."""

    def __init__(self, adapter: Adapter, holding: bool):
        self.adapter, self.holding = adapter, holding
        # A compiled adapter holds only the rows its eager prefill made: its compiled steps equal
        # the eager rows to rounding, not in bits.
        self.holds_steps = not adapter.compiled
        self.max_rows = adapter.exact_rows  # one request a forward: the planner already keeps to it

    @property
    def entries(self) -> int:
        return self.adapter.past_len

    def length(self, seq: int) -> int:
        return self.adapter.past_len

    def join(self, ids: np.ndarray | None = None) -> tuple[int, int]:
        """The one sequence, and how many leading ``ids`` it holds already (None: none reused)."""
        return 0, self.adapter.resume(ids if self.holding else None)

    def prefill(self, parts: list[Rows]) -> None:
        (part,) = parts
        self.adapter.prefill(part.tokens)

    def run(self, parts: list[Rows]) -> torch.Tensor:
        (part,) = parts
        plain = len(part.tokens) == 1  # a lone root row needs no mask: the plain causal path is fastest
        return self.adapter.forward(part.tokens, None if plain else part.allowed, part.positions)

    def commit(self, rows: int, keeps: list[tuple[int, list[int]]]) -> None:
        if keeps:  # none: the request failed, and its KV goes when it leaves
            ((_, keep),) = keeps
            self.adapter.commit(keep, rows=rows)

    def leave(self, seq: int, ids: np.ndarray | None = None) -> None:
        """Hold the KV of ``ids`` for the next ``join``; else leave it as it is (the next ``join``
        resets it, and a batch of several drops what no held sequence owns): a compiled adapter's
        slots keep the tier they grew to."""
        if ids is not None and self.holding and len(ids):
            self.adapter.hold(ids)
