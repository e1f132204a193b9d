"""The packaged Hydra configs: every option composes, schemas refuse typos and wrong types with
one line naming the field, and configs reach ``Engine.from_config`` from a dict, a file or overrides."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Literal

import pytest
from omegaconf import MISSING, OmegaConf

from specfree import ConfigError, Engine
from specfree.loading import check_hub_reachable
from specfree.config import (
    build_strategy,
    compose,
    group_options,
    knob_fields,
    load_config,
    node_schema,
)
from specfree.bench.cli import BenchSettings
from specfree.conf.schema import STEP_KNOBS
from specfree.errors import ModelLoadError
from specfree.plugins import Component, Registry, build_plugin_manager, registry
from tests.helpers import REPO

REQUIRED_OPTIONS = {
    "model": {"smollm2", "llama2", "tinyllama", "qwen2", "mistral", "local"},
    "strategy": {"autoregressive", "prompt_lookup"},
    "verifier": {"greedy", "sampling"},
    "pool": {"lru", "trie", "suffix_array"},
    "mask": {"tree"},
    "bench": {"spec_bench", "custom", "code_edits"},
}


@pytest.fixture(scope="module")
def reg() -> Registry:
    return registry(build_plugin_manager())


def all_options():
    return [(group, option) for group, options in group_options().items() for option in options]


def test_groups_offer_the_documented_options():
    options = group_options()
    for group, required in REQUIRED_OPTIONS.items():
        assert required <= set(options[group]), group


@pytest.mark.parametrize("group, option", all_options())
def test_every_option_composes(reg, group, option):
    cfg = compose([f"{group}={option}"], reg)
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert plain[group] is not None
    if group in ("strategy", "verifier", "pool", "mask"):
        assert plain[group]["name"] == option
        # The node holds exactly the knobs the registry will be asked to build with, and a
        # strategy's the step knobs the engine takes (priced, adapt_costs, price_context).
        step = set(STEP_KNOBS) if group == "strategy" else set()
        assert set(plain[group]) - {"name"} <= set(reg.get(group, option).knobs) | step
        assert step <= set(plain[group])
    required = {("model", "local"): {"model.path"},
                ("bench", "spec_bench"): {"bench.prompts"}, ("bench", "custom"): {"bench.prompts"}}
    assert OmegaConf.missing_keys(cfg) == required.get((group, option), set())


def test_defaults_of_the_primary_config(reg):
    cfg = compose([], reg)
    assert (cfg.model.name, cfg.strategy.name, cfg.generation) == ("smollm2", "hybrid", "model")
    assert cfg.verifier is None  # the model's generation_config decides: sampling where it samples, else greedy
    assert cfg.strategy.priced is True and cfg.strategy.adapt_costs is False
    assert cfg.pool is None and cfg.bench is None and cfg.chat is True and cfg.max_new_tokens == 128


@pytest.mark.parametrize("overrides, message", [
    (["strategy=nope"], "unknown strategy 'nope'; available: autoregressive, .*prompt_lookup"),
    (["model=llama3"], "unknown model 'llama3'; available: llama2, local, mistral, qwen2, smollm2, tinyllama$"),
    (["strategy=prompt_lookup", "strategy.max_ngramm=3"],
     "^strategy.max_ngramm: strategy 'prompt_lookup' has no knob 'max_ngramm'; its knobs: max_ngram, min_ngram, "
     r"draft_len, num_candidates, match, priced, adapt_costs, price_context \(did you mean max_ngram\?\)$"),
    (["strategy=prompt_lookup", "+strategy.max_ngramm=3"], "strategy 'prompt_lookup' has no knob 'max_ngramm'"),
    (["strategy=prompt_lookup", "strategy.max_ngram=abc"], "^strategy.max_ngram: expected int, got 'abc'$"),
    (["strategy=trie", "strategy.priced=maybe"], "^strategy.priced: expected bool, got 'maybe'$"),
    (["verifier=sampling", "verifier.top_p=high"], "^verifier.top_p: expected float or null, got 'high'$"),
    (["bench=custom", "bench.limit=ten"], "^bench.limit: expected int or null, got 'ten'$"),
    (["max_new_token=5"], r"^max_new_token: no such setting; the top level has: .*\(did you mean max_new_tokens\?\)"),
    (["model.nmae=x"], r"^model.nmae: no such setting; model has: name, path"),
    (["prompt=a,b"], "Ambiguous value for argument 'prompt=a,b'"),
    (["strategy.name=nope"], "unknown strategy 'nope'"),
])
def test_mistakes_are_one_clear_line(reg, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        compose(overrides, reg)
    assert "\n" not in str(info.value)


def test_load_config_from_a_partial_dict_fills_in_the_options_defaults(reg):
    cfg = load_config({"strategy": {"name": "prompt_lookup", "draft_len": 4}, "max_new_tokens": 9}, reg=reg)
    assert cfg.strategy.draft_len == 4 and cfg.strategy.max_ngram == 3 and cfg.max_new_tokens == 9
    assert cfg.model.name == "smollm2"  # untouched groups keep the packaged defaults


def test_load_config_applies_overrides_after_the_config(reg, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("strategy: {name: prompt_lookup, draft_len: 4}\nmodel: {path: /somewhere}\n")
    cfg = load_config(path, ["strategy.draft_len=6", "verifier=sampling"], reg=reg)
    assert cfg.strategy.draft_len == 6 and cfg.verifier.name == "sampling" and cfg.model.path == "/somewhere"
    # An override that picks another option drops the config's node for that group.
    cfg = load_config(OmegaConf.load(path), ["strategy=autoregressive"], reg=reg)
    assert OmegaConf.to_container(cfg.strategy) == {"name": "autoregressive", "priced": True, "adapt_costs": False, "price_context": True}
    assert load_config({"strategy": "autoregressive"}, reg=reg).strategy.name == "autoregressive"


@pytest.mark.parametrize("cfg, message", [
    ({"strategy": {"name": "prompt_lookup", "draft_lenn": 4}}, "strategy 'prompt_lookup' has no knob 'draft_lenn'"),
    ({"strategy": {"name": "prompt_lookup", "draft_len": "long"}}, "strategy.draft_len: expected int, got 'long'"),
    ({"max_new_tokns": 5}, "max_new_tokns: no such setting"),
    ("/no/such/config.yaml", "config file not found: /no/such/config.yaml"),
    (42, "a config must be a DictConfig, a dict or a YAML path, got int"),
])
def test_load_config_mistakes(reg, cfg, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cfg, reg=reg)


def test_a_config_file_that_is_not_yaml_is_one_line(reg, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("strategy: [unclosed\n")
    with pytest.raises(ConfigError, match=f"^{path} is not a YAML config: while parsing a flow sequence") as info:
        load_config(path, reg=reg)
    assert "\n" not in str(info.value)


# ---- nodes made from the registry ----------------------------------------------------------
class Knobby:
    def __init__(self, size: int, ratio: float = 0.5, label: str | None = None, mode: Literal["a", "b"] = "a",
                 sizes: tuple[int, ...] = (1, 2), path: Path = Path("x"), untyped=3, processors: list[object] = ()):
        pass


def test_node_schema_follows_the_factory_signature():
    component = Component("strategy", "knobby", Knobby, "test", config={"ratio": 0.25})
    fields = knob_fields(component)
    assert list(fields) == ["size", "ratio", "label", "mode", "sizes", "path", "untyped"]  # no processors
    assert fields["size"][1] == MISSING and fields["ratio"][1] == 0.25 and fields["sizes"][1] == [1, 2]
    node = OmegaConf.structured(node_schema(component))
    assert node.name == "knobby" and node.path == "x" and node.mode == "a"
    node.label = None
    node.untyped = "anything"
    with pytest.raises(Exception, match="could not be converted to Integer"):
        node.size = "big"


def test_config_defaults_must_be_knobs():
    component = Component("strategy", "knobby", Knobby, "my_plugin", config={"colour": "red"})
    with pytest.raises(ConfigError, match=r"strategy 'knobby' \(from my_plugin\) has config defaults for \['colour'\]"):
        knob_fields(component)


# ---- the pool group -------------------------------------------------------------------------
class PooledDrafter:
    """A strategy that takes a pool object, as a plugin might write one."""

    def __init__(self, pool, depth: int = 4):
        self.pool, self.depth = pool, depth


class PooledPlugin:
    from specfree.hookspecs import hookimpl

    @hookimpl
    def specfree_register(self, registry):
        registry.add("strategy", "pooled", PooledDrafter)


def test_the_pool_group_feeds_strategies_that_take_a_pool():
    from specfree.pools.lru import LRUNGramPool

    reg = registry(build_plugin_manager(extra_plugins=(PooledPlugin(),)))
    cfg = compose(["strategy=pooled", "pool=lru", "pool.ngram=5"], reg)
    strategy = build_strategy(cfg, reg)
    assert isinstance(strategy.pool, LRUNGramPool) and strategy.pool.ngram == 5
    with pytest.raises(ConfigError, match=r"^pool=lru: ngram_pool.ngram must be >= 2, got 1$"):
        build_strategy(compose(["strategy=pooled", "pool=lru", "pool.ngram=1"], reg), reg)  # a factory's ValueError
    with pytest.raises(ConfigError, match="strategy 'pooled' needs a pool: add pool=NAME"):
        build_strategy(compose(["strategy=pooled"], reg), reg)
    with pytest.raises(ConfigError, match="strategy 'recycling' does not take a pool .* remove pool=lru"):
        build_strategy(compose(["strategy=recycling", "pool=lru"], reg), reg)


# ---- models -------------------------------------------------------------------------------
def test_engine_from_config_with_a_local_model(tiny_llama_dir):
    engine = Engine.from_config(overrides=["model=local", f"model.path={tiny_llama_dir}",
                                           "strategy=prompt_lookup", "strategy.draft_len=3"])
    assert engine.strategy.draft_len == 3 and engine.tokenizer is not None
    plain = Engine.from_config({"model": {"name": "local", "path": str(tiny_llama_dir)},
                                "strategy": {"name": "autoregressive"}})
    prompt = "the cat and the dog and the cat and the dog and the"
    assert engine.generate(prompt, 12).tokens == plain.generate(prompt, 12).tokens


def test_model_linear_kernel_reaches_the_adapter(tiny_llama_dir):
    from specfree.kernels import PanelLinear, UnpackedLinear, load_kernels

    def few_row(overrides):
        engine = Engine.from_config(overrides=["model=local", f"model.path={tiny_llama_dir}", *overrides])
        return any(isinstance(m, (UnpackedLinear, PanelLinear)) for m in engine.adapter.model.modules())

    assert few_row([]) == few_row(["model.linear_kernel=few_row"]) == (load_kernels() is not None)
    assert not few_row(["model.linear_kernel=library"])
    with pytest.raises(ConfigError, match="linear_kernel must be one of few_row, few_row_fp32, library"):
        Engine.from_config(overrides=["model=local", f"model.path={tiny_llama_dir}", "model.linear_kernel=mkl"])
    settings = BenchSettings.from_config({"model": {"name": "smollm2", "path": None, "linear_kernel": "library"},
                                          "bench": {"prompts": "p.jsonl", "out": "out"}})
    assert settings.config.model.linear_kernel == "library" and "linear_kernel" not in settings.model_options


def test_a_hub_model_without_network_fails_at_once(monkeypatch):
    import socket

    from huggingface_hub import constants

    def no_network(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    with pytest.raises(ModelLoadError) as info:
        check_hub_reachable("meta-llama/Llama-2-7b-chat-hf")
    assert str(info.value) == (
        "could not load 'meta-llama/Llama-2-7b-chat-hf': it is not a local folder, a .gguf file or in the "
        "Hugging Face cache, and the hub cannot be reached (no network). Download it elsewhere and pass its "
        "folder with model=local model.path=DIR, or use the embedded model: model=smollm2")
    check_hub_reachable("smollm2")  # embedded: never asks the network


# ---- packaging ----------------------------------------------------------------------------
def test_the_configs_ship_in_the_wheel_and_work_from_it(tmp_path):
    """Build a wheel, install it into a bare folder and run the CLI from there (not the checkout)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    readme = REPO / "README.md"
    (src / "README.md").write_text(readme.read_text() if readme.is_file() else "specfree\n")
    subprocess.run(["cp", "-r", str(REPO / "specfree"), str(src / "specfree")], check=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("specfree-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    packaged = {p.relative_to(REPO).as_posix() for p in (REPO / "specfree" / "conf").rglob("*.yaml")}
    assert packaged and packaged <= names
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)], check=True)
    probe = ("import specfree, specfree.cli; print(specfree.__file__); "
             "specfree.cli.main(['decode', '--cfg', 'job', 'model=tinyllama'])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(str(tmp_path / "site"))
    assert "name: TinyLlama/TinyLlama-1.1B-Chat-v1.0" in out.stdout
