"""KV stores: how one sequence's steps run over its KV, one class per kind of KV.

Every store offers the same interface to ``HFAdapter``: ``past`` (tokens kept), ``reset()``,
``prefill(ids)`` (keep a prompt's KV, no logits), ``run(tokens, allowed, positions)`` (a step's
logits; ``allowed=None``: plain causal rows), ``run_plain(tokens, positions)`` (rows under the
model's own causal mask, the probes' reference) and ``keep(keep, rows)`` (keep the KV of the step's
rows ``keep``, drop the rest). A store runs its forwards through a runner (``runners``).

- ``GrowingStore``: one sequence of a ``KVManager`` over growing buffers (eager forwards); kept rows
  move down, the tail is cut: no second forward.
- ``SlotStore``: one sequence of a ``KVManager`` over a compiled runner's static slots.
  (Both are ``SequenceStore``s: a sequence alone in its manager.)
- ``RecurrentStore``: recurrent states (or a family's own cache), snapshot before a chain, put back
  and the kept rows replayed after a rejection (``recurrent``).
- ``RerunStore``: the token ids of a model without a KV cache, which runs the whole sequence again.

Rows of KV have one owner, the KV manager (``kv_manager``): it holds the buffers, appends a
forward's rows, commits and drops them, for the eager and compiled paths alike; a store lays out
its sequence's rows and masks, and a batch runs several sequences over a manager of the same class.
A recurrent store keeps its states itself: they hold no rows to move, and a rejection puts a
snapshot back. A new store is one subclass of ``KVStore`` and one entry in ``STORES``;
``Capabilities.store`` names the eager store a model needs, and an adapter given a compiled runner
keeps its KV in a ``SlotStore``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from specfree.adapters import recurrent
from specfree.adapters.capabilities import Capabilities, causal, model_device
from specfree.adapters.kv_buffers import GrowingBuffers, StaticSlots
from specfree.adapters.kv_manager import KVManager
from specfree.masks.bucketed import pad_rows


class KVStore:
    """The interface every store offers (see the module's docstring)."""

    rollback_s = 0.0  # the last ``keep``'s rollback time (stores that roll back)
    cache = None  # the transformers cache the forward writes, where the store keeps one

    def __init__(self, model, caps: Capabilities, runner):
        self.model, self.caps, self.runner = model, caps, runner
        self.device, self.dtype = model_device(model), model.dtype

    @property
    def past(self) -> int:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def prefill(self, ids: torch.Tensor) -> None:
        raise NotImplementedError

    def run(self, tokens: torch.Tensor, allowed: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run_plain(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, keep: list[int], rows: int) -> None:
        raise NotImplementedError

    croppable = False  # whether ``crop`` can cut the kept tokens back to a prefix

    def crop(self, length: int) -> None:
        """Keep the KV of the first ``length`` tokens only (the prompt cache; stores that can)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be cut back to a prefix")

    def _mask(self, allowed: torch.Tensor, past: int, positions: torch.Tensor, slots: int | None = None):
        return self.caps.windows.mask(allowed, past, positions, self.dtype, self.device, slots)


class CacheStore(KVStore):
    """Eager forwards over a transformers cache: a mask only where rows are not plain causal, a window
    is exceeded, or chains take specfree's (what ``GrowingStore`` and ``RecurrentStore`` share)."""

    def prefill(self, ids: torch.Tensor) -> None:
        past, q = self.past, ids.numel()
        positions = torch.arange(past, past + q, device=self.device)
        window = self.caps.windows.narrowest
        mask = self._mask(causal(q), past, positions) if window is not None and past + q > window else None
        self._forward(ids, positions, mask, logits_to_keep=1)

    def run(self, tokens: torch.Tensor, allowed: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens, positions, self._step_mask(tokens.numel(), allowed, positions))

    def run_plain(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens, positions, None)

    def _step_mask(self, q: int, allowed: torch.Tensor | None, positions: torch.Tensor):
        past, window = self.past, self.caps.windows.narrowest
        plain = allowed is None or q == 1 or bool(torch.equal(allowed, causal(q)))
        if plain and not (window is not None and past + q > window) and not (self.caps.chain_mask and q > 1):
            return None
        return self._mask(causal(q) if allowed is None else allowed, past, positions)

    def _forward(self, tokens, positions, mask, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits [q, V] of the rows (``logits_to_keep=1``: the last row's); their KV is kept."""
        raise NotImplementedError


class SequenceStore(KVStore):
    """One sequence of a ``KVManager`` over ``buffers``, alone in it: what ``GrowingStore`` and
    ``SlotStore`` share (its entries are the manager's; cropping cuts the manager back)."""

    croppable = True

    def __init__(self, model, caps: Capabilities, runner, buffers):
        super().__init__(model, caps, runner)
        self.kv = KVManager(buffers, runner, caps.windows)
        self.reset()

    @property
    def past(self) -> int:
        return self.kv.entries  # the sequence is its manager's only one (a batch resets it first)

    def reset(self) -> None:
        self.kv.reset()
        self.seq, _ = self.kv.join()

    def crop(self, length: int) -> None:
        self.kv.truncate(length)

    def resume(self, ids) -> int:
        """A new sequence that adopts the longest prefix of ``ids`` held (``hold``), alone in the
        manager; how many ids it holds."""
        self.seq, reused = self.kv.join(ids)
        self.kv.only(self.seq)
        return reused

    def hold(self, ids) -> None:
        """Keep the KV of the first ``len(ids)`` entries, whose ids ``ids`` are, for ``resume``."""
        self.kv.max_held = max(self.kv.max_held, 1)
        self.kv.leave(self.seq, ids)


class GrowingStore(SequenceStore, CacheStore):
    """One sequence of a ``KVManager`` over growing buffers (no sliding-window layers: cache index
    == position)."""

    def __init__(self, model, caps: Capabilities, runner):
        super().__init__(model, caps, runner, GrowingBuffers(model.dtype, model_device(model)))

    @property
    def cache(self):
        return self.kv.buffers.cache

    def _forward(self, tokens, positions, mask, logits_to_keep: int = 0) -> torch.Tensor:
        return self.kv.forward([(self.seq, tokens.numel())], tokens, positions, mask, prompt=logits_to_keep == 1)

    def keep(self, keep: list[int], rows: int) -> None:
        self.kv.commit(rows, [(0, keep)])


class RecurrentStore(CacheStore):
    """Recurrent states beside attention KV, or a family's own cache (chains only), kept here. A
    chain's step snapshots the states; a rejection puts them back and runs the kept rows again,
    through only the state-writing mixers where they can be found (``replay``), else through the
    whole model."""

    def __init__(self, model, caps: Capabilities, runner):
        super().__init__(model, caps, runner)
        self.reset()
        self.replay = recurrent.MixerReplay.find(model, self.cache, lambda: self.prefill(torch.arange(3, 6))) \
            if caps.cache_kind == "states" else None
        self.reset()

    @property
    def past(self) -> int:
        return self._length  # recurrent layers have no sequence axis to read it from

    def reset(self) -> None:
        self.cache = recurrent.new_cache(self.model, self.caps.cache_kind)
        self._length = 0
        self._step: tuple | None = None

    def run(self, tokens: torch.Tensor, allowed: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        q = tokens.numel()
        if q == 1:  # one row is always kept whole
            return super().run(tokens, allowed, positions)
        if allowed is not None and not torch.equal(allowed, causal(q)):
            raise ValueError("a model with recurrent layers verifies one chain per step, not a tree")
        mask = self._step_mask(q, allowed, positions)
        self._step = (recurrent.snapshot(self.cache, self.caps.cache_kind, self.past), tokens, positions)
        if self.replay is None:
            return self._forward(tokens, positions, mask)
        hooks = self.replay.record()
        try:
            return self._forward(tokens, positions, mask)
        finally:
            for hook in hooks:
                hook.remove()

    def _forward(self, tokens, positions, mask, logits_to_keep: int = 0) -> torch.Tensor:
        logits, self.cache = self.runner(tokens.to(self.device)[None], positions.to(self.device)[None], mask,
                                         self.cache, logits_to_keep)
        self._length += tokens.numel()
        return logits[0]
    def keep(self, keep: list[int], rows: int) -> None:
        """Keep the first ``len(keep)`` rows of the chain: when some were rejected, put the states
        back as they were before the step and run the kept rows again (their logits are not needed)."""
        kept, self.rollback_s = len(keep), 0.0
        if kept < rows:
            start = time.perf_counter()
            snapshot, tokens, positions = self._step
            if self.replay is not None and snapshot.keeps_rows(rows):
                self.cache = snapshot.restore(self.cache, kept, rows)
                if self.replay.replay(kept, rows):
                    self._length, self._step = snapshot.past + kept, None
                    self.rollback_s = time.perf_counter() - start
                    return
            self.cache = snapshot.restore(self.cache)
            self._length = snapshot.past
            self._forward(tokens[:kept], positions[:kept], None, logits_to_keep=1)  # chains need no mask
            self.rollback_s = time.perf_counter() - start
        self._step = None


class RerunStore(KVStore):
    """A model whose forward takes no cache (GPT-1, RWKV): the tokens so far, the whole sequence
    run again each step under the model's own causal mask, the new rows' logits kept."""

    def __init__(self, model, caps: Capabilities, runner):
        super().__init__(model, caps, runner)
        self.reset()

    @property
    def past(self) -> int:
        return self.ids.numel()

    def reset(self) -> None:
        self.ids = torch.zeros(0, dtype=torch.long)

    def prefill(self, ids: torch.Tensor) -> None:
        self.ids = torch.cat([self.ids, ids.cpu()])  # the next forward runs these tokens with its own

    def run(self, tokens: torch.Tensor, allowed: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        return self.run_plain(tokens, positions)  # chains only: the model's own causal mask is right

    def run_plain(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, self.ids = tokens.numel(), torch.cat([self.ids, tokens.cpu()])
        return self.model(input_ids=self.ids.to(self.device)[None]).logits[0, -q:]

    def keep(self, keep: list[int], rows: int) -> None:
        self.ids = self.ids[: self.past - rows + len(keep)]  # a chain: its first rows


class SlotStore(SequenceStore):
    """One sequence of a ``KVManager`` over a compiled runner's static slots: rows padded to the row
    count the runner takes, every step masked over all slots; prompts run eagerly (a graph per
    prompt length would never be reused), a first prompt over a cache of its own length whose keys
    and values are then copied into the slots (``StaticSlots.forward`` given no mask)."""

    def __init__(self, model, caps: Capabilities, runner, slots: StaticSlots):
        super().__init__(model, caps, runner, slots)
        self._rows = 0  # the last step's rows, padding included

    @property
    def slots(self) -> StaticSlots:
        return self.kv.buffers

    def prefill(self, ids: torch.Tensor) -> None:
        past, q = self.past, ids.numel()
        positions = torch.arange(past, past + q)
        first = (past == 0 and self.caps.cache_kind == "growing" and self.caps.windows.narrowest is None
                 and self.runner.eager_prompts)
        mask = None if first else self._mask(causal(q), past, positions, self.kv.columns(q))
        self.kv.forward([(self.seq, q)], ids, positions, mask, prompt=True)

    def run(self, tokens: torch.Tensor, allowed: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        q = tokens.numel()
        allowed = causal(q) if allowed is None else allowed
        return self._run(*pad_rows(tokens.cpu(), allowed, positions.cpu(), self.runner.rows_for(q)))[:q]

    def run_plain(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._run(tokens.cpu(), causal(tokens.numel()), positions.cpu())

    def _run(self, tokens: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of rows already padded for the runner; their KV goes into slots past..past+B."""
        self._rows = tokens.numel()
        mask = self._mask(allowed, self.past, positions, self.kv.columns(self._rows))
        return self.kv.forward([(self.seq, self._rows)], tokens, positions, mask)

    def keep(self, keep: list[int], rows: int) -> None:
        self.kv.commit(self._rows, [(0, keep)])  # padding rows dropped too

    @contextmanager
    def eager_steps(self):
        """The runner's steps run eagerly inside the block (no graphs or packages for its shapes)."""
        compiled, self.runner.compiled = self.runner.compiled, False
        try:
            yield
        finally:
            self.runner.compiled = compiled


# A store's name (``Capabilities.store``) -> its class; a compiled runner's steps keep theirs in a
# ``SlotStore`` over the slots they were compiled for.
STORES: dict[str, type[KVStore]] = {"growing": GrowingStore, "recurrent": RecurrentStore, "rerun": RerunStore}
