"""The ops' C++ library: its sources, its build (once per source and torch, under the cache
folder), loading it into the process, and the code path (ISA) this CPU runs."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from specfree.files import atomic_path, cache_folder, fingerprint
from specfree.progress import building
from specfree.settings import DEFAULTS

SOURCE = Path(__file__).with_name("unpacked_linear.cpp")
SOURCES = (SOURCE, Path(__file__).with_name("tree_attention.cpp"),
           Path(__file__).with_name("panel_linear.cpp"),
           Path(__file__).with_name("top_ids.cpp"),
           Path(__file__).with_name("tile_linear.cpp"),
           Path(__file__).with_name("measure_ops.cpp"),
           Path(__file__).with_name("pinned_ops.cpp"))  # one library, each source compiled side by side
HEADERS = (Path(__file__).with_name("isa.h"), Path(__file__).with_name("c_entries.h"))  # included by the sources
ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512"}
def kernel_dir(cache_dir: str | Path | None = None) -> Path:
    """Where a build of this source for this torch lives: a new source or torch builds anew."""
    return cache_folder(cache_dir) / "kernels" / fingerprint(*(s.read_text() for s in (*SOURCES, *HEADERS)),
                                                          torch.__version__)


def registered() -> bool:
    """Whether the library is loaded in this process (``load_kernels``)."""
    return has_op("linear")


@functools.cache
def process_isa() -> str:
    """The code path this CPU runs (``"avx512"``, ``"avx2"``), asked of the library once per process
    (``load_kernels`` first): the CPU does not change under it."""
    return ISA_NAMES[int(torch.ops.specfree.best_isa())]


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
    # panel_linear.cpp (int8 kernels for each group of 1-8 rows) takes most of it: 178 s on a 2-core Zen 3 VM
    status = building("specfree's CPU kernels", max(60, 300 // workers), show=progress)

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


def _load(library: Path) -> None:
    """The library loaded as torch's ops, its symbols global to the process: a compiled package calls
    the ops' C entries by name (``c_shims.py``)."""
    import ctypes
    import os

    ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
    torch.ops.load_library(str(library))


def load_kernels(cache_dir: str | Path | None = None, progress: bool = True) -> str | None:
    """Build (first use) or load ``specfree::linear``; returns the code path this CPU runs
    (``"avx512"`` or ``"avx2"``), or None with one warning where it cannot run here."""
    if not registered():
        if not _cpu_has_avx2():
            warnings.warn("specfree's few-row linear kernel needs a CPU with AVX2 and FMA; using torch's "
                          "F.linear instead (slower for tree rows, same results)", stacklevel=2)
            return None
        try:
            _load(_build(kernel_dir(cache_dir), progress))
        except Exception as exc:  # no compiler, a compile error, a damaged library: the library path still works
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"specfree's few-row linear kernel could not be built ({first}); using torch's "
                          "F.linear instead (slower for tree rows, same results). Install a C++ compiler "
                          "(g++) to get it.", stacklevel=2)
            return None
        _register_fake()
    return process_isa() if registered() else None


def build_command(args: list[str]) -> int:
    """``python -m specfree build-kernels [cache_dir=PATH]``: build the library now (the set-up line
    in README.md#set-up-and-test runs it), so the first decode builds nothing but what depends on its model."""
    import sys
    import time

    from specfree.errors import ConfigError

    cache_dir = None
    for arg in args:
        key, sep, value = arg.partition("=")
        if key != "cache_dir" or not sep or not value:
            raise ConfigError(f"build-kernels takes only cache_dir=PATH; got {arg!r}")
        cache_dir = value
    if not _cpu_has_avx2():
        print("specfree: this CPU lacks AVX2 and FMA, which specfree's kernels need: nothing to build; decoding "
              "uses torch's F.linear instead (same output, slower)", file=sys.stderr)
        return 0
    if find_compiler() is None and not (kernel_dir(cache_dir) / LIBRARY).is_file():
        raise ConfigError("no C++ compiler found (looked for c++, g++ and clang++ on PATH), so specfree's CPU "
                          "kernels cannot be built: install one (Debian, Ubuntu: apt-get install g++) and run "
                          "python -m specfree build-kernels again. Without them specfree decodes with torch's "
                          "F.linear (same output, slower).")
    library, start = kernel_dir(cache_dir) / LIBRARY, time.perf_counter()
    done = "already built" if library.is_file() else None
    try:
        _load(_build(library.parent, progress=True))
    except Exception as exc:  # a compile error, a damaged library
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: specfree's CPU kernels could not be built: {first}", file=sys.stderr)
        return 1
    done = done or f"built in {time.perf_counter() - start:.0f} s"
    print(f"specfree's CPU kernels: {done} ({library}); this CPU runs their {process_isa()} path", file=sys.stderr)
    return 0


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
    def _(x, codes, scales, offsets, bias, n, isa="auto", supers=None, super_offsets=None, precision=DEFAULTS.precision):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("specfree::decode_panels")
    def _(codes, scales, offsets, supers=None, super_offsets=None):
        k = codes.shape[1] * (8 if codes.dtype == torch.int32 else 1)
        return codes.new_empty((codes.shape[0], k, codes.shape[2]), dtype=torch.float32)

    @torch.library.register_fake("specfree::read_pass")
    def _(tensors, streams=1):
        return torch.empty((), dtype=torch.float64)

    @torch.library.register_fake("specfree::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("specfree::rms_norm_rows")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("specfree::rotary")
    def _(positions, inv_freq, scaling, dtype):  # [B, T] -> two [B, T, 2 * len(inv_freq)]
        shape = (*positions.shape, 2 * inv_freq.shape[-1])
        return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)

    @torch.library.register_fake("specfree::activation")
    def _(x, name):
        return torch.empty_like(x)

    @torch.library.register_fake("specfree::tree_attention")
    def _(query, key, value, mask, scale, isa="auto", softcap=0.0):  # [B, H, Q, D] in, [B, Q, H, D] out
        return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


