"""The package's import graph walks down only: no module imports one that imports it back, and the
kernels, the loading and the masks know nothing of adapters. Module-level imports, read with ast."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import specfree
from specfree.adapters.hf import HFAdapter
from specfree.adapters.protocol import Adapter
from tests.tiny_models import tiny_model

ROOT = Path(specfree.__file__).parent


def _module(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module -> the specfree modules it imports at module level (``from pkg import sub`` names sub)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specfree"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs or {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("specfree")}
        graph[name] = (deps & modules.keys()) - {name}
    return graph


def test_no_import_cycles():
    graph, done, path = import_graph(), set(), []

    def visit(module: str) -> None:
        if module in path:
            pytest.fail(f"import cycle: {' -> '.join(path[path.index(module):] + [module])}")
        if module in done:
            return
        path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


@pytest.mark.parametrize("lower", ["specfree.kernels", "specfree.loading", "specfree.masks"])
def test_lower_layers_do_not_import_adapters(lower):
    upward = {(m, d) for m, deps in import_graph().items() if m.startswith(lower)
              for d in deps if d.startswith("specfree.adapters")}
    assert not upward


def protocol_members() -> set[str]:
    return {n for n in dir(Adapter) if not n.startswith("_")} | set(Adapter.__annotations__)


def adapter_members_used_outside_adapters() -> dict[str, str]:
    """member -> a module that reads it: every ``adapter.<member>`` and ``<x>.adapter.<member>`` in
    specfree outside ``specfree/adapters`` and in the tests (module-level code and functions alike)."""
    used = {}
    for path in [*ROOT.rglob("*.py"), *(ROOT.parent / "tests").rglob("*.py")]:
        if path.is_relative_to(ROOT / "adapters"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if ((isinstance(owner, ast.Name) and owner.id == "adapter")
                    or (isinstance(owner, ast.Attribute) and owner.attr == "adapter")):
                used.setdefault(node.attr, str(path.relative_to(ROOT.parent)))
    return used


def test_the_adapter_meets_its_protocol_and_its_record_is_frozen():
    adapter = HFAdapter(tiny_model("llama"))
    assert isinstance(adapter, Adapter)
    # the members callers outside specfree/adapters use (issue 60's list), typed in the protocol
    members = protocol_members()
    for name in ("run_plain", "store", "runner", "warm_up", "failure", "linears", "compile_s", "past_len"):
        assert name in members and hasattr(adapter, name), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        adapter.capabilities.max_chain = 3


def test_the_protocol_lists_every_member_read_outside_adapters():
    missing = {m: where for m, where in adapter_members_used_outside_adapters().items() if m not in protocol_members()}
    assert not missing, f"members of the adapter read outside specfree/adapters but not in protocol.Adapter: {missing}"


def test_one_function_names_the_cache_folder():
    """``files.cache_folder``: kernels, GGUF configs, cost curves, packages and llama.cpp's tools all
    ask it; no other module spells ~/.cache/specfree."""
    spelled = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if '".cache"' in p.read_text())
    assert spelled == ["files.py"]
