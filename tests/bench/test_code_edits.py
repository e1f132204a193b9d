"""The code-editing workload: the generator is deterministic, every prompt is answerable (the
function's code is in it, the names an instruction mentions are in the code), and the shipped
sets load through ``bench=code_edits``."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import platform
import re
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specfree.bench import code_edits
from specfree.bench.cli import BenchSettings
from specfree.bench.prompts import SHIPPED, load_prompts

CONFIG = Path(code_edits.__file__).parents[1] / "conf" / "bench" / "code_edits.yaml"
CODE = re.compile(r"```python\n(.*?)\n```", re.S)


@pytest.fixture(scope="module")
def functions():
    return code_edits.stdlib_functions()


def live_source(qualname: str) -> str:
    module, name = qualname.rsplit(".", 1)
    return inspect.getsource(getattr(importlib.import_module(module), name)).rstrip("\n")


def check_answerable(row: dict, live: bool) -> None:
    """The prompt holds the function's code (this Python's source of it, when ``live``), and
    every edit it asks for has something to act on in that code."""
    first = row["turns"][0]
    code = CODE.search(first).group(1)
    node = ast.parse(code).body[0]
    assert isinstance(node, ast.FunctionDef) and node.name == row["source"].rsplit(".", 1)[1]
    if live:
        assert code == live_source(row["source"])
    kinds = row["category"].split("+")
    assert len(row["turns"]) == len(kinds) and set(kinds) <= set(code_edits.KINDS)
    assert all(t.startswith(code_edits.FOLLOW_UP) for t in row["turns"][1:])
    names = set(re.findall(r"[A-Za-z_]\w*", code))
    for kind, turn in zip(kinds, row["turns"]):
        if kind == "rename_variable":
            old, new = re.search(r"rename the variable `(\w+)` to `(\w+)`", turn).groups()
            assert old in names and new not in names
        if kind == "pathlib":
            assert "os.path." in code
        if kind == "f_strings":
            assert "%" in code or ".format(" in code
        if kind == "type_hints":
            assert node.returns is None and not any(a.annotation for a in node.args.args)
        if kind == "docstring":
            assert ast.get_docstring(node) is None


def test_generator_is_deterministic_and_every_prompt_is_answerable(functions):
    single = code_edits.make_single(functions, 12, seed=3)
    assert single == code_edits.make_single(functions, 12, seed=3)
    assert single != code_edits.make_single(functions, 12, seed=4)  # the seed picks the functions
    multi = code_edits.make_multi_turn(functions, 1, seed=3, exclude={r["source"] for r in single})
    assert multi == code_edits.make_multi_turn(functions, 1, seed=3, exclude={r["source"] for r in single})
    rows = single + multi
    assert [r["category"] for r in single] == [k for k in code_edits.KINDS for _ in range(2)]
    assert [r["category"] for r in multi] == ["+".join(c) for c in code_edits.CHAINS]
    assert len({r["source"] for r in rows}) == len(rows) and len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        check_answerable(row, live=True)
    with pytest.raises(ValueError, match="multiple of the 6 edit kinds"):
        code_edits.make_single(functions, 10, seed=0)


def test_shipped_sets_load_and_are_answerable():
    single = load_prompts(SHIPPED["code_edits"], "jsonl", {"turns": "turns"})
    multi = load_prompts(SHIPPED["code_edits_multi_turn"], "jsonl", {"turns": "turns"})
    assert len(single) == 48 and Counter(i.category for i in single) == {k: 8 for k in code_edits.KINDS}
    assert len(multi) == 12 and all(len(i.turns) >= 2 for i in multi)
    for name in SHIPPED:
        rows = [json.loads(line) for line in SHIPPED[name].read_text().splitlines()]
        same_python = rows[0]["python"].rsplit(".", 1)[0] == platform.python_version().rsplit(".", 1)[0]
        for row in rows:
            check_answerable(row, live=same_python)


@pytest.mark.skipif(not json.loads(SHIPPED["code_edits"].read_text().splitlines()[0])["python"]
                    .startswith(".".join(platform.python_version_tuple()[:2]) + "."),
                    reason="the shipped sets were sampled from another Python's stdlib")
def test_shipped_sets_are_what_the_generator_makes(tmp_path):
    assert code_edits.main(["--out", str(tmp_path)]) == 0
    for name in ("code_edits.jsonl", "code_edits_multi_turn.jsonl"):
        made = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        shipped = [json.loads(line) for line in (SHIPPED[name.removesuffix(".jsonl")]).read_text().splitlines()]
        assert [{k: v for k, v in r.items() if k != "python"} for r in made] == \
            [{k: v for k, v in r.items() if k != "python"} for r in shipped]


def test_bench_config_points_at_the_shipped_set(tmp_path):
    bench = OmegaConf.to_container(OmegaConf.load(CONFIG))
    settings = BenchSettings.from_config({"model": "smollm2", "bench": {**bench, "out": str(tmp_path)}})
    assert settings.prompts == SHIPPED["code_edits"] and settings.bench.max_new_tokens == 256
    items = load_prompts(settings.prompts, settings.bench.format, settings.bench.fields)
    assert [i.category for i in items[:8]] == ["type_hints"] * 8
    multi = BenchSettings.from_config({"model": "smollm2", "bench": {**bench, "prompts": "code_edits_multi_turn",
                                                                     "out": str(tmp_path)}})
    assert multi.prompts == SHIPPED["code_edits_multi_turn"]
