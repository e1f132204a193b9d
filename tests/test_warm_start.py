"""A warm start (``adapters/warm.py``): the second engine of a GGUF file's compiled setup runs the
package alone, without building the model, and decodes exactly what the first did.

A tiny Llama GGUF (Q4_0 codes) on the compiled path: the first ``engine_parts`` builds the model and
its package and keeps a record; the second reads the record. Their logits are compared bit for bit
on a prompt longer than a package call takes (so it runs in pieces) and on a tree step, and their
outputs token for token for several strategies, greedy and seeded sampling.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest
import torch
from gguf import GGMLQuantizationType as T

from specfree import Engine
from specfree.adapters.capabilities import causal
from specfree.adapters.packaged import MAX_ROWS
from specfree.adapters.warm import CONSTANTS, FACTS, WarmAdapter
from specfree.config import engine_parts, load_config
from specfree.kernels.c_shims import ENTRIES, declaration
from specfree.plugins import build_plugin_manager, registry
from tests.test_gguf import tiny_file

pytestmark = pytest.mark.skipif(not hasattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader"),
                                reason="this torch has no AOTInductor package loader")

LONG_PROMPT = [(7 * i + 3) % 250 + 5 for i in range(MAX_ROWS * 2 + 9)]  # three package calls


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(registry, overrides, the first start's parts) over one cache folder, threads fixed."""
    folder = tmp_path_factory.mktemp("warm")
    path = tiny_file(folder, T.Q4_0)
    reg = registry(build_plugin_manager())
    overrides = [f"model.path={path}", f"cache_dir={folder / 'cache'}", "compile=true", "threads=1"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    first = engine_parts(load_config(None, overrides, reg), reg, warm=True)
    yield reg, overrides, first
    torch.set_num_threads(before)


def parts(setup, *extra: str) -> dict:
    reg, overrides, _ = setup
    return engine_parts(load_config(None, [*overrides, *extra], reg), reg, warm=True)


def test_the_second_start_is_warm_and_runs_the_package_alone(setup):
    first, second = setup[2]["adapter"], parts(setup)["adapter"]
    assert not isinstance(first, WarmAdapter) and first.compiled
    assert isinstance(second, WarmAdapter) and second.compiled
    assert second.path()["forward"] == "aoti package (warm start)"
    assert second.path()["precision"] == first.path()["precision"]
    assert (second.vocab_size, second.max_length, second.rows_exact) == (first.vocab_size, first.max_length,
                                                                       first.rows_exact)
    assert second.linears == first.linears


def test_the_package_calls_the_ops_c_entries_not_its_proxy_executor(setup):
    """The ops with a C entry (``c_shims.py``) are plain calls of the package's wrapper: none is among
    the nodes its proxy executor dispatches by name."""
    with zipfile.ZipFile(setup[2]["adapter"].runner.package.path) as archive:
        wrapper = next(name for name in archive.namelist() if name.endswith(".wrapper.cpp"))
        source = archive.read(wrapper).decode()
        boxed = {node["node"]["target"] for node in json.loads(archive.read(wrapper[:-3] + "json"))["nodes"]}
    assert "aoti_torch_cpu_coded_linear(" in source
    assert not boxed & {f"specfree::{name}" for name in ENTRIES}, boxed


def test_an_op_whose_arguments_have_no_c_form_gets_no_entry():
    from specfree.kernels import load_kernels

    assert load_kernels() is not None
    with pytest.raises(TypeError, match="dtype"):  # rotary's ScalarType argument
        declaration(torch.ops.specfree.rotary.default)


def test_a_warm_adapters_logits_are_the_first_starts_bit_for_bit(setup):
    first, second = setup[2]["adapter"], parts(setup)["adapter"]
    prompt = torch.tensor(LONG_PROMPT)
    tree = torch.tensor([11, 12, 13, 14, 15])
    allowed = causal(5)
    allowed[3, 1:3] = False  # a branch: row 3 sees the root only
    allowed[4, 1:3] = False
    out = []
    for adapter in (first, second):
        adapter.reset()
        adapter.prefill(prompt[:-1])
        root = adapter.forward(prompt[-1:])
        adapter.commit([0], 1)
        out.append((root, adapter.forward(tree, allowed)))
        adapter.reset()
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("strategy", ["hybrid", "autoregressive", "lookahead"])
def test_a_warm_start_decodes_what_the_first_did(setup, strategy):
    b = Engine(**parts(setup, f"strategy={strategy}"))
    a = Engine(**{**parts(setup, f"strategy={strategy}"), "adapter": setup[2]["adapter"]})
    assert isinstance(b.adapter, WarmAdapter)
    for prompt in (LONG_PROMPT, LONG_PROMPT[:12]):
        assert b.generate(prompt, 24, ignore_eos=True).tokens == a.generate(prompt, 24, ignore_eos=True).tokens


def test_seeded_sampling_on_a_warm_start_equals_the_first_starts(setup):
    sampling = ("verifier=sampling", "verifier.temperature=0.8", "seed=3")
    b = Engine(**parts(setup, *sampling))
    a = Engine(**{**parts(setup, *sampling), "adapter": setup[2]["adapter"]})
    assert isinstance(b.adapter, WarmAdapter)
    assert b.generate(LONG_PROMPT[:20], 16, ignore_eos=True, seed=3).tokens == \
        a.generate(LONG_PROMPT[:20], 16, ignore_eos=True, seed=3).tokens


def test_another_precision_is_another_record(setup):
    warm, other = parts(setup)["adapter"], parts(setup, "precision=exact")["adapter"]
    assert isinstance(warm, WarmAdapter) and not isinstance(other, WarmAdapter)
    assert other.path()["precision"] == "exact" != warm.path()["precision"]
    assert isinstance(parts(setup, "precision=exact")["adapter"], WarmAdapter)  # kept by the start before


def test_a_damaged_record_is_built_again(setup):
    record = parts(setup)["adapter"].record
    (record / CONSTANTS).write_bytes(b"not a torch file")
    rebuilt = parts(setup)["adapter"]
    assert not isinstance(rebuilt, WarmAdapter) and rebuilt.compiled
    assert (record / FACTS).is_file() and isinstance(parts(setup)["adapter"], WarmAdapter)


def test_a_warm_start_loads_no_transformers_modeling_code(setup):
    """What makes it fast: transformers' modeling code and dynamo are seconds of imports."""
    parts(setup)  # the record exists
    script = f"""
import sys, torch
torch.set_num_threads(1)
from specfree.config import engine_parts, load_config
from specfree.plugins import build_plugin_manager, registry
from specfree import Engine
reg = registry(build_plugin_manager())
engine = Engine(**engine_parts(load_config(None, {setup[1]!r}, reg), reg, warm=True))
tokens = engine.generate({LONG_PROMPT[:12]!r}, 8, ignore_eos=True).tokens
loaded = [m for m in ("transformers.modeling_utils", "torch._dynamo", "transformers.models.auto") if m in sys.modules]
print(type(engine.adapter).__name__, loaded, len(tokens))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[-2] == "WarmAdapter [] 8", out


def test_a_warm_start_decodes_under_a_constraint_what_the_first_did(setup):
    b = Engine(**parts(setup))
    a = Engine(**{**parts(setup), "adapter": setup[2]["adapter"]})
    assert isinstance(b.adapter, WarmAdapter)
    constrained = dict(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert b.generate(LONG_PROMPT[:12], 16, **constrained).tokens == a.generate(LONG_PROMPT[:12], 16,
                                                                                 **constrained).tokens


def test_the_warm_up_command_keeps_a_warm_start(setup, tmp_path, capsys):
    """``specfree warm-up`` (README.md#set-up-and-test runs it): a record for the setup it is given."""
    from specfree import cli

    code = cli.main(["warm-up", *setup[1], "precision=int8", f"hydra.run.dir={tmp_path}"])
    assert code == 0 and "aoti package" in capsys.readouterr().err
    assert isinstance(parts(setup, "precision=int8")["adapter"], WarmAdapter)
