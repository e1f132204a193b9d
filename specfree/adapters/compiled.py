"""A compiled forward over static shapes (gpt-fast's recipe, for any transformers causal LM).

Eager torch runs every linear layer through the BLAS library's own kernels, whose few-row paths
are fast on some CPUs only. Inductor, with the weights frozen into the graph, generates its own
kernels per shape; a compiled graph serves one shape, so the shapes are made static:

- the KV cache is a set of preallocated slots (transformers' ``StaticLayer``, grown in tiers:
  ``min_slots`` * 2^k for torch.compile, steps of 256 for packages) and the mask spans all of
  them (``masks.bucketed.static_mask``);
- for torch.compile, a step's rows are padded up to a bucket (1, 2, 4, 8, 16, 32;
  ``masks.bucketed.pad_rows``); a package takes any row count up to ``packaged.MAX_ROWS``;
- keeping the accepted rows moves their KV down inside the static buffers and sets the fill
  length: the buffers never move, so a graph (or a CUDA graph) stays valid.

The linear layers run specfree's few-row kernel (``specfree.kernels``), a custom op that the
compiled code calls as it is, on the model's own weights: nothing is frozen or repacked, so the
compiled path holds no second copy of the weights.

Two ways to compile the same static steps. On a CPU, one AOTInductor package (``packaged.py``)
for every row count and KV tier: built once per model architecture (about a minute), kept on
disk and loaded by a later process in a second or two, its weights the model's own tensors. On a GPU, ``torch.compile`` with the graphs
run as CUDA graphs (``mode="reduce-overhead"``): written for, never run in this project so far;
``backend="inductor"`` also selects it on a CPU (each process compiles again). A compile that
fails falls back, with one warning, to running the same static steps eagerly: slower, never wrong.

The adapter works on its own copy of the model's module tree (parameters shared, not copied):
graphs are specialised to the modules they traced, and an eager engine over the same model may
swap those (linear layers, norms) at any time.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers.cache_utils import Cache, StaticLayer

from specfree.adapters.hf import HFAdapter, verifies_chains
from specfree.adapters.kv import growing_cache
from specfree.adapters.packaged import MAX_ROWS as PACKAGE_MAX_ROWS
from specfree.adapters.packaged import StepPackage
from specfree.kernels import linear_path
from specfree.masks.bucketed import ROW_BUCKETS, bucket_for, pad_rows, static_mask

MIN_SLOTS = 512  # KV slots of the first tier
PACKAGE_TIER_STEP = 256  # packages grow the KV slots by this many at a time
AUTOTUNE_MIN_PARAMS = 20_000_000
# A graph per (row bucket, slot tier); dynamo's default limit of 8 per function is too few.
RECOMPILE_LIMIT = 256


def inductor_options(device: torch.device, max_autotune: bool, gemm_backends: str = "CPP,ATEN",
                     kernel_linears: bool = False) -> dict:
    """Inductor settings. CPU with torch's linear layers: weights frozen into the graph
    (constant-folded and prepacked); ``max_autotune`` also lets Inductor's C++ GEMM template
    compete with ``gemm_backends``. With specfree's kernel the linear layers are not Inductor's,
    and the weights stay the model's own: nothing to freeze or tune."""
    if device.type != "cpu" or kernel_linears:
        return {}
    # Autotuning prints a table per matrix shape to stderr unless told not to.
    options = {"freezing": True, "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    if max_autotune:
        options.update({"max_autotune": True, "max_autotune_gemm_backends": gemm_backends})
    return options


def package_options() -> dict:
    """Inductor settings of packages: none beyond the defaults. Their weights are the model's own
    tensors (``packaged.load_package``), which rules out freezing, and with it Inductor's C++ GEMM;
    the linear layers are specfree's kernel (or, where it cannot be built, ATen's)."""
    return {}


def resolve_backend(backend: str | Callable, device: torch.device) -> str | Callable:
    """``"auto"``: packages on a CPU (torch 2.6+ has them), ``"inductor"`` elsewhere."""
    if backend != "auto":
        return backend
    packaged = device.type == "cpu" and hasattr(torch._inductor, "aoti_load_package")
    return "aoti" if packaged else "inductor"


def resolve_autotune(max_autotune: bool | None, model: torch.nn.Module) -> bool:
    """``None``: autotune models of ``AUTOTUNE_MIN_PARAMS`` parameters or more."""
    if max_autotune is not None:
        return max_autotune
    return sum(p.numel() for p in model.parameters()) >= AUTOTUNE_MIN_PARAMS


def shared_parameter_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s modules and config that shares its parameters and buffers."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


class CompiledHFAdapter(HFAdapter):
    """``HFAdapter``'s interface (forward / prefill / commit / reset) over static shapes, compiled.

    A compiled step per row bucket (a package serves every KV tier; a torch.compile graph serves
    one); rows beyond the last bucket run eagerly on the same static cache. ``backend``:
    ``"aoti"`` (packages kept in ``package_dir``, a temporary folder when None), a
    ``torch.compile`` backend, or ``"auto"``: packages on a CPU, ``"inductor"`` elsewhere.
    ``max_autotune=None`` autotunes models of ``AUTOTUNE_MIN_PARAMS`` parameters or more: it
    benchmarks kernels for every matrix shape, minutes of compiling that only large matrices repay.
    """

    def __init__(self, model, *, buckets: Sequence[int] = ROW_BUCKETS, max_autotune: bool | None = None,
                 backend: str | Callable = "auto", min_slots: int = MIN_SLOTS, package_dir: str | Path | None = None,
                 tier_step: int = PACKAGE_TIER_STEP, check_tree_mask: bool = True, grouped_attention: bool = True,
                 linear_kernel: str = "few_row", cache_dir: str | Path | None = None):
        self.cache: Cache | None = None  # the static slots, made on first use (``_ensure_slots``)
        self._kv: list[torch.Tensor] = []  # every layer's keys and values buffers, in order
        self.packages: StepPackage | None = None  # AOTInductor's step, when that is the backend
        self._past = 0
        super().__init__(shared_parameter_copy(model), check_tree_mask=False, grouped_attention=grouped_attention,
                         linear_kernel=linear_kernel, cache_dir=cache_dir)
        self.linears = linear_path(self.model)
        kernel_linears = self.linears != "library"
        self.buckets = tuple(sorted(set(buckets)))
        self.min_slots, self.tier_step = min_slots, tier_step
        self.compile_s = 0.0  # wall time of the calls that compiled (or loaded) a new graph
        self.failure: str | None = None  # why the compiled path was given up, if it was
        self._shapes_seen: set[tuple] = set()
        self._layer_shapes = self._probe_layer_shapes()
        self._step_start = 0
        self._tracing_config: dict = {}
        max_autotune = resolve_autotune(max_autotune, model)
        backend = resolve_backend(backend, self.device)
        self.backend, self.max_autotune = backend, max_autotune
        if backend == "aoti":
            self.packages = StepPackage(self.model, package_dir, package_options(), self.linears)
            self._compiled_step = self._packaged_step
        else:
            options = (inductor_options(self.device, max_autotune, kernel_linears=kernel_linears) or None) \
                if backend == "inductor" else None
            # Dynamo decides whether parameters become graph constants while tracing, from the global
            # inductor config: freezing given only in ``options`` would leave the weights as inputs.
            self._tracing_config = {"freezing": True} if options and options.get("freezing") else {}
            mode = "reduce-overhead" if self.device.type == "cuda" and backend == "inductor" else None
            self._compiled_step = torch.compile(self._model_step, backend=backend, dynamic=False, options=options,
                                                mode=mode)
        if check_tree_mask:
            compiled, self._compiled_step = self._compiled_step, None  # the probe runs eagerly: no extra graphs
            try:
                self.check_causal()
                self.check_tree_mask()
            finally:
                self._compiled_step = compiled

    @property
    def compiled(self) -> bool:
        return self._compiled_step is not None

    @property
    def options(self) -> dict:
        """What decides this path's kernels (the cost curve cache keys on it)."""
        return {"backend": str(self.backend), "max_autotune": self.max_autotune, "linears": self.linears,
                "weights": "shared" if self.packages is not None or self.linears != "library" else "frozen"}

    def describe(self) -> str:
        """How the steps were compiled, for reports."""
        linears = "specfree's few-row kernel" if self.linears != "library" else "torch's"
        if self.packages is not None:
            return (f"one AOTInductor package for 1-{PACKAGE_MAX_ROWS} rows ({self.packages.built} built, "
                    f"{self.packages.loaded} loaded from {self.packages.folder}), linear layers {linears} "
                    f"({self.linears}), weights shared with the model")
        buckets = "/".join(map(str, self.buckets))
        return (f"torch.compile ({self.backend}) graphs for {buckets} rows over {self.slots} KV slots, "
                f"linear layers {linears} ({self.linears})")

    # ---- the static cache ---------------------------------------------------------------
    @torch.inference_mode()
    def _probe_layer_shapes(self) -> list[tuple[torch.Size, torch.Size]]:
        """Each cache layer's key and value shape for one token, from one eager forward."""
        probe = growing_cache()
        self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), past_key_values=probe,
                   use_cache=True, logits_to_keep=1)
        return [(layer.keys.shape, layer.values.shape) for layer in probe.layers]

    def _ensure_slots(self, needed: int) -> None:
        """Room for ``needed`` slots: a larger tier when they do not fit (new graphs follow)."""
        capacity = self.cache.layers[0].max_cache_len if self.cache is not None else 0
        if needed <= capacity:
            return
        slots = self.tier(needed)
        layers = []
        for index, (key_shape, value_shape) in enumerate(self._layer_shapes):
            layer = StaticLayer(max_cache_len=slots)
            # lazy_initialization allocates [B, H, slots, D] buffers from the shapes of one token's states
            layer.lazy_initialization(torch.empty(key_shape, dtype=self.dtype, device=self.device),
                                      torch.empty(value_shape, dtype=self.dtype, device=self.device))
            if self.cache is not None and self._past:
                old = self.cache.layers[index]
                layer.keys[:, :, : self._past] = old.keys[:, :, : self._past]
                layer.values[:, :, : self._past] = old.values[:, :, : self._past]
            layers.append(layer)
        self.cache = Cache(layers=layers)
        self._kv = [t for layer in layers for t in (layer.keys, layer.values)]
        self._set_length(self._past)

    def tier(self, needed: int) -> int:
        """The slots of the smallest tier that holds ``needed``: ``min_slots`` doubled as often as
        needed for torch.compile (a graph per tier); for packages, which take any slot count, the
        next multiple of ``tier_step`` (every step attends over all slots: on SmolLM2 at 256 tokens
        of context, 8 rows cost 35.8 ms over 512 slots and 49.2 ms over 2048)."""
        if self.packages is not None:
            return max(self.min_slots, -(-needed // self.tier_step) * self.tier_step)
        slots = self.min_slots
        while slots < needed:
            slots *= 2
        return slots

    def ready_without_compiling(self) -> bool:
        """Whether the step is already compiled on disk (packages only: torch.compile's graphs are
        rebuilt by each process)."""
        return self.packages is not None and self.packages.ready()

    def _compiles(self, rows: int) -> bool:
        """Whether a step of ``rows`` (padded) rows runs compiled code."""
        if not self.compiled:
            return False
        return rows <= PACKAGE_MAX_ROWS if self.packages is not None else rows in self.buckets

    @torch.inference_mode()
    def _set_length(self, length: int) -> None:
        self._past = length
        if self.cache is not None:
            for layer in self.cache.layers:
                layer.cumulative_length.fill_(length)

    @property
    def past_len(self) -> int:
        return self._past

    @property
    def slots(self) -> int:
        return self.cache.layers[0].max_cache_len if self.cache is not None else 0

    def reset(self) -> None:
        if self.packages is not None and self.slots > self.min_slots:
            self.cache, self._kv = None, []  # packages take any tier: the next request starts small again
        self._set_length(0)  # otherwise the buffers stay: torch.compile's graphs hold on to them

    # ---- steps --------------------------------------------------------------------------
    def _model_step(self, ids: torch.Tensor, positions: torch.Tensor, mask) -> torch.Tensor:
        # ids, positions [1, B]; mask [1, 1, B, slots] (or one per layer kind) -> logits [1, B, V]
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=self.cache,
                          use_cache=True).logits

    def _static_mask(self, allowed: torch.Tensor, past: int, positions: torch.Tensor):
        positions = positions.cpu()
        if self.layer_windows is None:
            return static_mask(allowed, past, positions, self.slots, self.dtype, self.sliding_window).to(self.device)
        return {kind: static_mask(allowed, past, positions, self.slots, self.dtype, window).to(self.device)
                for kind, window in self.layer_windows.items()}

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of rows already padded to their bucket; their KV goes into slots past..past+B."""
        past = self._past
        rows = tokens.numel()
        self._ensure_slots(past + rows)
        mask = self._static_mask(allowed, past, positions)
        # Fresh inference tensors: a graph's guards tell them from tensors made outside inference mode.
        ids, pos = tokens.to(self.device).clone()[None], positions.to(self.device).clone()[None]
        if self._compiles(rows):
            shape = (rows, self.slots)
            start = time.perf_counter()
            try:
                with (torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT),
                      torch._inductor.config.patch(self._tracing_config)):
                    logits = self._compiled_step(ids, pos, mask)
            except Exception as exc:  # any compiler failure: the same step, eagerly
                self._give_up(exc)
                self._set_length(past)
            else:
                if shape not in self._shapes_seen:
                    self._shapes_seen.add(shape)
                    self.compile_s += time.perf_counter() - start
                self._past = past + rows
                return logits[0]
        logits = self._model_step(ids, pos, mask)
        self._past = past + rows
        return logits[0]

    def _packaged_step(self, ids: torch.Tensor, positions: torch.Tensor, mask) -> torch.Tensor:
        """``_model_step`` through the AOTInductor package (built or loaded once)."""
        rows = ids.shape[1]
        inputs = (ids, positions, mask, torch.arange(self._past, self._past + rows, device=self.device), self._kv)
        return self.packages.get(_export_example(inputs))(*inputs)

    def _give_up(self, exc: Exception) -> None:
        self._compiled_step = None
        message = str(exc).split("from user code:")[0]  # dynamo appends the traced source
        self.failure = f"{type(exc).__name__}: {' '.join(message.split())[:300]}"
        warnings.warn(f"compiling the forward failed ({self.failure}); decoding continues on the eager path",
                      stacklevel=4)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> None:
        """Cache the KV of ``ids`` [L] with eager causal forwards (a graph per prompt length would
        never be reused)."""
        if ids.numel() == 0:
            return
        past, q = self._past, ids.numel()
        self._ensure_slots(past + q)
        positions = torch.arange(past, past + q)
        mask = self._static_mask(torch.ones(q, q, dtype=torch.bool).tril(), past, positions)
        self.model(input_ids=ids.to(self.device)[None], position_ids=positions.to(self.device)[None],
                   attention_mask=mask, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self._set_length(past + q)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, allowed: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [Q, V] for rows ``tokens`` [Q], as ``HFAdapter.forward``; run padded to a bucket."""
        past = self._past
        q = tokens.numel()
        if allowed is None:
            allowed = torch.ones(q, q, dtype=torch.bool).tril()
        if positions is None:
            positions = past + allowed.sum(-1) - 1
        # A package takes any row count; torch.compile a graph per bucket (beyond the last: eager).
        bucket = q if self.packages is not None else bucket_for(q, self.buckets) or q
        tokens, allowed, positions = pad_rows(tokens.cpu(), allowed, positions.cpu(), bucket)
        self._step_start = past
        return self._run(tokens, positions, allowed)[:q]

    def _forward(self, tokens, positions, mask, logits_to_keep: int = 0) -> torch.Tensor:
        """Plain causal rows (``check_tree_mask``'s reference forward)."""
        q = tokens.numel()
        self._step_start = self._past
        return self._run(tokens.cpu(), positions.cpu(), torch.ones(q, q, dtype=torch.bool).tril())

    @torch.inference_mode()
    def commit(self, keep: list[int], rows: int) -> None:
        """Keep the KV of this step's rows ``keep`` (ascending, keep[0] == 0), drop the rest
        (padding rows included); ``rows`` is ignored: the adapter knows where the step began."""
        past, n = self._step_start, len(keep)
        if keep[-1] != n - 1:
            index = torch.tensor(keep, device=self.device) + past
            for layer in self.cache.layers:
                # index_select copies first, so the in-place write cannot read moved rows.
                layer.keys[:, :, past : past + n] = layer.keys.index_select(2, index)
                layer.values[:, :, past : past + n] = layer.values.index_select(2, index)
        self._set_length(past + n)

    # ---- warming up ---------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, slots: int | None = None, progress: bool = True) -> float:
        """Compile (or load) every bucket's step for a cache of ``slots`` (default: the first tier)
        before the first request; returns the seconds spent. Shows progress on stderr when asked."""
        if not self.compiled:
            return 0.0
        start = time.perf_counter()
        self.reset()
        self._ensure_slots(slots or self.min_slots)
        sizes = list(self.buckets) if self.packages is None else [2]  # a package serves every row count
        bar = _progress(progress)
        with bar:
            task = bar.add_task("compiling the forward", total=len(sizes))
            for rows in sizes:
                if self.packages is not None:
                    verb = "loading" if self.packages.ready() else "compiling (about a minute, once per model)"
                    bar.update(task, description=f"{verb} the forward's package")
                else:
                    bar.update(task, description=f"compiling the forward for {rows} row{'s' * (rows > 1)}")
                self.forward(torch.zeros(rows, dtype=torch.long))
                self.commit([0], rows)
                self.reset()
                if not self.compiled:
                    break
                bar.advance(task)
        return time.perf_counter() - start


def _export_example(inputs: tuple) -> tuple:
    """``inputs`` of at least two rows: export leaves a dimension of size 1 static, and the
    package must take any row count. Only shapes matter to the export."""
    ids, positions, mask, slot_index, kv = inputs
    if ids.shape[1] > 1:
        return inputs
    masks = {kind: m.repeat(1, 1, 2, 1) for kind, m in mask.items()} if isinstance(mask, dict) \
        else mask.repeat(1, 1, 2, 1)
    return ids.repeat(1, 2), positions.repeat(1, 2), masks, slot_index.repeat(2), kv


def _progress(show: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True, disable=not show)


# ---- choosing the path ------------------------------------------------------------------
COMPILE_VALUES = ("auto", "true", "false")
# compile=auto compiles only where the last warm-up of the same setup took at most this long, so a
# newcomer's first answer never waits on minutes of compiling.
AUTO_READY_S = 20.0


def check_compile(value) -> str:
    """``compile`` as one of auto/true/false (booleans and their spellings accepted)."""
    from specfree.errors import ConfigError

    text = str(value).lower() if isinstance(value, (bool, str)) else None
    if text not in COMPILE_VALUES:
        raise ConfigError(f"compile must be auto, true or false, got {value!r}")
    return text


def unsupported_reason(model) -> str | None:
    """Why this model cannot be compiled here, or None."""
    import shutil
    import sys

    device = model.get_input_embeddings().weight.device
    if device.type not in ("cpu", "cuda"):
        return f"torch.compile is not used on {device.type} devices"
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        return "no C++ compiler was found (install g++ or clang++)"
    if sys.platform not in ("linux", "darwin"):
        return f"compiling the forward is supported on Linux and macOS, not {sys.platform}"
    if verifies_chains(model):
        return "models with recurrent or chunked-attention layers verify chains on the eager path only"
    return None


def compiled_marker(model, cache_dir, **knobs) -> Path:
    """The file that says this setup (model, device, dtype, threads, torch, knobs) compiled here
    before with torch.compile, so Inductor's on-disk caches should be warm."""
    import hashlib
    import json

    params = sum(p.numel() for p in model.parameters())
    device = model.get_input_embeddings().weight.device
    setup = [model.config.model_type, params, str(device), str(model.dtype), torch.get_num_threads(),
             torch.__version__, sorted((k, str(v)) for k, v in knobs.items())]
    key = hashlib.sha1(json.dumps(setup).encode()).hexdigest()[:16]
    return Path(cache_dir) / "compiled" / f"{key}.json"


def make_adapter(model, compile="auto", *, linear_kernel: str = "few_row", cache_dir=None,
                 progress: bool = True, slots: int | None = None, **compiled_knobs) -> HFAdapter:
    """The adapter for ``compile``: ``true`` compiles (minutes the first time on a machine, with
    progress shown; one warning and the eager adapter where it cannot or fails); ``auto`` does so
    only where that is quick here (AOTInductor packages of this model already on disk, or a
    torch.compile warm-up that last took at most ``AUTO_READY_S``), else stays eager; ``false`` is
    the eager adapter. ``slots``: the KV slots to compile for up front (larger tiers compile their
    own steps when needed). Packages and markers live under ``cache_dir``/compiled."""
    import json
    import logging

    from specfree.adapters.loading import DEFAULT_CACHE

    choice = check_compile(compile)
    eager = dict(linear_kernel=linear_kernel, cache_dir=cache_dir)
    if choice == "false":
        return HFAdapter(model, **eager)
    reason = unsupported_reason(model)
    if reason is not None:
        if choice == "true":
            warnings.warn(f"compile=true: {reason}; decoding on the eager path", stacklevel=3)
        return HFAdapter(model, **eager)
    folder = Path(cache_dir or DEFAULT_CACHE) / "compiled"
    marker = compiled_marker(model, folder.parent, **compiled_knobs)
    if choice == "auto" and not _ready_without_compiling(model, folder, marker, compiled_knobs, linear_kernel,
                                                         cache_dir):
        logging.getLogger("specfree").debug(
            "compile=auto: no compiled forward of this model is ready fast enough here, so this run is eager; "
            "compile=true builds one (minutes the first time)")
        return HFAdapter(model, **eager)
    from specfree.errors import UnsupportedModelError

    try:
        adapter = CompiledHFAdapter(model, package_dir=folder, linear_kernel=linear_kernel, cache_dir=cache_dir,
                                    **compiled_knobs)
    except UnsupportedModelError:  # no tree mask: the eager adapter's probes choose how it verifies chains
        if choice == "true":
            warnings.warn("compile=true: this model verifies chains, which run on the eager path only; "
                          "decoding on the eager path", stacklevel=3)
        return HFAdapter(model, **eager)
    seconds = adapter.warm_up(slots, progress=progress)
    if not adapter.compiled:  # it warned why
        return HFAdapter(model, **eager)
    if adapter.packages is None:  # packages on disk speak for themselves
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"warm_up_s": seconds, "buckets": list(adapter.buckets)}))
    return adapter


def _ready_without_compiling(model, folder: Path, marker: Path, knobs: dict, linear_kernel: str,
                             cache_dir) -> bool:
    """What ``CompiledHFAdapter.ready_without_compiling`` would say, without building the adapter
    (its probes cost most of a second on SmolLM2, every eager start); for torch.compile, whether
    the last warm-up took at most ``AUTO_READY_S``."""
    import json

    device = model.get_input_embeddings().weight.device
    if resolve_backend(knobs.get("backend", "auto"), device) == "aoti":
        from specfree.kernels import load_kernels

        isa = load_kernels(cache_dir) if linear_kernel == "few_row" else None  # built at most once, ~10 s
        linears = f"few_row-{isa}" if isa else "library"
        return StepPackage(model, folder, package_options(), linears).ready()
    try:
        return json.loads(marker.read_text())["warm_up_s"] <= AUTO_READY_S if marker.is_file() else False
    except (ValueError, KeyError, TypeError):
        return False  # a damaged marker: as if never compiled
