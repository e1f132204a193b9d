"""The one decoding loop: every request goes through a ``Batch``, alone or beside others, and each
request's output is bit-identical to decoding it alone.

``Engine.generate`` and ``stream`` run a batch of one, ``generate_batch`` and ``serve`` batches of
``max_batch``. A ``Batch`` holds up to ``max_batch`` requests (``Member``s, each from a
``request.Request``). A step:

1. newcomers' prompts are prefilled, oldest first, by chunks of at most ``EXACT_CHUNK`` rows in
   all, in a forward of their own (so the others wait at most one chunk a step); a prompt's last
   id becomes its first root;
2. every decoding member plans its rows (its drafter proposes, the shared pricer keeps the rows
   worth their cost; in a batch of several, priced on the curve at the step's total rows,
   ``pricer.Shifted``);
3. one forward runs all their rows over the adapter's KV manager (``kv_manager.KVManager``), each
   row seeing only its own sequence; a batch of one runs through the adapter's own steps instead
   (``lanes.SoloLane``), which every adapter has;
4. each member verifies, keeps its accepted rows' KV, and emits.

Members join between steps (continuous batching) and leave when they stop, their KV held for a
later prompt that starts with the same ids where the batch holds prompts; one that fails ends
alone. Why the output is each request's own: every row has the bits of the one-row forward
(``Adapter.rows_exact``: the row-exact attention operator and linear kernels, at most
``LONG_ROWS`` rows a forward), so a row's logits depend only on its own sequence, whoever else
shares the forward; and every prompt is prefilled in chunks through the same operator, alone or
not, cached or not. Adapters that cannot share a forward (``Engine.batch_off`` says why) cap a
batch at one request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specfree.adapters.kv_manager import Rows
from specfree.adapters.capabilities import causal
from specfree.constraints import Constraint
from specfree.errors import ConfigError
from specfree.kernels.tree_attention import LONG_ROWS
from specfree.lanes import SoloLane
from specfree.pricer import Shifted
from specfree.request import Request
from specfree.sequence import Chunk, Decoding, Step
from specfree.timing import clock
from specfree.types import Generation

# A prompt's prefill chunk: at most this many rows run the row-exact attention (more go to SDPA).
EXACT_CHUNK = LONG_ROWS


@dataclass(eq=False)
class Member:
    """One request in a batch: its decoding, its sequence in the KV manager, and where its prefill is."""

    decoding: Decoding
    seq: int
    slot: int  # which of the batch's drafters it uses
    prefilled: int  # prompt ids whose KV is kept (all but the last, once it decodes)
    cached_tokens: int  # of them, those adopted from an earlier request
    joined: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    result: Generation | None = None
    error: BaseException | None = None
    cancelled: bool = False

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.decoding.prompt_len - 1

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass
class Event:
    """What a step did for one member: a chunk of output, its end (``result``), or its failure."""

    member: Member
    chunk: Chunk | None = None
    result: Generation | None = None
    error: BaseException | None = None


class Batch:
    """Up to ``max_batch`` requests decoded together by ``engine`` (see the module's docstring):
    the one loop, which ``Engine.generate`` runs as a batch of one.

    Several requests share each forward over the adapter's KV manager; a batch of one runs through
    the adapter's own steps (``lanes.SoloLane``), which every adapter has, those that cannot share a
    forward (``Engine.batch_off``) included. ``hold_prompts``: a finished request's KV is held for a
    later prompt that starts the same way (the prompt cache; at most ``max_batch`` held). Where the
    adapter's rows are exact and its KV can be cut (``Engine.reuse_off`` is None), prompts are
    prefilled in chunks of ``EXACT_CHUNK`` rows, held or not: a prompt's KV has the same bits
    however it was computed. Elsewhere a lone prompt is prefilled in one call, and nothing is held."""

    def __init__(self, engine, max_batch: int | None = None, hold_prompts: bool = False):
        max_batch = engine.settings.value("max_batch", max_batch)  # None: the engine's
        reason = engine.batch_off
        if reason is not None and max_batch > 1:
            raise ConfigError(f"this engine cannot decode requests together: {reason}")
        adapter = engine.adapter
        self.engine, self.max_batch = engine, max_batch
        exact = engine.reuse_off is None
        self.prefill_rows = EXACT_CHUNK if exact else adapter.max_length
        if max_batch == 1:
            self.kv = SoloLane(adapter, holding=hold_prompts and exact)
        else:  # the adapter's own manager (eager buffers, or a package's slots): the prompts it holds are shared
            self.kv = adapter.store.kv
            self.kv.drop_unheld()
            self.kv.max_held = max_batch if hold_prompts else 0
        self.members: list[Member] = []
        self._stepping = False  # True while a step's forward has run but its commit may not have
        self._strategies: list = [engine.strategy] + [None] * (max_batch - 1)  # one drafter per slot

    @property
    def room(self) -> int:
        return self.max_batch - len(self.members)

    def add(self, request: Request) -> Member:
        """A request that joins at the next step (its settings checked now: a bad one raises here)."""
        if not self.room:
            raise ConfigError(f"the batch is full ({self.max_batch} requests); wait for one to finish")
        slot = next(i for i in range(self.max_batch) if all(m.slot != i for m in self.members))
        if self._strategies[slot] is None:
            self._strategies[slot] = self.engine.strategy.fork()
        # A batch of one teaches the engine's cost curve; a batch of several does not (see _run_group).
        decoding = self.engine.decoding(request, strategy=self._strategies[slot], timing=self.max_batch == 1)
        seq, reused = self.kv.join(np.asarray(request.ids, dtype=np.int64) if request.cache_prompt else None)
        member = Member(decoding, seq, slot, prefilled=reused, cached_tokens=reused)
        self.members.append(member)
        if not member.prefilling:
            self._begin(member)
        return member

    def cancel(self, member: Member) -> None:
        """End ``member`` before the next step (its KV is dropped)."""
        member.cancelled = True

    # ---- a step ------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """One step of every member: a forward of the newcomers' prompt chunks, then one for all
        that decode. Returns what happened to each, finished ones last (they have left)."""
        events: list[Event] = []
        self._stepping = True
        for member in [m for m in self.members if m.cancelled]:
            self._leave(member, hold=False)
        newcomers = [m for m in self.members if m.prefilling]
        if newcomers:
            self._prefill(newcomers, events)
        decoding = [m for m in self.members if not m.prefilling and not m.finished]
        if decoding:
            self._decode(decoding, events)
        for member in [m for m in self.members if m.finished]:
            self._leave(member, hold=member.error is None)
        self._stepping = False
        return events

    def _prefill(self, newcomers: list[Member], events: list[Event]) -> None:
        """One forward of the newcomers' next prompt chunks, oldest first, ``prefill_rows`` rows in all."""
        start, parts, room = time.perf_counter(), [], self.prefill_rows  # prompt chunks run eagerly on either path
        for member in newcomers:
            d = member.decoding
            end = min(member.prefilled + room, d.prompt_len - 1)
            if end <= member.prefilled:
                break
            ids = torch.from_numpy(d.buffer[member.prefilled : end].copy())
            parts.append((member, Rows(member.seq, ids, causal(len(ids)), torch.arange(member.prefilled, end))))
            room -= len(ids)
        try:
            self.kv.prefill([rows for _, rows in parts])
        except Exception as exc:  # the forward failed (the manager kept nothing): these newcomers end
            for member, _ in parts:
                member.error = exc
                events.append(Event(member, error=exc))
            return
        seconds = time.perf_counter() - start
        for member, rows in parts:
            member.prefilled += len(rows.tokens)
            member.prefill_s += seconds
            if not member.prefilling:
                self._guarded(member, events, self._begin, member)

    def _begin(self, member: Member) -> None:
        """The drafter's index of the prompt: work on the prompt before the first step, so counted
        in the member's ``prefill_s`` with the prompt's forward (decode time is the steps')."""
        start = time.perf_counter()
        member.decoding.strategy.begin(member.decoding.context.copy())
        member.prefill_s += time.perf_counter() - start

    def _decode(self, members: list[Member], events: list[Event]) -> None:
        steps: dict[Member, Step] = {}
        planned_rows = 0
        curve = self.engine.costs if self.max_batch > 1 else None  # alone: the planner's own price
        for i, member in enumerate(members):
            others = planned_rows + (len(members) - 1 - i)  # later members take at least their root
            cost = Shifted(curve, others) if curve is not None else None
            step = self._guarded(member, events, member.decoding.plan, cost, float(len(members) - 1))
            if step is not None:
                steps[member] = step
                planned_rows += step.layout.rows
        for group in _forwards(list(steps.items()), self.kv.max_rows):
            self._run_group(group, events)

    def _run_group(self, group: list[tuple[Member, Step]], events: list[Event]) -> None:
        device = self.engine.adapter.device
        start = clock(device)
        parts = [Rows(m.seq, s.layout.tokens, s.layout.allowed, s.layout.positions) for m, s in group]
        try:
            logits = self.kv.run(parts)
        except Exception as exc:  # the forward itself failed (the manager kept nothing): every member in it ends
            for member, _ in group:
                member.error = exc
                events.append(Event(member, error=exc))
            return
        forward_s = clock(device) - start
        rows = logits.shape[0]
        if self.max_batch == 1:  # alone, its forward teaches the curve; a batch's forward of R rows
            # attends over several contexts, and would teach it a price no one request's R rows cost
            group[0][0].decoding.planner.timed(rows, forward_s, context=group[0][0].decoding.n)
        keeps, first, verdicts = [], 0, []
        for member, step in group:
            q = step.layout.rows
            verdict = self._guarded(member, events, member.decoding.verify, step, logits[first : first + q])
            if verdict is not None:
                keeps.append((first, [0, *verdict.path]))
                verdicts.append((member, step, verdict, logits[first : first + q]))
            first += q
        self.kv.commit(rows, keeps)
        for member, step, verdict, own in verdicts:
            shared = {"batch.requests": float(len(group)), "batch.rows": float(rows)} if self.max_batch > 1 else None
            chunk = self._guarded(member, events, member.decoding.emit, step, verdict, own, forward_s, shared)
            if chunk is None:
                continue
            events.append(Event(member, chunk=chunk))
            if member.decoding.done:
                member.result = member.decoding.result(member.prefill_s, time.perf_counter() - member.joined,
                                                       cached_tokens=member.cached_tokens)
                events.append(Event(member, result=member.result))

    def _guarded(self, member: Member, events: list[Event], fn, *args):
        """``fn(*args)`` for one member; an exception ends that member alone (returns None)."""
        try:
            return fn(*args)
        except Exception as exc:
            member.error = exc
            events.append(Event(member, error=exc))
            return None

    def _leave(self, member: Member, hold: bool) -> None:
        d = member.decoding
        if not member.prefilling:
            d.strategy.end()
        # A step cut short by a stop may have kept rows past the last emitted id: only the ids' rows are held.
        kept = min(self.kv.length(member.seq), d.n)
        if not self.kv.holds_steps:
            kept = min(kept, d.prompt_len - 1)
        self.kv.leave(member.seq, d.buffer[:kept] if hold else None)
        self.members.remove(member)

    def close(self) -> None:
        """End every member; between steps the KV each kept is held, where the batch holds prompts
        (mid-step, after a forward whose commit did not run, none is)."""
        for member in list(self.members):
            self._leave(member, hold=not self._stepping and member.error is None)


def _forwards(planned: list[tuple[Member, Step]], limit: int) -> list[list[tuple[Member, Step]]]:
    """The members' rows in forwards of at most ``limit`` rows (``KVManager.max_rows``: past it a
    row's bits could depend on the others), in order; a member asking more runs alone."""
    groups: list[list[tuple[Member, Step]]] = []
    rows = limit + 1
    for member, step in planned:
        q = step.layout.rows
        if rows + q > limit:
            groups.append([])
            rows = 0
        groups[-1].append((member, step))
        rows += q
    return groups


def decode_together(engine, prompts: Sequence, max_new_tokens: int = 128, *, max_batch: int | None = None,
                    constraints: Sequence[Constraint | None] | None = None, **settings) -> list[Generation]:
    """Every prompt decoded, ``max_batch`` at a time, each joining as another finishes; results in
    order (a request that fails raises its error once the others are done; ``constraints``: one
    per prompt, or None)."""
    constraints = list(constraints) if constraints is not None else [None] * len(prompts)
    requests = [engine.request(prompt, max_new_tokens, constraint=constraint, **settings)  # all checked first
                for prompt, constraint in zip(prompts, constraints)]
    batch = Batch(engine, max_batch)
    pending = list(enumerate(requests))
    results: dict[int, Generation] = {}
    errors: dict[int, BaseException] = {}
    index_of: dict[Member, int] = {}
    try:
        while pending or batch.members:
            while pending and batch.room:
                index, request = pending.pop(0)
                index_of[batch.add(request)] = index
            for event in batch.step():
                if event.result is not None:
                    results[index_of[event.member]] = event.result
                elif event.error is not None:
                    errors[index_of[event.member]] = event.error
    finally:
        batch.close()
    if errors:
        raise errors[min(errors)]
    return [results[i] for i in range(len(prompts))]
