"""Adapter over any transformers causal LM that takes a 4D additive mask and position ids.

A model walks down once: ``prepare_model`` swaps in the kernels (few-row linears from
``specfree.kernels``, fused norms, grouped-query SDPA, attention that takes a tree mask),
``probes.inspect_model`` decides what it can do (a frozen ``capabilities.Capabilities``: tree or
chain, cache kind, limits), and the adapter picks a KV store (``stores``: a cache growing in place,
recurrent snapshots with replay, the whole sequence rerun, static slots) and a runner (``runners``:
eager forwards, an AOTInductor package, torch.compile graphs; ``compiled.compiled_adapter`` builds
the compiled ones). A step is then "lay out the rows, run them over the store": ``forward`` fills in
the positions, the store makes the masks and keeps the accepted rows' KV (``commit``).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch

from specfree.adapters import probe_cache, probes
from specfree.adapters.attention import attention_path, use_grouped_sdpa, use_maskable_attention, use_tree_attention
from specfree.adapters.capabilities import Capabilities, model_device, model_structure
from specfree.adapters.norms import fuse_norms, own_norms
from specfree.adapters.pinned import pin_math
from specfree.adapters.runners import EagerRunner, StepRunner
from specfree.adapters.kv_buffers import StaticSlots, growing_cache
from specfree.adapters.stores import STORES, KVStore, SlotStore
from specfree.kernels import int8_layers, linear_kind, linear_path, prepare_linears
from specfree.progress import StepsShown
from specfree.settings import DEFAULTS, EngineSettings

if TYPE_CHECKING:  # transformers' modeling code: a warm start never loads it
    from transformers import PreTrainedModel

# The one mode every forward specfree runs is under: probes, the cost curve, prompts, steps and
# replays alike, whatever the model's parameters' ``requires_grad`` (after ``from_pretrained`` they
# all require it). It is set at one boundary, the adapter's: its construction once the kernels are
# swapped in, and each call into it (below); stores, runners, probes and the cost curve run only
# inside those calls, so none sets it again. No autograd graph is built, and the state one forward
# leaves (KV, recurrent states, snapshots) is usable by the next.
grad_free = torch.inference_mode


def prepare_model(model, grouped_attention: bool = True, settings: EngineSettings = DEFAULTS) -> int:
    """Swap in the kernels every adapter runs (each swap computes the same function; doing it twice
    changes nothing): attention that takes a tree mask, grouped-query SDPA without a per-step copy
    of the cache, specfree's few-row linear kernel (``settings.linear_kernel``; coded layers at
    ``settings.precision``), fused RMSNorms. Returns how many linear layers run the kernel."""
    use_maskable_attention(model)
    if grouped_attention:
        # each row's bits independent of the step's other rows; else the same math as SDPA without a
        # per-step copy of the cache for masked rows
        use_tree_attention(model, settings.cache_dir) or use_grouped_sdpa(model)
    kernel_linears = prepare_linears(model, settings)  # rows at one row's price
    fuse_norms(model)  # bit-identical, fewer dispatches per forward
    # int8's coded layers give other bits than transformers' anyway: the norms take specfree's
    # one-pass row kernel too (a tenth of a small model's step), exact keeps transformers' bits
    own_norms(model, bool(int8_layers(model)))
    pin_math(model)  # bit-identical; a compiled step then computes the eager step's bits
    return kernel_linears


class HFAdapter:
    name = "hf"
    eager_because: str | None = None  # why make_adapter gave the eager path (None: compiling was never asked)

    def __init__(self, model: PreTrainedModel, check_tree_mask: bool = True, grouped_attention: bool = True,
                 settings: EngineSettings = DEFAULTS, *, runner: StepRunner | None = None,
                 slots: StaticSlots | None = None, capabilities: Capabilities | None = None, **given: Any):
        """``settings`` (``specfree.settings.EngineSettings``; ``given``: any of its fields over it) says
        how the layers run. ``linear_kernel``: ``"few_row"`` runs CPU linear layers through specfree's kernel
        (``specfree.kernels``; built once under ``cache_dir``, the library's where it cannot be),
        holding a weight that is exactly a 4- or 8-bit code's values (a dequantized GGUF) as those
        codes, ``"few_row_fp32"`` the same with every weight kept float32, ``"library"`` keeps
        torch's ``F.linear``. ``precision``: how layers held as codes multiply, ``"exact"`` (float32
        activations), ``"int8"`` (8-bit activations) or ``"auto"`` (int8 for a model read from a
        quantized GGUF file where a probe finds it faster on this CPU, else exact:
        ``kernels.precision``). ``runner``: a
        compiled runner, and ``slots``: the static KV slots its steps run over (held by the KV manager
        of the adapter's ``SlotStore``, their one owner), instead of eager forwards over a growing cache; tree-verified
        models only. ``capabilities``: the record ``probes.inspect_model`` made for
        this model (given: no probes run); ``check_tree_mask=False`` skips the probes."""
        structure = capabilities or model_structure(model)  # refusals first, before any kernel is swapped
        self.model = model.eval()
        # Outside the mode: the weights the kernels repack stay the model's own, usable by any caller.
        settings = settings.changed(**given)
        self._cache_dir = cache_dir = settings.cache_dir
        self.kernel_linears = prepare_model(model, grouped_attention, settings)
        structure = dataclasses.replace(structure, attention=attention_path(model))  # fixed from here on
        self._device = model_device(model)
        if (runner is None) != (slots is None):
            raise ValueError("a compiled runner and its KV slots come together")
        self._compiled_runner, self._slots = runner, slots
        with grad_free():  # the probes' forwards, and a store's own (a recurrent one finds its mixers)
            self._attach(structure if capabilities else
                         self._inspected(structure, runner is not None, check_tree_mask, cache_dir), runner)

    def _inspected(self, structure: Capabilities, compiled: bool, probe: bool, cache_dir) -> Capabilities:
        """``probes.inspect_model``'s record, without its forwards where this architecture passed
        them all here before as a tree-verified model (``probe_cache``)."""
        if probe and not structure.chain_only and probe_cache.passed_before(self.model, cache_dir, compiled):
            return structure
        caps = probes.inspect_model(structure, self._probe, compiled=compiled, probe=probe)
        if probe and caps is structure and not caps.chain_only:
            probe_cache.remember_pass(self.model, cache_dir, compiled)
        return caps

    def _attach(self, capabilities: Capabilities, runner: StepRunner | None) -> None:
        self.capabilities = capabilities
        self.runner = runner or EagerRunner(self.model, capabilities.cache_argument, capabilities.takes_positions)
        self.store: KVStore = (SlotStore(self.model, capabilities, runner, self._slots) if runner is not None
                               else STORES[capabilities.store](self.model, capabilities, self.runner))

    def _probe(self, capabilities: Capabilities) -> HFAdapter:
        """An adapter over the same, already prepared model, running as ``capabilities`` say (the
        probes try a mode on it): the model is prepared once."""
        probe = copy.copy(self)
        probe._attach(capabilities, self._compiled_runner)
        return probe

    # ---- what the engine reads (``protocol.Adapter``) ------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def family(self) -> str:
        return self.capabilities.family

    @property
    def vocab_size(self) -> int:
        return self.capabilities.vocab_size

    @property
    def max_length(self) -> int:
        return self.capabilities.max_length

    @property
    def past_len(self) -> int:
        return self.store.past

    @property
    def rollback_s(self) -> float:
        """The last commit's rollback time (stores that roll back)."""
        return self.store.rollback_s

    # ---- a step ---------------------------------------------------------------------------
    @property
    def state_version(self) -> int:
        """A count of the calls that changed the kept KV: the prompt cache reuses what an engine left
        only if nothing (another engine on this adapter, a cost measurement) touched it since."""
        return getattr(self, "_version", 0)

    def _touch(self) -> None:
        self._version = self.state_version + 1

    @grad_free()
    def reset(self) -> None:
        self._touch()
        self.store.reset()

    @grad_free()
    def prefill(self, ids: torch.Tensor) -> None:
        """Keep the KV of ``ids`` [L] (a plain causal forward; its logits are not needed)."""
        self._touch()
        if ids.numel():
            self.store.prefill(ids)

    @grad_free()
    def forward(self, tokens: torch.Tensor, allowed: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [Q, V] for rows ``tokens`` [Q]; ``allowed`` [Q, Q] says which new rows each row sees.

        Without ``positions`` a row's position is the number of entries it sees minus one.
        ``allowed=None`` means plain causal rows.
        """
        self._touch()
        if positions is None:
            seen = allowed.sum(-1) if allowed is not None else torch.arange(1, tokens.numel() + 1)
            positions = self.store.past + seen - 1
        return self.store.run(tokens, allowed, positions)

    @grad_free()
    def run_plain(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits of rows under the model's own causal mask, no mask passed (the probes' reference)."""
        self._touch()
        return self.store.run_plain(tokens, positions)

    @grad_free()
    def commit(self, keep: list[int], rows: int) -> None:
        """Keep the KV of this step's rows ``keep`` (ascending, keep[0] == 0), drop the rest.

        ``rows`` is how many rows the step's forward appended.
        """
        self._touch()
        self.store.keep(keep, rows)

    # ---- the prompt cache ------------------------------------------------------------------
    @property
    def can_truncate(self) -> bool:
        """Whether ``truncate`` can cut the kept tokens back to a prefix (not recurrent or rerun stores)."""
        return self.store.croppable

    @property
    def exact_rows(self) -> int:
        """The most rows one forward takes with every row's bits its own (the runner's)."""
        return self.runner.exact_rows

    @property
    def rows_exact(self) -> bool:
        """Whether a row has the same bits whatever else its forward runs (up to ``LONG_ROWS`` rows),
        so a row computed in a prefill chunk or a verify step equals the one-row forward's: the
        row-exact attention operator, no decoder linear layer left on torch's GEMM, and a probe
        (``_rows_probe``: one forward of 24 rows against 8 rows and then 16 of one) agreeing bit
        for bit. Families that run the operator but route rows together (Mixtral's experts) fail
        the probe. Decided once: the layers do not change once prepared."""
        if getattr(self, "_rows_exact", None) is None:
            head = self.model.get_output_embeddings()
            self._rows_exact = (self.capabilities.attention == "tree_attention" and bool(self.kernel_linears)
                                and not any(type(m) is torch.nn.Linear and m is not head for m in self.model.modules())
                                and self._rows_probed())
        return self._rows_exact

    def _rows_probed(self) -> bool:
        """``_rows_probe``'s verdict, from the probe cache where this architecture was probed before."""
        linears = linear_path(self.model)
        verdict = probe_cache.rows_verdict(self.model, self._cache_dir, linears)
        if verdict is None:
            verdict = self._rows_probe()
            probe_cache.remember_rows(self.model, self._cache_dir, linears, verdict)
        return verdict

    @grad_free()
    def _rows_probe(self, rows: int = 24, first: int = 8) -> bool:
        """Logits of ``rows`` random tokens in one eager forward against ``first`` of them and then
        one row at a time, over caches of their own (the adapter's KV is not touched): bit-equal?"""
        runner = EagerRunner(self.model, self.capabilities.cache_argument, self.capabilities.takes_positions)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (1, rows), generator=generator).to(self.device)
        positions = torch.arange(rows, device=self.device)[None]
        whole, _ = runner(ids, positions, None, growing_cache())
        cache = growing_cache()
        parts = [runner(ids[:, :first], positions[:, :first], None, cache)[0]]
        for at in range(first, rows):
            parts.append(runner(ids[:, at : at + 1], positions[:, at : at + 1], None, cache)[0])
        return bool(torch.equal(whole, torch.cat(parts, dim=1)))

    @grad_free()
    def truncate(self, length: int) -> bool:
        """Keep the first ``length`` tokens' KV, drop the rest; False (nothing changed) where the store cannot."""
        if not self.store.croppable or not 0 <= length <= self.store.past:
            return False
        self._touch()
        self.store.crop(length)
        return True

    @grad_free()
    def resume(self, ids) -> int:
        """Start a sequence of prompt ``ids`` (None: from nothing): the KV of its longest prefix
        held (``hold``) is kept, all else dropped; how many ids are kept (0 where the store
        cannot be cut). The KV manager owns the match (``KVManager.join``)."""
        self._touch()
        if ids is None or not self.store.croppable:
            self.store.reset()
            return 0
        return self.store.resume(ids)

    @grad_free()
    def hold(self, ids) -> None:
        """Hold the KV of the first ``len(ids)`` kept tokens, whose ids ``ids`` are, for the next
        ``resume`` (stores that cannot be cut hold nothing)."""
        if self.store.croppable:
            self.store.hold(ids)

    # ---- the compiled runners ---------------------------------------------------------------
    @property
    def compiled(self) -> bool:
        """Whether the steps run compiled code (False on the eager path, and once a compile failed)."""
        return self.runner.compiled

    @property
    def compile_s(self) -> float:
        return self.runner.compile_s

    @property
    def failure(self) -> str | None:
        """Why the compiled steps were given up, if they were."""
        return self.runner.failure

    @property
    def linears(self) -> str:
        return linear_path(self.model)

    @grad_free()
    def warm_up(self, slots: int | None = None, progress: bool = True) -> float:
        """Compile (or load) the runner's steps for ``slots`` KV slots (default: the first tier)
        before the first request; returns the seconds spent. Shows progress on stderr when asked."""
        if not self.compiled:
            return 0.0
        start = time.perf_counter()
        self.reset()
        self.store.slots.room(slots or self.store.slots.min_slots)
        sizes = self.runner.warm_up_rows()
        loading = getattr(self.runner, "ready", lambda: False)()  # a package on disk: nothing to show in a log
        with StepsShown("compiling the forward", len(sizes), show=progress and not loading) as steps:
            for rows in sizes:
                steps.starting(self.runner.warm_up_description(rows))
                self.forward(torch.zeros(rows, dtype=torch.long))
                self.commit([0], rows)
                self.reset()
                if not self.compiled:
                    break
                steps.advance()
        return time.perf_counter() - start

    def cost_identity(self) -> list:
        """What of the model and this process sets a forward's cost (``cost.model_cost_identity``)."""
        from specfree.cost import model_cost_identity

        return model_cost_identity(self)

    def cost_setup(self) -> list:
        """What besides the model's shapes sets a forward's cost (part of the cost curve's cache key):
        the KV layers the cache grows, and the compiled runner's row buckets and options."""
        layer = getattr(getattr(self.store.cache, "layer_class_to_replicate", None), "__name__", None)
        if not self.compiled:
            return [layer]
        return [layer, ["compiled", list(self.runner.buckets), self.runner.options]]

    def describe(self) -> str:
        """How this adapter runs this model, for reports and the CLI (a GGUF's: which types its
        layers hold as codes, and which tensors run as float32)."""
        holdings = getattr(self.model, "gguf_holdings", None)
        held = f"; {holdings.file}: {holdings.summary()}" if holdings is not None else ""
        choice = getattr(self.model, "precision_choice", None)  # kernels.set_precision's, where layers hold codes
        if choice is not None and linear_kind(self.model).coded:
            arithmetic = "8-bit activations" if choice.precision == "int8" else "float32 activations"
            held += f"; precision={choice.precision} (layers held as codes multiply {arithmetic}): {choice.why}"
        if not isinstance(self.runner, StepRunner):
            return f"{self.capabilities.describe()}; attention: {self.capabilities.attention}{held}"
        linears = "specfree's few-row kernel" if self.linears != "library" else "torch's"
        weights = ", weights shared with the model" if self.runner.options["weights"] == "shared" else ""
        return f"{self.runner.describe()}, linear layers {linears} ({self.linears}){weights}{held}"

    def path(self) -> dict:
        """Which forward runs, for records (``decode``'s result.json): compiled (AOTInductor package
        or torch.compile graphs) or eager and why, the linear kernel and ISA, attention, verification."""
        forward = "eager" if not self.compiled else "aoti package" if hasattr(self.runner, "package") else "torch.compile"
        return {"forward": forward, "eager_because": None if self.compiled else (self.failure or self.eager_because),
                "described": self.describe() if self.compiled else None, "linear_kernel": self.linears,
                "precision": "int8" if linear_kind(self.model).int8 else "exact",
                "precision_because": getattr(getattr(self.model, "precision_choice", None), "why", None),
                "attention": self.capabilities.attention, "verification": self.capabilities.describe(),
                "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "gguf": None if getattr(self.model, "gguf_holdings", None) is None else self.model.gguf_holdings.as_dict()}
