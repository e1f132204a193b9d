"""Runners: how a step's forward is executed, one class per way.

Every runner is called the same way: ``runner(ids, positions, mask, cache, logits_to_keep=0)``
(ids, positions [1, B]) returns the rows' logits [1, B, V] and the cache the step wrote into (a
family may make its own on the first forward); ``rows_for(rows)`` says the row count a step runs at
(padding included), ``exact_rows`` the most rows a forward takes with every row exact, and
``compiled`` whether it runs compiled code. A runner owns no KV: the cache is the KV manager's
(``kv_manager``), given with each call.

- ``EagerRunner``: plain eager forwards over the cache a store gives it (growing, recurrent).

The compiled runners are given static KV slots (``kv_buffers.StaticSlots``, a manager's) and write
a step's KV into them at past..past+B. Each can run the same step eagerly, and does so, with
one warning, when its compiler fails: slower, never wrong.

- ``PackageRunner``: one AOTInductor package (``packaged.py``) for every row count up to
  ``packaged.MAX_ROWS`` and every slot count; built once per model architecture, kept on disk,
  loaded by a later process in a fraction of a second, its weights the model's own tensors. The CPU path.
- ``GraphRunner``: ``torch.compile``, a graph per row bucket and slot tier (rows are padded up to a
  bucket); run as CUDA graphs on a GPU (``mode="reduce-overhead"``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specfree.adapters.capabilities import model_device
from specfree.adapters.kv_buffers import StaticSlots, cache_argument, cache_in
from specfree.adapters.packaged import MAX_ROWS as PACKAGE_MAX_ROWS
from specfree.adapters.packaged import StepPackage
from specfree.kernels import linear_path
from specfree.kernels.tree_attention import LONG_ROWS
from specfree.masks.bucketed import ROW_BUCKETS, bucket_for

# A graph per (row bucket, slot tier); dynamo's default limit of 8 per function is too few.
RECOMPILE_LIMIT = 256


def eager_step(model, cache_name: str, slots: StaticSlots, ids: torch.Tensor, positions: torch.Tensor,
               mask) -> torch.Tensor:
    # ids, positions [1, B]; mask [1, 1, B, slots] (or one per layer kind) -> logits [1, B, V];
    # cache_name: what the forward calls its cache argument (``kv_buffers.cache_argument``)
    return model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                 **{cache_name: slots.cache}).logits


class EagerRunner:
    """Eager forwards over a given cache; ``takes_positions=False`` for forwards that take no
    position ids (Mamba-style models pass unknown arguments on to their kernels)."""

    compiled, compile_s, failure = False, 0.0, None
    exact_rows = LONG_ROWS  # rows the row-exact attention operator takes

    def __init__(self, model: torch.nn.Module, cache_name: str | None, takes_positions: bool = True):
        self.model, self.cache_name, self.takes_positions = model, cache_name, takes_positions

    def rows_for(self, rows: int) -> int:
        return rows

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask, cache, logits_to_keep: int = 0):
        inputs = dict(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=logits_to_keep)
        inputs[self.cache_name] = cache
        if self.takes_positions:
            inputs["position_ids"] = positions
        out = self.model(**inputs)
        return out.logits, cache if cache is not None else cache_in(out)  # a family that builds its own


class StepRunner:
    """What the compiled runners share: the eager fallback, compile time and failure bookkeeping."""

    exact_rows = min(LONG_ROWS, PACKAGE_MAX_ROWS)  # more rows would leave the package for eager code
    eager_prompts = True  # prompts run on the model's eager forward (a warm start's runner has none)

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache_name = cache_argument(model)  # read once: not inside a traced step
        self.compiled = True  # False once the compiler failed: every step then runs eagerly
        self.compile_s = 0.0  # wall time of the calls that compiled (or loaded) a new step
        self.failure: str | None = None  # why compiling was given up, if it was
        self._shapes_seen: set[tuple] = set()

    def rows_for(self, rows: int) -> int:
        """The row count a step of ``rows`` rows runs at (padding included)."""
        return rows

    def compiles(self, rows: int) -> bool:
        raise NotImplementedError

    def step_kind(self, rows: int, slots: StaticSlots) -> tuple:
        """What a new compiled step is made for: the first call of each kind counts as compile time
        (a graph per row bucket and slot tier)."""
        return rows, slots.capacity

    def _compiled_step(self, ids, positions, mask, slots: StaticSlots) -> torch.Tensor:
        raise NotImplementedError

    def eager(self, ids: torch.Tensor, positions: torch.Tensor, mask, slots: StaticSlots,
              logits_to_keep: int = 0) -> torch.Tensor:
        """An eager forward over ``slots`` (prompts: a graph per prompt length would never be reused)."""
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                          logits_to_keep=logits_to_keep, **{self.cache_name: slots.cache}).logits

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask, cache: StaticSlots, logits_to_keep: int = 0):
        """The step over the caller's slots ``cache``, written at ``cache.past``; returns them."""
        return self._step_logits(ids, positions, mask, cache), cache

    def _step_logits(self, ids: torch.Tensor, positions: torch.Tensor, mask, slots: StaticSlots) -> torch.Tensor:
        rows = ids.shape[1]
        if self.compiled and self.compiles(rows):
            shape, start = self.step_kind(rows, slots), time.perf_counter()
            try:
                logits = self._compiled_step(ids, positions, mask, slots)
            except Exception as exc:  # any compiler failure: the same step, eagerly
                self.give_up(exc)
                slots.set_length(slots.past)
            else:
                if shape not in self._shapes_seen:
                    self._shapes_seen.add(shape)
                    self.compile_s += time.perf_counter() - start
                return logits
        return eager_step(self.model, self.cache_name, slots, ids, positions, mask)

    def give_up(self, exc: Exception) -> None:
        self.compiled = False
        message = str(exc).split("from user code:")[0]  # dynamo appends the traced source
        self.failure = f"{type(exc).__name__}: {' '.join(message.split())[:300]}"
        warnings.warn(f"compiling the forward failed ({self.failure}); decoding continues on the eager path",
                      stacklevel=7)


