"""Few-row linear kernels for the CPU: ``y = x W^T + b`` at the cost of reading W once.

A speculative step pushes 1 to 16 rows through every linear layer. Those products are bound by
streaming the weights from memory, and the BLAS and oneDNN kernels torch ships pay much more
than one read for 2 to 16 rows. The ops, one library:

- ``specfree::panel_linear`` and ``specfree::coded_linear`` (``panel_linear.cpp``: one driver, one
  row of its format table a weight format) on weights packed once, in place, into panels
  (``panels.py``: float32, float16, bfloat16) or held as small integer codes under block scales
  (``codes.py``, ``gguf_blocks.py``: a GGUF's types): one sequential stream per thread; what an
  engine's model runs (``prepare_linears``, ``PanelLinear``, ``CodedLinear``); coded layers take
  float32 activations (``precision="exact"``) or 8-bit ones (``"int8"``, ``set_precision``);
- ``specfree::linear`` (``unpacked_linear.cpp``) on the model's own ``[N, K]`` tensors, for models
  specfree borrows (``unpacked_linears``) and heads tied to a layer it cannot repack;
- ``specfree::tile_linear`` (``tile_linear.cpp``) on bfloat16 weights packed into AMX tiles
  (``tiles.py``), where the CPU has AMX: a bfloat16 model's products.

Both give each output row the same bits whatever the number of rows in the call. The same library
holds ``specfree::tree_attention`` (``tree_attention.cpp``, the step's attention) and
``specfree::top_ids`` (``top_ids.cpp``, each row's top-k ids for the drafters that recycle logits). They are torch
custom ops (``torch.library``), so eager code, ``torch.compile`` and AOTInductor packages all call
the same code. They are built from their C++ source on first use (each source compiled side by side, then linked) with the C++
compiler Inductor needs anyway, and kept under
``~/.cache/specfree/kernels/<hash of the sources and torch version>``. Where they cannot be built
or the CPU lacks AVX2, ``load_kernels`` warns once and returns None, and the layers run the
library's ``F.linear``. ``specfree::read_pass`` (one read of tensors: the floor the cost curves are
read against) and ``specfree::linear_pass`` (products called from C++) are measurement only, in
``measure_ops.cpp``, for the curves of ``specfree/bench/linear_curves.py``, which
``python -m specfree bench`` runs (user-facing, so they ship).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specfree.files import atomic_path, cache_folder, fingerprint
from specfree.kernels.codes import PRECISIONS, CodedLinear
from specfree.kernels.hugepages import HugePageArena
from specfree.kernels.saved_codes import SavedCodes
from specfree.kernels.panels import (LANES, PanelLinear, is_conv1d, pack_linears, release_checkpoint_mapping,
                                     unpacked)
from specfree.kernels.swap import swap_modules, swapped_modules
from specfree.kernels.tiles import TileLinear, tile_bytes, tiles_fit

SOURCE = Path(__file__).with_name("unpacked_linear.cpp")
SOURCES = (SOURCE, Path(__file__).with_name("tree_attention.cpp"),
           Path(__file__).with_name("panel_linear.cpp"),
           Path(__file__).with_name("top_ids.cpp"),
           Path(__file__).with_name("tile_linear.cpp"),
           Path(__file__).with_name("measure_ops.cpp"))  # one library, each source compiled side by side
HEADERS = (Path(__file__).with_name("isa.h"),)  # included by every source
ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512"}
# The values of ``linear_kernel=`` (configs, CLI, docs: user-facing, so their names stay):
# "few_row": specfree's kernels (``prepare_linears``): weights packed into panels, held as codes where
#   they are exactly a 4- or 8-bit code's values (a dequantized GGUF), AMX tiles for bfloat16 where
#   the CPU has AMX, ``UnpackedLinear`` where a layer cannot be packed;
# "few_row_fp32": the same, every weight kept as float32 panels (no codes, no tiles);
# "library": torch's own ``F.linear``.
BACKENDS = ("few_row", "few_row_fp32", "library")


def kernel_dir(cache_dir: str | Path | None = None) -> Path:
    """Where a build of this source for this torch lives: a new source or torch builds anew."""
    return cache_folder(cache_dir) / "kernels" / fingerprint(*(s.read_text() for s in (*SOURCES, *HEADERS)),
                                                          torch.__version__)


def _registered() -> bool:
    return has_op("linear")


def has_op(name: str) -> bool:
    """Whether specfree's library, with op ``name``, is loaded in this process (``load_kernels``)."""
    return hasattr(torch.ops, "specfree") and hasattr(torch.ops.specfree, name)


LIBRARY = "specfree_kernels.so"


