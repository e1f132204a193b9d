"""A compiled forward over static shapes (gpt-fast's recipe, for any transformers causal LM).

Eager torch runs every linear layer through the BLAS library's own kernels, whose few-row paths
are fast on some CPUs only. Inductor, with the weights frozen into the graph, generates its own
kernels per shape; a compiled graph serves one shape, so the shapes are made static:

- the KV cache is a set of preallocated slots (transformers' ``StaticLayer``, grown in tiers:
  ``min_slots`` * 2^k for torch.compile, steps of 128 for packages) and the mask spans all of
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
disk and loaded by a later process in a fraction of a second, its weights the model's own tensors. On a
GPU, ``torch.compile`` with the graphs run as CUDA graphs (``mode="reduce-overhead"``): written
for, never run in this project so far; ``backend="inductor"`` also selects it on a CPU (each
process compiles again). A compile that fails falls back, with one warning, to running the same
static steps eagerly: slower, never wrong.

``compiled_adapter`` composes the compiled path from parts: the eager adapter's kernels, static
KV slots (``kv_buffers.StaticSlots``) and a runner (``runners``: the package or the graphs). It works on
its own copy of the model's module tree (parameters shared, not copied): graphs are specialised
to the modules they traced, and an eager engine over the same model may swap those (linear
layers, norms) at any time. ``make_adapter`` chooses between the eager and the compiled path.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specfree.adapters.capabilities import compile_blocker, model_device
from specfree.adapters.hf import HFAdapter, grad_free, prepare_model
from specfree.adapters.kv_buffers import StaticSlots, cache_argument, growing_cache
from specfree.adapters.packaged import StepPackage, package_loader_class
from specfree.adapters.runners import RUNNERS, PackageRunner
from specfree.files import fingerprint
from specfree.masks.bucketed import ROW_BUCKETS
from specfree.settings import DEFAULTS, EngineSettings

MIN_SLOTS = 512  # KV slots of torch.compile's first tier (a graph per tier)
# Packages take any slot count: they start at one step and grow by one. Every step attends over all
# slots and the KV of a 7B at 512 slots is 0.54 GB, so small steps keep both time and memory down;
# a growth copies the filled slots once (about 1% of a 2048-token decode on a 7B).
PACKAGE_TIER_STEP = 128
AUTOTUNE_MIN_PARAMS = 20_000_000


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
    packaged = device.type == "cpu" and package_loader_class() is not None
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


@grad_free()  # a forward before the adapter exists: the mode its calls run under
def layer_shapes(model) -> list[tuple[torch.Size, torch.Size]]:
    """Each cache layer's key and value shape for one token, from one eager forward."""
    probe = growing_cache()
    device = model_device(model)
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True, logits_to_keep=1,
          **{cache_argument(model): probe})
    return [(layer.keys.shape, layer.values.shape) for layer in probe.layers]


def compiled_adapter(model, *, buckets: Sequence[int] = ROW_BUCKETS, max_autotune: bool | None = None,
                     backend: str | Callable = "auto", min_slots: int | None = None, package_dir: str | Path | None = None,
                     tier_step: int = PACKAGE_TIER_STEP, check_tree_mask: bool = True, grouped_attention: bool = True,
                     settings: EngineSettings = DEFAULTS) -> HFAdapter:
    """An ``HFAdapter`` over static KV slots whose steps run compiled: the same kernels as the
    eager adapter (as ``settings`` says), ``kv_buffers.StaticSlots``, and a runner (``runners``).

    ``backend``: ``"aoti"`` (one package, kept in ``package_dir``; a temporary folder when None), a
    ``torch.compile`` backend (a graph per row bucket in ``buckets`` and slot tier), or ``"auto"``:
    packages on a CPU, ``"inductor"`` elsewhere. ``min_slots``: the first tier's KV slots (default
    ``tier_step`` for packages, ``MIN_SLOTS`` for graphs). ``max_autotune=None`` autotunes models of
    ``AUTOTUNE_MIN_PARAMS`` parameters or more: it benchmarks kernels for every matrix shape,
    minutes of compiling that only large matrices repay. Raises ``UnsupportedModelError`` for a
    model that verifies chains (they run on the eager path).
    """
    max_autotune = resolve_autotune(max_autotune, model)
    model = shared_parameter_copy(model)
    kernel_linears = prepare_model(model, grouped_attention, settings) > 0
    device = model_device(model)
    backend = resolve_backend(backend, device)
    packaged = backend == "aoti"
    first = min_slots or (tier_step if packaged else MIN_SLOTS)
    slots = StaticSlots(layer_shapes(model), model.dtype, device, first, tier_step if packaged else None)
    if packaged:
        runner = RUNNERS["package"](model, package_dir, package_options(), buckets)
    else:
        options = (inductor_options(device, max_autotune, kernel_linears=kernel_linears) or None) \
            if backend == "inductor" else None
        # Dynamo decides whether parameters become graph constants while tracing, from the global
        # inductor config: freezing given only in ``options`` would leave the weights as inputs.
        tracing = {"freezing": True} if options and options.get("freezing") else {}
        runner = RUNNERS["graphs"](model, backend, buckets, max_autotune, options, tracing)
    return HFAdapter(model, check_tree_mask=check_tree_mask, grouped_attention=grouped_attention,
                     settings=settings, runner=runner, slots=slots)


