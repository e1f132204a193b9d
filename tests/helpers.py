"""Helpers for the CLI, config and plugin tests (fixtures using them live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_PLUGIN = REPO / "tests" / "plugins" / "example_plugin"


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m specfree ARGS`` in a fresh interpreter, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "specfree", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, input=stdin, timeout=timeout)


def write_dist_info(site: Path, name: str, version: str, entry_points: dict[str, str]) -> Path:
    """Make ``site`` look like an install of distribution ``name``: a ``*.dist-info`` folder with
    its entry points is all importlib.metadata (and so pluggy) needs to find a plugin."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[specfree]\n{lines}")
    return info