def _compile_command(compiler: str, source: Path, out: Path) -> list[str]:
    """One source to an object file, against torch's headers (no build tool)."""
    from torch.utils import cpp_extension

    abi = int(torch.compiled_with_cxx11_abi())
    # -fopenmp: at::parallel_for's OpenMP loop lives in the headers; torch's own libgomp serves it
    return [compiler, "-O3", "-std=c++17", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{path}" for path in cpp_extension.include_paths()), "-c", str(source), "-o", str(out)]


def _link_command(compiler: str, objects: list[Path], out: Path) -> list[str]:
    """The objects into one shared library, against torch's libraries."""
    from torch.utils import cpp_extension

    return [compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(out),
            *(f"-L{path}" for path in cpp_extension.library_paths()), "-lc10", "-ltorch", "-ltorch_cpu",
            *(f"-Wl,-rpath,{path}" for path in cpp_extension.library_paths())]


def find_compiler() -> str | None:
    """The C++ compiler the kernels are built with (the first of c++, g++, clang++ on PATH), or None."""
    import shutil

    return next((found for name in ("c++", "g++", "clang++") if (found := shutil.which(name))), None)


def _build(folder: Path, progress: bool, sources: tuple[Path, ...] = SOURCES) -> Path:
    """The ops' shared library in ``folder``, compiled there first if missing; written whole or not
    at all (an interrupted build leaves no library behind). The sources compile side by side, one
    compiler per core, each mostly reading torch's headers (8-20 s apiece on the 2-core Intel VM):
    47 s there, against 84 s for one compiler call over them all."""
    import os
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    library = folder / LIBRARY
    if library.is_file():
        return library
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found")
    folder.mkdir(parents=True, exist_ok=True)
    workers = min(len(sources), os.cpu_count() or 1)
    status = contextlib.nullcontext()
    if progress:  # about 80 s of compiling in all, the longest source 20 s (2-core Intel VM)
        from rich.console import Console

        status = Console(stderr=True).status(f"building specfree's CPU kernels (first use: about "
                                             f"{max(20, 80 // workers)} s)")

    def run(command: list[str]) -> None:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            error = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:200])
            raise RuntimeError(f"{Path(compiler).name} failed: {error}")

    with status, tempfile.TemporaryDirectory(dir=folder) as objects, atomic_path(library) as partial:
        outputs = [Path(objects) / f"{source.stem}.o" for source in sources]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(run, [_compile_command(compiler, s, o) for s, o in zip(sources, outputs)]))
        run(_link_command(compiler, outputs, partial))
    return library


def load_kernels(cache_dir: str | Path | None = None, progress: bool = True) -> str | None:
    """Build (first use) or load ``specfree::linear``; returns the code path this CPU runs
    (``"avx512"`` or ``"avx2"``), or None with one warning where it cannot run here."""
    if not _registered():
        if not _cpu_has_avx2():
            warnings.warn("specfree's few-row linear kernel needs a CPU with AVX2 and FMA; using torch's "
                          "F.linear instead (slower for tree rows, same results)", stacklevel=2)
            return None
        try:
            torch.ops.load_library(str(_build(kernel_dir(cache_dir), progress)))
        except Exception as exc:  # no compiler, a compile error, a damaged library: the library path still works
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"specfree's few-row linear kernel could not be built ({first}); using torch's "
                          "F.linear instead (slower for tree rows, same results). Install a C++ compiler "
                          "(g++) to get it.", stacklevel=2)
            return None
        _register_fake()
    return ISA_NAMES[int(torch.ops.specfree.best_isa())] if _registered() else None


def has_amx() -> bool:
    """Whether a bfloat16 model's linears run on AMX tiles here (``load_kernels`` first): the CPU has
    AMX (Intel Sapphire Rapids and later), the OS lets this process use it, and the op was built."""
    return has_op("has_amx") and bool(torch.ops.specfree.has_amx())


def _cpu_has_avx2() -> bool:
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    return capability in ("AVX2", "AVX512")


def _register_fake() -> None:
    """Shapes for torch.compile and torch.export: one output row per input row, N columns."""
    @torch.library.register_fake("specfree::linear")
    def _(x, weight, bias, isa="auto"):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("specfree::panel_linear")
    def _(x, panels, bias, n, isa="auto"):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("specfree::tile_linear")
    def _(x, tiles, bias, n):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("specfree::coded_linear")
    def _(x, codes, scales, offsets, bias, n, isa="auto", supers=None, super_offsets=None, precision="exact"):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("specfree::decode_panels")
    def _(codes, scales, offsets, supers=None, super_offsets=None):
        k = codes.shape[1] * (8 if codes.dtype == torch.int32 else 1)
        return codes.new_empty((codes.shape[0], k, codes.shape[2]), dtype=torch.float32)

    @torch.library.register_fake("specfree::read_pass")
    def _(tensors, streams=1):
        return torch.empty((), dtype=torch.float64)

    @torch.library.register_fake("specfree::tree_attention")
    def _(query, key, value, mask, scale, isa="auto", softcap=0.0):  # [B, H, Q, D] in, [B, Q, H, D] out
        return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


def unpacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    isa: str = "auto") -> torch.Tensor:
    """``F.linear`` through ``specfree::linear``, on ``weight`` as it is, ``[N, K]`` (``load_kernels``
    first). ``isa``: ``"auto"``, ``"avx2"`` or ``"avx512"`` (the CPU must have it)."""
    return torch.ops.specfree.linear(x, weight, bias, isa)


class UnpackedLinear(nn.Module):
    """An ``nn.Linear`` (same parameters, shared, not copied) whose product runs ``specfree::linear``
    on the weight in its own ``[N, K]`` layout: the unpacked fallback where a weight is not packed into
    panels (a borrowed model, a head tied to a layer that cannot be repacked). The state dict is the original's."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)  # None registers as absent, as in nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # 211 calls a SmolLM2 forward: skip nn.Module.__getattr__
        weight = params["weight"]
        if weight.requires_grad and torch.is_grad_enabled():  # the op has no backward
            return F.linear(x, weight, params["bias"])
        return torch.ops.specfree.linear(x, weight, params["bias"])

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` over the same parameters."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta",
                           dtype=self.weight.dtype)
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _fits(module: nn.Module) -> bool:
    # Exactly nn.Linear (subclasses may compute something else), fp32/bf16 on the CPU, no hooks
    # (accelerate's offloading works through hooks).
    return type(module) is nn.Linear and _plain_cpu_weight(module)


def _packs(module: nn.Module) -> bool:
    """What packing takes: ``_fits``, and GPT-2's ``Conv1D`` (the same product, its weight transposed)."""
    return (type(module) is nn.Linear or is_conv1d(module)) and _plain_cpu_weight(module)


def _plain_cpu_weight(module: nn.Module) -> bool:
    return (module.weight.device.type == "cpu" and module.weight.dtype in (torch.float32, torch.bfloat16)
            and not module._forward_hooks and not module._forward_pre_hooks)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        from specfree.errors import ConfigError

        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return precision


def set_precision(model: nn.Module, precision: str = "exact") -> int:
    """Run the model's coded layers (``CodedLinear``: a quantized file's codes) at ``precision``
    (``codes.PRECISIONS``); returns how many there are. Other layers have no other precision."""
    check_precision(precision)
    coded = [m for m in model.modules() if isinstance(m, CodedLinear)]
    for module in coded:
        module.precision = precision
    return len(coded)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        from specfree.errors import ConfigError

        raise ConfigError(f"linear_kernel must be one of {', '.join(BACKENDS)}, not {backend!r}")
    return backend


def prepare_linears(model: nn.Module, backend: str = "few_row", cache_dir: str | Path | None = None,
                    pack: bool = True, precision: str = "exact") -> int:
    """Swap the model's CPU ``nn.Linear`` layers for specfree's kernels, their weights packed
    (``backend="few_row"``, where the kernel loads), or back to ``nn.Linear`` (``"library"``); returns how many layers now run
    the kernel. ``pack``: each weight repacked in place into panels (``PanelLinear``, the fastest
    layout, still one copy; GPT-2's ``Conv1D`` layers too); else ``UnpackedLinear`` over the model's
    own tensors (``nn.Linear`` only). ``precision``: how layers held as codes multiply (``set_precision``)."""
    check_precision(precision)
    if check_backend(backend) == "library":
        library_linears(model)
        return 0
    if backend == "few_row_fp32" and any(isinstance(m, CodedLinear) for m in model.modules()):
        library_linears(model)  # a GGUF's codes as float32 weights (the same values), packed below
    if not any((_packs if pack else _fits)(m) for m in model.modules()):
        # Nothing left to swap (a model on a GPU, or one an earlier adapter swapped): the kernel is
        # neither built nor asked for its ISA.
        set_precision(model, precision)  # a GGUF's layers hold codes from the load
        return sum(isinstance(m, (UnpackedLinear, PanelLinear)) for m in model.modules())
    if load_kernels(cache_dir) is None:
        library_linears(model)
        return 0
    isa = ISA_NAMES[int(torch.ops.specfree.best_isa())]
    if pack and isa in LANES:
        # codes found by an earlier load of the same weights are checked, not searched again
        coder = SavedCodes.for_model(model, _packs, LANES[isa], cache_folder(cache_dir)) if backend == "few_row" else None
        tiles = HugePageArena() if backend == "few_row" and has_amx() else None  # on huge pages, as panels
        if tiles is not None:
            tiles.reserve([tile_bytes(m) for m in model.modules() if _packs(m) and tiles_fit(m)])

        def hold(module: nn.Module, lanes: int) -> nn.Module | None:
            # codes where a weight is exactly a code's values, AMX tiles for bfloat16, else panels (None)
            held = coder(module, lanes) if coder is not None else None
            return TileLinear(module, tiles) if held is None and tiles is not None and tiles_fit(module) else held

        if pack_linears(model, _packs, LANES[isa], hold):
            release_checkpoint_mapping(model)
        if coder is not None:
            coder.save()
    set_precision(model, precision)
    swap_modules(model, lambda m: UnpackedLinear(m) if _fits(m) else None)
    return sum(isinstance(m, (UnpackedLinear, PanelLinear)) for m in model.modules())


