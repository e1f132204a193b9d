"""What a run ran on: the CPU, the library versions, and the forward path an engine took.

Speed numbers mean little without them, and a result that does not say whether the compiled
forward ran (or why not) cannot be compared with another. ``decode``'s result.json and
``bench``'s metadata both read them from here.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_info() -> dict[str, Any]:
    """The CPU's model name, family and model numbers as the OS reports them (``/proc/cpuinfo``;
    elsewhere what ``platform`` knows), and the logical core count."""
    info: dict[str, Any] = {"model_name": platform.processor() or platform.machine(), "family": None,
                            "model": None, "logical_cores": os.cpu_count()}
    keys = {"model name": "model_name", "cpu family": "family", "model": "model"}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.split("\n\n", 1)[0].splitlines():  # the first processor speaks for all
        key, _, value = line.partition(":")
        name = keys.get(key.strip())
        if name is not None:
            value = value.strip()
            info[name] = int(value) if value.isdigit() else value
    return info


def cpu_name() -> str:
    """``AMD EPYC (family 25 model 1, avx2, 2 logical cores)``: the CPU in one line. A VM's model
    name may be only the vendor's brand; family, model and the widest vector path tell the kinds
    apart (Zen 3 and Zen 4 both say "AMD EPYC")."""
    import torch

    info = cpu_info()
    ids = f"family {info['family']} model {info['model']}, " if info["family"] is not None else ""
    return (f"{info['model_name']} ({ids}{torch.backends.cpu.get_cpu_capability().lower()}, "
            f"{info['logical_cores']} logical cores)")


def versions() -> dict[str, str]:
    import torch
    import transformers

    import specfree

    return {"specfree": specfree.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def forward_path(engine) -> dict[str, Any]:
    """Which forward ``engine`` runs (the adapter's record: compiled or eager and why, the linear
    kernel and its ISA, attention, verification) and whether its steps are priced."""
    return {**engine.adapter.path(), "priced": engine.priced}