class PackageRunner(StepRunner):
    """One AOTInductor package for 1..``PACKAGE_MAX_ROWS`` rows and any slot count."""

    def __init__(self, model: torch.nn.Module, package_dir: str | Path | None, options: dict,
                 buckets: Sequence[int] = ROW_BUCKETS):
        """``buckets``: the row counts whose cost the cost curve measures (the package takes any)."""
        super().__init__(model)
        self.buckets = tuple(sorted(set(buckets)))
        self.linears = linear_path(model)
        self.package = StepPackage(model, package_dir, options, self.linears)

    def compiles(self, rows: int) -> bool:
        return rows <= PACKAGE_MAX_ROWS

    def step_kind(self, rows: int, slots: StaticSlots) -> tuple:
        return ()  # one package for every row count and slot count: only its build or load compiles

    def ready(self) -> bool:
        """Whether the package is already on disk (no compiling before the first step)."""
        return self.package.ready()

    def warm_up_rows(self) -> list[int]:
        return [2]  # one package serves every row count

    def warm_up_description(self, rows: int) -> str:
        verb = "loading" if self.ready() else "compiling (about a minute, once per model)"
        return f"{verb} the forward's package"

    def _compiled_step(self, ids, positions, mask, slots: StaticSlots) -> torch.Tensor:
        rows = ids.shape[1]
        slot_index = torch.arange(slots.past, slots.past + rows, device=ids.device)
        return self.package.run(ids, positions, mask, slot_index, slots.buffers)

    @property
    def options(self) -> dict:
        return {"backend": "aoti", "max_autotune": False, "linears": self.linears, "weights": "shared"}

    def describe(self) -> str:
        package = self.package
        return (f"one AOTInductor package for 1-{PACKAGE_MAX_ROWS} rows ({package.built} built, "
                f"{package.loaded} loaded from {package.folder})")


class GraphRunner(StepRunner):
    """``torch.compile`` graphs, one per row bucket and slot tier; rows beyond the last bucket run
    eagerly. ``options``: Inductor's; ``tracing_config``: Inductor settings dynamo must see while it
    traces (freezing: whether the weights become graph constants)."""

    def __init__(self, model: torch.nn.Module, backend: str | Callable, buckets: Sequence[int],
                 max_autotune: bool, options: dict | None, tracing_config: dict):
        super().__init__(model)
        self._slots: StaticSlots | None = None  # the caller's slots, during a step only
        self.backend, self.buckets, self.max_autotune = backend, tuple(sorted(set(buckets))), max_autotune
        self.linears = linear_path(model)
        self._tracing_config = tracing_config
        device = model_device(model)
        mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
        self._graph = torch.compile(self._step, backend=backend, dynamic=False, options=options, mode=mode)

    def rows_for(self, rows: int) -> int:
        return bucket_for(rows, self.buckets) or rows

    def compiles(self, rows: int) -> bool:
        return rows in self.buckets

    def ready(self) -> bool:
        return False  # each process compiles its graphs again

    def warm_up_rows(self) -> list[int]:
        return list(self.buckets)

    def warm_up_description(self, rows: int) -> str:
        return f"compiling the forward for {rows} row{'s' * (rows > 1)}"

    def _step(self, ids, positions, mask) -> torch.Tensor:
        return eager_step(self.model, self.cache_name, self._slots, ids, positions, mask)

    def _compiled_step(self, ids, positions, mask, slots: StaticSlots) -> torch.Tensor:
        # The graph reads the slots as an attribute, which dynamo guards: other slots, another graph;
        # they are the caller's for this call only.
        self._slots = slots
        try:
            with (torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT),
                  torch._inductor.config.patch(self._tracing_config)):
                return self._graph(ids, positions, mask)
        finally:
            self._slots = None

    @property
    def options(self) -> dict:
        weights = "frozen" if self._tracing_config.get("freezing") else "shared"
        return {"backend": str(self.backend), "max_autotune": self.max_autotune, "linears": self.linears,
                "weights": weights}

    def describe(self) -> str:
        return f"torch.compile ({self.backend}) graphs for {'/'.join(map(str, self.buckets))} rows"


# A runner's name -> its class (``compiled.compiled_adapter`` builds the compiled ones).
RUNNERS = {"eager": EagerRunner, "package": PackageRunner, "graphs": GraphRunner}
