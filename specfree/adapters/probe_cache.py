"""Which models passed every probe here before (``probes.inspect_model``), and what the
row-exactness probe found (``HFAdapter.rows_exact``), so that a warm start skips the probe forwards.

A pass is remembered by what decides it: the model's architecture (its config, every tensor's
name, shape and dtype, its layer classes: ``packaged.architecture_fingerprint``), the device,
the torch and transformers versions, and specfree's forward code (the adapters', kernels' and
masks' sources and the kernels' build). The weights' values are not in it: the probes check how
rows see each other, which they do not change. Only a pass as a tree-verified model is kept; any
other verdict (chains, a refusal) is probed every time.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from specfree.files import cache_folder, fingerprint, write_atomic

FORWARD_CODE = ("adapters", "kernels", "masks")  # specfree's folders whose code runs the probed forwards


@functools.cache
def _forward_code() -> str:
    from specfree.kernels.build import kernel_dir

    root = Path(__file__).resolve().parent.parent
    sources = sorted(path for folder in FORWARD_CODE for path in (root / folder).glob("*.py"))
    return fingerprint(*(path.read_text() for path in sources), kernel_dir().name)


def verdict_file(model, cache_dir, compiled: bool, *also: str) -> Path:
    import transformers

    from specfree.adapters.capabilities import model_device
    from specfree.adapters.packaged import architecture_fingerprint

    key = fingerprint(architecture_fingerprint(model), str(model_device(model)), compiled, torch.__version__,
                      transformers.__version__, _forward_code(), *also)
    return cache_folder(cache_dir) / "probes" / f"{key}.json"


def passed_before(model, cache_dir, compiled: bool) -> bool:
    return verdict_file(model, cache_dir, compiled).is_file()


def remember_pass(model, cache_dir, compiled: bool) -> None:
    path = verdict_file(model, cache_dir, compiled)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"family": model.config.model_type, "verification": "tree"}))


def rows_verdict(model, cache_dir, linears: str) -> bool | None:
    """What the row-exactness probe found before for this architecture with these linear kernels
    (``kernels.linear_path``: the precision is theirs, not the architecture's); None: never probed."""
    path = verdict_file(model, cache_dir, False, "rows", linears)
    return json.loads(path.read_text())["rows_exact"] if path.is_file() else None


def remember_rows(model, cache_dir, linears: str, exact: bool) -> None:
    path = verdict_file(model, cache_dir, False, "rows", linears)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"family": model.config.model_type, "rows_exact": exact}))
