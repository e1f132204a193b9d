"""Every engine setting is declared once (``specfree.settings.EngineSettings``): no other place in the
package or its YAML states its default, and every way in (config, ``from_model``, the schema) reads
the same one."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import yaml

import specfree
from specfree.conf.schema import STEP_KNOBS, ModelConfig, ServeConfig, SpecfreeConfig
from specfree.config import compose
from specfree.errors import ConfigError
from specfree.integrations.transformers import speculative_generate
from specfree.settings import (CUSTOM_GENERATE_DEFAULTS, DEFAULTS, SERVE_DEFAULTS, EngineSettings, check_setting,
                               config_key, use_threads)

ROOT = Path(specfree.__file__).parent
FIELDS = {f.name: f for f in dataclasses.fields(EngineSettings)}
NAMES = set(FIELDS) | {config_key(f) for f in FIELDS.values()} - {"adapter"}  # `adapter` elsewhere: an object


def stated_defaults(path: Path):
    """(line, name, default's source) of every default a setting's name gets in ``path`` as a literal
    or a module constant: keyword parameters, class fields, and ``.get(name, default)`` calls. None
    ("not given", passed on), ``DEFAULTS.<name>`` and values from elsewhere are no statement of one."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        pairs = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs += zip(positional[len(positional) - len(a.defaults):], a.defaults)
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            pairs = [(arg.arg, d) for arg, d in pairs]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            pairs = [(node.target.id, node.value)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
            pairs = [(node.args[0].value, node.args[1])]
        for name, default in pairs:
            literal = isinstance(default, ast.Constant) and default.value is not None
            constant = isinstance(default, ast.Name) and default.id.isupper()  # DEFAULT_MAX_BATCH and the like
            if name in NAMES and (literal or constant):
                yield default.lineno, name, ast.unparse(default)


def test_no_python_states_a_settings_default():
    found = [f"{path.relative_to(ROOT)}:{line}: {name}={text}"
             for path in sorted(ROOT.rglob("*.py")) if path.name != "settings.py"
             for line, name, text in stated_defaults(path)]
    assert not found, ("a setting's default stated outside specfree/settings.py (take an EngineSettings, or "
                       "name the difference beside SERVE_DEFAULTS):\n" + "\n".join(found))


def test_the_scan_finds_a_stated_default(tmp_path):
    code = tmp_path / "m.py"
    code.write_text('def f(x, compile="auto", *, precision: str = DEFAULTS.precision, cache_dir=None):\n'
                    '    return cfg.get("linear_kernel", "few_row"), cfg.get("priced", settings.priced)\n'
                    'class C:\n    max_batch: int = 4\n    price_context: bool = PRICE_CONTEXT\n')
    assert sorted((name, text) for _, name, text in stated_defaults(code)) == [
        ("compile", "'auto'"), ("linear_kernel", "'few_row'"), ("max_batch", "4"), ("price_context", "PRICE_CONTEXT")]


def test_entry_points_differ_from_the_library_only_where_the_settings_say():
    def differences(settings):
        return {f: getattr(settings, f) for f in FIELDS if getattr(settings, f) != getattr(DEFAULTS, f)}

    assert differences(SERVE_DEFAULTS) == {"prompt_cache": True}
    assert ServeConfig().prompt_cache is SERVE_DEFAULTS.prompt_cache
    assert differences(CUSTOM_GENERATE_DEFAULTS) == {"compile": "false"}
    assert speculative_generate("prompt_lookup").settings == CUSTOM_GENERATE_DEFAULTS


def test_no_yaml_restates_a_settings_default():
    nodes = {"config.yaml": "", "model": "model", "serve": "serve"}
    found = []
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        node = nodes.get(path.name, nodes.get(path.parent.name))
        if node is None:
            continue
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for f in FIELDS.values():
            if f.metadata["node"] == node and config_key(f) in values and values[config_key(f)] == f.default:
                found.append(f"{path.relative_to(ROOT)}: {config_key(f)}: {values[config_key(f)]!r}")
    assert not found, "restates specfree/settings.py:\n" + "\n".join(found)


@pytest.mark.parametrize("schema, node", [(SpecfreeConfig, ""), (ModelConfig, "model"), (ServeConfig, "serve")])
def test_the_schema_is_made_from_the_settings(schema, node):
    held = {f.name: f.default for f in dataclasses.fields(schema)}
    for f in FIELDS.values():
        if f.metadata["node"] == node:
            assert held[config_key(f)] == f.default, config_key(f)
    assert STEP_KNOBS == {k: (bool, FIELDS[k].default) for k in ("priced", "adapt_costs", "price_context")}


def test_a_composed_config_holds_the_defaults():
    cfg = compose(["prompt=hi", "serve=default", "strategy=prompt_lookup"])
    assert EngineSettings.from_config(cfg) == DEFAULTS
    changed = compose(["prompt=hi", "compile=true", "precision=int8", "model.linear_kernel=library",
                       "strategy=prompt_lookup", "strategy.priced=false"])
    settings = EngineSettings.from_config(changed)
    assert (settings.compile, settings.precision, settings.linear_kernel, settings.priced) == \
        ("true", "int8", "library", False)
    assert EngineSettings.from_config(changed, skip=("priced",)).priced is DEFAULTS.priced


def test_take_moves_settings_out_of_knobs_and_checks_them():
    knobs = {"compile": True, "precision": "exact", "draft_len": 4}
    settings = DEFAULTS.take(knobs)
    assert (settings.compile, settings.precision, knobs) == ("true", "exact", {"draft_len": 4})
    assert DEFAULTS.take({}) == DEFAULTS
    with pytest.raises(ConfigError, match=r"precision must be one of auto, exact, int8, not 'fp8' \(how layers held"):
        DEFAULTS.take({"precision": "fp8"})
    with pytest.raises(ConfigError, match="compile must be one of auto, true, false, not 'fast'"):
        check_setting("compile", "fast")
    assert [check_setting("compile", v) for v in (True, False, "auto", "TRUE")] == ["true", "false", "auto", "true"]


def test_every_setting_says_what_it_does():
    for f in FIELDS.values():
        assert len(f.metadata["doc"]) > 20, f.name


def test_ranges_are_checked_where_choices_are():
    assert DEFAULTS.changed(max_batch=64, threads=3) == dataclasses.replace(DEFAULTS, max_batch=64, threads=3)
    with pytest.raises(ConfigError, match="serve.max_batch must be between 1 and 64, got 0"):
        DEFAULTS.changed(max_batch=0)
    with pytest.raises(ConfigError, match="threads must be >= 1, got 0"):
        EngineSettings(threads=0).checked()
    with pytest.raises(ConfigError, match="threads must be an integer"):
        use_threads("two")
    with pytest.raises(ConfigError, match="serve.max_batch must be between 1 and 64"):
        EngineSettings.from_config(compose(["prompt=hi", "serve=default", "serve.max_batch=65"]))
    with pytest.raises(TypeError):
        DEFAULTS.changed(max_batches=2)


def test_threads_are_one_setting_applied_in_one_place():
    import torch

    before = torch.get_num_threads()
    try:
        use_threads(1)
        assert torch.get_num_threads() == 1
        use_threads(None)  # torch's default: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert EngineSettings.from_config(compose(["prompt=hi", "threads=2"])).threads == 2
