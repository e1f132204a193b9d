"""The interface every adapter offers the engine, pricing, the bench and the CLI.

``HFAdapter`` implements it; a plugin's adapter (registered as kind ``adapter``) implements the
same members: every one listed here is read by some caller outside ``specfree/adapters`` (the
engine, the cost curve, the bench, the CLI, the tests). Its ``capabilities`` can be ``capabilities.model_structure(model)`` (what the
model's structure decides) or a ``Capabilities`` built by hand: a plain tree-verifying model needs
only the first seven fields.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specfree.adapters.capabilities import Capabilities
from specfree.adapters.runners import EagerRunner, StepRunner
from specfree.adapters.stores import KVStore


@runtime_checkable
class Adapter(Protocol):
    model: torch.nn.Module  # the transformers model (its config, generation_config, parameters)
    capabilities: Capabilities  # what it can do: tree or chain, limits, rollback (frozen)
    store: KVStore  # where the kept rows' KV lives (``stores``: growing, recurrent, rerun, static slots)
    runner: EagerRunner | StepRunner  # how a step's forward runs (``runners``: eager, package, graphs)
    kernel_linears: int  # linear layers running specfree's kernel (0: torch's F.linear throughout)

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def family(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_length(self) -> int: ...

    @property
    def past_len(self) -> int:
        """Tokens whose KV is kept."""

    @property
    def rollback_s(self) -> float:
        """The last commit's rollback time (0 where nothing was rolled back)."""

    @property
    def compiled(self) -> bool:
        """Whether the steps run compiled code."""

    @property
    def compile_s(self) -> float:
        """Wall time spent compiling (or loading) compiled steps so far (0 on the eager path)."""

    @property
    def failure(self) -> str | None:
        """Why the compiled steps were given up, if they were."""

    @property
    def linears(self) -> str:
        """Which linear kernel the model's layers run (``kernels.linear_path``: ``"library"`` or the kernel and ISA)."""

    def reset(self) -> None:
        """Forget every token kept so far."""

    def prefill(self, ids: torch.Tensor) -> None:
        """Keep the KV of ``ids`` [L] (no logits)."""

    def forward(self, tokens: torch.Tensor, allowed: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [Q, V] of rows ``tokens`` [Q]; ``allowed`` [Q, Q]: which new rows each row sees
        (None: plain causal rows); ``positions`` [Q] (None: rows seen minus one, after the past)."""

    def run_plain(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [Q, V] of rows under the model's own causal mask, no mask passed (the probes' reference)."""

    # The prompt cache's (the engine reuses a prefix only where an adapter can be cut, its rows are
    # exact and it has resume and hold, and says why it does not where one lacks them):
    @property
    def can_truncate(self) -> bool:
        """Whether the kept KV can be cut back to a prefix (recurrent state cannot)."""

    @property
    def rows_exact(self) -> bool:
        """Whether a row's bits do not depend on the other rows of its forward (up to ``exact_rows``)."""

    @property
    def exact_rows(self) -> int:
        """The most rows one forward takes with each row's bits its own (``LONG_ROWS``, or fewer)."""

    @property
    def state_version(self) -> int:
        """Changed by every call that changes the kept KV."""

    def truncate(self, length: int) -> bool:
        """Keep the first ``length`` tokens' KV; False where it cannot."""

    def resume(self, ids) -> int:
        """Start a sequence of prompt ``ids`` (None: from nothing), keeping the KV of its longest
        held prefix; how many ids are kept."""
    def hold(self, ids) -> None:
        """Hold the KV of the first ``len(ids)`` kept tokens, whose ids ``ids`` are, for ``resume``."""
    def commit(self, keep: list[int], rows: int) -> None:
        """Keep the KV of the last step's rows ``keep`` (ascending, keep[0] == 0) of its ``rows``."""

    def warm_up(self, slots: int | None = None, progress: bool = True) -> float:
        """Compile (or load) the compiled steps before the first request; seconds spent (0 on the eager path)."""

    def cost_identity(self) -> list:
        """What of the model and this process sets a forward's cost (JSON-able; with ``cost_setup``,
        the cost curve's cache key)."""

    def cost_setup(self) -> list:
        """What besides the model's shapes sets a forward's cost (JSON-able; part of a cache key)."""

    def describe(self) -> str:
        """How this adapter runs this model, for reports and the CLI."""

    def path(self) -> dict:
        """Which forward runs and why, the kernels and the verification mode (JSON-able, for records)."""
