"""Plugins: built-ins and third-party packages register through the same hook; a third-party
strategy (tests/plugins/example_plugin) is usable by name from configs, the CLI and the API."""

from __future__ import annotations

import importlib
import io
import json
import os

import pytest
from rich.console import Console

from specfree import ConfigError, Engine
from specfree.cli import plugins as plugins_command
from specfree.config import compose, knob_fields
from specfree.hookspecs import hookimpl
from specfree.plugins import KINDS, build_plugin_manager, registry
from tests.helpers import EXAMPLE_PLUGIN, run_cli, write_dist_info


@pytest.fixture
def example_module(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGIN))
    return importlib.import_module("specfree_example.plugin")


@pytest.fixture
def installed(monkeypatch, example_plugin_paths):
    """The example plugin 'installed': found through its entry point, like a pip install."""
    for path in reversed(example_plugin_paths):
        monkeypatch.syspath_prepend(path)


def test_builtins_register_through_the_hook():
    reg = registry(build_plugin_manager(entry_points=False))
    assert {"autoregressive", "prompt_lookup"} <= set(reg.names("strategy"))
    assert {"lru", "trie", "suffix_array"} <= set(reg.names("pool"))
    assert reg.names("verifier") == ["greedy", "sampling"] and reg.names("adapter") == ["hf"]
    assert {reg.get(kind, name).source for kind in KINDS for name in reg.names(kind)} == {"specfree.builtin"}


def test_a_plugin_object_adds_a_strategy_with_a_config_node(example_module):
    reg = registry(build_plugin_manager(extra_plugins=(example_module,), entry_points=False))
    component = reg.get("strategy", "repeat_last")
    assert component.source == "specfree_example.plugin"
    assert knob_fields(component) == {"k": (int, 2)}  # the default from Registry.add(config=...)
    cfg = compose(["strategy=repeat_last", "strategy.k=5"], reg)
    assert dict(cfg.strategy) == {"name": "repeat_last", "k": 5, "priced": True, "adapt_costs": False, "price_context": True}
    typo = (r"^strategy.kk: strategy 'repeat_last' has no knob 'kk'; its knobs: k, priced, adapt_costs, price_context "
            r"\(did you mean k\?\)$")
    with pytest.raises(ConfigError, match=typo):
        compose(["strategy=repeat_last", "strategy.kk=5"], reg)
    with pytest.raises(ConfigError, match=r"^strategy.k: expected int, got 'many'$"):
        compose(["strategy=repeat_last", "strategy.k=many"], reg)


def test_installed_plugins_are_found_by_entry_point_and_listed(installed, capsys):
    reg = registry(build_plugin_manager())
    assert reg.get("strategy", "repeat_last").source == "example (specfree-example-plugin 0.1.0)"
    console = Console(file=io.StringIO(), width=250, record=True)
    assert plugins_command([], console=console) == 0
    rows = console.export_text().splitlines()
    assert any("repeat_last" in r and "example (specfree-example-plugin 0.1.0)" in r and "k=2" in r for r in rows)
    assert any("prompt_lookup" in r and "specfree.builtin" in r and "draft_len=10" in r for r in rows)


def test_a_name_registered_twice_is_refused():
    class Clash:
        @hookimpl
        def specfree_register(self, registry):
            registry.add("strategy", "prompt_lookup", object)

    with pytest.raises(ConfigError, match="strategy 'prompt_lookup' is registered twice: by 'specfree.builtin' and"):
        registry(build_plugin_manager(extra_plugins=(Clash(),), entry_points=False))


def test_a_broken_plugin_is_named(tmp_path, monkeypatch):
    write_dist_info(tmp_path, "broken-plugin", "1.0", {"broken": "no_such_module_here.plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="a specfree plugin failed to load .*'broken'.* from broken-plugin"):
        build_plugin_manager()


def test_engine_from_config_builds_the_plugin_strategy(example_module, tiny_llama_dir):
    model = {"name": "local", "path": str(tiny_llama_dir)}
    engine = Engine.from_config({"model": model, "strategy": {"name": "repeat_last", "k": 3}},
                                plugins=[example_module])
    assert type(engine.strategy).__name__ == "RepeatLast" and engine.strategy.k == 3
    plain = Engine.from_config({"model": model, "strategy": {"name": "autoregressive"}})
    prompt = "the cat the cat the cat the"
    assert engine.generate(prompt, 16).tokens == plain.generate(prompt, 16).tokens


def test_the_cli_uses_an_installed_plugin_by_name(example_plugin_paths, tiny_llama_dir, tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([*example_plugin_paths, os.environ.get("PYTHONPATH", "")])}
    done = run_cli("decode", "strategy=repeat_last", "strategy.k=2", "model=local", f"model.path={tiny_llama_dir}",
                   "prompt=the cat the cat", "max_new_tokens=6", "ignore_eos=true", f"output={tmp_path / 'r.json'}",
                   f"hydra.run.dir={tmp_path / 'run'}", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("· repeat_last")
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["strategy"] == {"name": "repeat_last", "k": 2, "priced": True, "adapt_costs": False, "price_context": True}
    assert len(result["tokens"]) == 6