# ---- choosing the path ------------------------------------------------------------------
# compile=auto compiles only where the last warm-up of the same setup took at most this long, so a
# newcomer's first answer never waits on minutes of compiling.
AUTO_READY_S = 20.0


def compiled_marker(model, cache_dir, **knobs) -> Path:
    """The file that says this setup (model, device, dtype, threads, torch, knobs) compiled here
    before with torch.compile, so Inductor's on-disk caches should be warm."""
    params = sum(p.numel() for p in model.parameters())
    device = model_device(model)
    setup = [model.config.model_type, params, str(device), str(model.dtype), torch.get_num_threads(),
             torch.__version__, sorted((k, str(v)) for k, v in knobs.items())]
    return Path(cache_dir) / "compiled" / f"{fingerprint(*setup)}.json"


def make_adapter(model, settings: EngineSettings = DEFAULTS, *, progress: bool = True, slots: int | None = None,
                 **knobs) -> HFAdapter:
    """The adapter ``settings`` asks for (``knobs``: any of its fields over it; the others reach
    ``compiled_adapter``). ``settings.compile``: ``true`` compiles (minutes the first time on a machine, with
    progress shown; one warning and the eager adapter where it cannot or fails); ``auto`` does so
    only where that is quick here (AOTInductor packages of this model already on disk, or a
    torch.compile warm-up that last took at most ``AUTO_READY_S``), else stays eager; ``false`` is
    the eager adapter. ``slots``: the KV slots to compile for up front (larger tiers compile their
    own steps when needed). Packages and markers live under ``settings.cache_dir``/compiled."""
    import json
    import logging

    from specfree.files import cache_folder

    settings = settings.take(knobs)
    compiled_knobs, choice = knobs, settings.compile
    eager = dict(settings=settings)
    if choice == "false":
        return _eager(model, "compile=false", **eager)
    reason = compile_blocker(model)
    if reason is not None:
        if choice == "true":
            warnings.warn(f"compile=true: {reason}; decoding on the eager path", stacklevel=3)
        return _eager(model, reason, **eager)
    folder = cache_folder(settings.cache_dir) / "compiled"
    # int8 graphs are other graphs (the op's precision argument): their own marker
    from specfree.kernels.layers import resolve_precision

    arithmetic = resolve_precision(model, settings)
    marker = compiled_marker(model, folder.parent, **compiled_knobs,
                             **({"precision": arithmetic} if arithmetic != "exact" else {}))
    if choice == "auto" and not _ready_without_compiling(model, folder, marker, compiled_knobs, settings):
        logging.getLogger("specfree").debug(
            "compile=auto: no compiled forward of this model is ready fast enough here, so this run is eager; "
            "compile=true builds one (minutes the first time)")
        return _eager(model, "compile=auto: no compiled forward of this model is ready here (compile=true builds one)",
                      **eager)
    from specfree.errors import UnsupportedModelError

    try:
        adapter = compiled_adapter(model, package_dir=folder, settings=settings, **compiled_knobs)
    except UnsupportedModelError:  # no tree mask: the eager adapter's probes choose how it verifies chains
        if choice == "true":
            warnings.warn("compile=true: this model verifies chains, which run on the eager path only; "
                          "decoding on the eager path", stacklevel=3)
        return _eager(model, "this model verifies chains, which run on the eager path only", **eager)
    seconds = adapter.warm_up(slots, progress=progress)
    if not adapter.compiled:  # it warned why
        return _eager(model, f"compiling failed: {adapter.failure}", **eager)
    if not isinstance(adapter.runner, PackageRunner):  # packages on disk speak for themselves
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"warm_up_s": seconds, "buckets": list(adapter.runner.buckets)}))
    return adapter


def _eager(model, why: str, **eager) -> HFAdapter:
    """The eager adapter, noting why the compiled one was not used (``decode``'s result.json says)."""
    adapter = HFAdapter(model, **eager)
    adapter.eager_because = why
    return adapter


def _ready_without_compiling(model, folder: Path, marker: Path, knobs: dict, settings: EngineSettings) -> bool:
    """Whether the compiled adapter's package is on disk, without building the adapter
    (its probes cost most of a second on SmolLM2, every eager start); for torch.compile, whether
    the last warm-up took at most ``AUTO_READY_S``."""
    import json

    device = model_device(model)
    if resolve_backend(knobs.get("backend", "auto"), device) == "aoti":
        from specfree.adapters.hf import prepare_model
        from specfree.kernels import linear_path

        # Both paths prepare the model first (the compiled one a copy sharing its modules), and the
        # package's name depends on what that gives: the attention it runs, the linears' kernel and
        # which weights hold codes. Preparing here costs nothing later: preparing twice is a no-op.
        prepare_model(model, knobs.get("grouped_attention", True), settings)
        return StepPackage(model, folder, package_options(), linear_path(model)).ready()
    try:
        return json.loads(marker.read_text())["warm_up_s"] <= AUTO_READY_S if marker.is_file() else False
    except (ValueError, KeyError, TypeError):
        return False  # a damaged marker: as if never compiled
