"""Imports pay for what a command uses: ``import specfree`` loads no heavy library, and ``decode``
loads none of the server's or the bench's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import specfree

# Each costs from tens of milliseconds (rich) to seconds (torch, transformers) to import.
HEAVY = ("torch", "transformers", "hydra", "omegaconf", "rich", "fastapi", "uvicorn", "matplotlib", "numba",
         "specfree.bench", "specfree.serve")
# numba: only a suffix array (a datastore, a long prompt's index) needs it, and the default drafters keep none.
NOT_FOR_DECODE = ("fastapi", "uvicorn", "matplotlib", "numba", "specfree.bench", "specfree.serve")


def imported_after(code: str, watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {list(watched)!r} if m in sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["specfree", "specfree.cli"])
def test_importing_the_package_or_its_command_line_loads_no_heavy_library(module):
    assert imported_after(f"import {module}", HEAVY) == []


def test_decode_loads_neither_the_server_nor_the_bench(tiny_llama_dir, tmp_path):
    code = ("from specfree import cli\n"
            f"assert cli.main(['decode', 'model=local', 'model.path={tiny_llama_dir}', 'prompt=the cat',"
            f" 'max_new_tokens=4', 'hydra.run.dir={tmp_path}']) == 0")
    assert imported_after(code, NOT_FOR_DECODE + ("torch",)) == ["torch"]  # torch: the decode did run


def test_the_public_names_load_on_first_use():
    from specfree.engine import Engine

    assert specfree.Engine is Engine and set(specfree.__all__) <= set(dir(specfree))
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        specfree.Engin  # noqa: B018


def test_the_pools_load_on_first_use():
    assert imported_after("from specfree.pools import LRUNGramPool", ("numba", "specfree.pools.suffix_array")) == []
    from specfree.pools import SuffixArrayPool
    from specfree.pools.suffix_array import SuffixArrayPool as home

    assert SuffixArrayPool is home
    with pytest.raises(AttributeError, match="no attribute 'SuffixArray'"):
        import specfree.pools

        specfree.pools.SuffixArray  # noqa: B018