def linear_path(model: nn.Module) -> str:
    """Which kernel the model's linear layers run: ``"few_row-coded-avx512"`` (held as codes, some
    layers possibly as panels: then a digest of which are codes follows ``coded``),
    ``"few_row-panels-avx512"`` (packed in place),
    ``"few_row-avx2"`` (the model's own layout) and so on, or ``"library"``; coded layers at
    ``precision=int8`` add ``-int8`` after ``coded`` (a compiled step calls the op with it)."""
    if not _registered():
        return "library"
    isa = ISA_NAMES[int(torch.ops.specfree.best_isa())]
    coded = [name for name, m in model.named_modules() if isinstance(m, CodedLinear)]
    if coded:  # which layers hold codes, and at which precision, is part of what a compiled step calls
        every = all(not isinstance(m, PanelLinear) or isinstance(m, CodedLinear) for m in model.modules())
        int8 = [name for name, m in model.named_modules() if isinstance(m, CodedLinear) and m.precision == "int8"]
        precision = "" if not int8 else "-int8" if len(int8) == len(coded) else f"-int8{fingerprint(*int8)[:8]}"
        return f"few_row-coded{precision}-{isa}" if every else f"few_row-coded{fingerprint(*coded)[:8]}{precision}-{isa}"
    if any(isinstance(m, TileLinear) for m in model.modules()):  # bfloat16 weights on AMX tiles
        return f"few_row-tiles-{isa}"
    if any(isinstance(m, PanelLinear) for m in model.modules()):
        return f"few_row-panels-{isa}"
    if any(isinstance(m, UnpackedLinear) for m in model.modules()):
        return f"few_row-{isa}"
    return "library"


def _stock(copies: dict):
    return lambda m: m.to_linear() if isinstance(m, UnpackedLinear) else unpacked(m, copies)


def library_linears(model: nn.Module) -> int:
    """Undo ``prepare_linears`` (packed weights unpacked, in place); returns how many
    ``nn.Linear`` layers the model has then."""
    with torch.no_grad():
        swap_modules(model, _stock({}))
    return sum(type(m) is nn.Linear for m in model.modules())


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def stock_linears(model: nn.Module):
    """Plain ``nn.Linear`` layers (and embedding) inside the block, for baselines that must be stock,
    then specfree's again. Packed weights are unpacked into a copy that lives as long as the block;
    where that float32 copy (a GGUF held as codes: 4 bytes a weight) would not fit in memory, a
    ``SpecfreeError`` says so before anything is unpacked."""
    from specfree.errors import SpecfreeError

    need = sum(4 * m.in_features * m.out_features for m in model.modules()
               if isinstance(m, PanelLinear) and m.storage.dtype != torch.float32)
    free = available_memory()
    if free is not None and need > free:
        raise SpecfreeError(f"the stock float32 copy of this model's linear layers needs {need / 2**30:.1f} GiB "
                            f"and {free / 2**30:.1f} GiB is available: leave the transformers baselines out "
                            "(bench.baselines without hf_*)")
    with torch.no_grad(), swapped_modules(model, _stock({})):
        yield model


@contextlib.contextmanager
def unpacked_linears(model: nn.Module, cache_dir: str | Path | None = None):
    """specfree's linear layers inside the block and the model's own after it, for callers that
    borrow a model they do not own (nothing is copied either way)."""
    if load_kernels(cache_dir) is None:
        yield model
        return
    with swapped_modules(model, lambda m: UnpackedLinear(m) if _fits(m) else None):
        yield model
