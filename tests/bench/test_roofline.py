"""The roofline (``bench/roofline.py``) and its probes (``specfree::fma_peak``, ``specfree::int8_peak``):
the probes give positive finite rates on every path this CPU runs and refuse one it lacks; a tiny
GGUF model's roofline has one entry per distinct coded call shape (a shared group once, at its
concatenated outputs), counts that add up to the forward's coded calls, multiply-adds and bytes
that are the shapes' own, a report section and a plot; a float model's is skipped with its reason.
No speed is asserted."""

from __future__ import annotations

import json
import math

import pytest
import torch
from gguf import GGMLQuantizationType as T

from specfree.adapters.hf import HFAdapter
from specfree.bench.plots import roofline_plot
from specfree.bench.roofline import coded_calls, roofline, section, table_rows
from specfree.kernels import load_kernels
from specfree.kernels.codes import CodedEmbedding, CodedLinear
from specfree.kernels.shared_input import SharingLinear
from specfree.loading import load_model
from tests.test_gguf import tiny_file

ISA = load_kernels(progress=False)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")
PATHS = ["auto", "avx2", "avx512"] if ISA == "avx512" else ["auto", "avx2"]
ROWS = (1, 8)


@pytest.mark.parametrize("path", PATHS)
def test_the_probes_give_positive_finite_rates_on_every_path_this_cpu_runs(path):
    rates = [torch.ops.specfree.fma_peak(path), torch.ops.specfree.int8_peak(path)]
    if path == "avx512":
        rates.append(torch.ops.specfree.int8_peak("avx512_novnni"))
    assert all(isinstance(r, float) and math.isfinite(r) and r > 0 for r in rates)


def test_the_probes_refuse_a_path_this_cpu_lacks_and_a_name_they_do_not_know():
    if ISA == "avx2":  # an AVX2-only CPU (Zen 3): no AVX-512 path is run
        for probe, path in ((torch.ops.specfree.fma_peak, "avx512"), (torch.ops.specfree.int8_peak, "avx512"),
                            (torch.ops.specfree.int8_peak, "avx512_novnni")):
            with pytest.raises(RuntimeError, match="this CPU cannot run the avx512 code path"):
                probe(path)
    with pytest.raises(RuntimeError, match="specfree::fma_peak: isa must be auto, avx2 or avx512, not sse"):
        torch.ops.specfree.fma_peak("sse")
    with pytest.raises(RuntimeError, match="specfree::int8_peak: isa must be auto, avx2 or avx512, not avx512_vnni"):
        torch.ops.specfree.int8_peak("avx512_vnni")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-roofline")


def forward_calls(model) -> list[tuple[int, int]]:
    """(outputs, inputs) of each coded call the forward makes, counted from the layers themselves."""
    tables = {id(m.table) for m in model.modules() if isinstance(m, CodedEmbedding) and "table" in m._modules}
    groups = {id(m.call): m.call for m in model.modules() if isinstance(m, SharingLinear)}
    alone = [m for m in model.modules()
             if isinstance(m, CodedLinear) and not isinstance(m, SharingLinear) and id(m) not in tables]
    return ([(sum(c.sizes), c.members[0].in_features) for c in groups.values()]
            + [(m.out_features, m.in_features) for m in alone])


@pytest.mark.parametrize("precision, tied", [("exact", True), ("int8", False)])
def test_a_tiny_gguf_models_roofline_has_each_call_shape_once_and_its_own_arithmetic(precision, tied, gguf_dir,
                                                                                     tmp_path):
    model, _ = load_model(str(tiny_file(gguf_dir, T.Q4_K, tied=tied)), cache_dir=tmp_path)
    HFAdapter(model, check_tree_mask=False, precision=precision)
    expected = forward_calls(model)
    assert len(expected) == 2 * 4 + 1  # per layer q|k|v, o, gate|up, down; the head (an own embedding aside)
    calls = coded_calls(model)
    assert sorted((c.n, c.k) for c in calls) == sorted(expected)
    result = json.loads(json.dumps(roofline(model, rows=ROWS, rounds=1)))  # plain JSON, as the bench stores it
    assert result["precision"] == precision and result["rows"] == list(ROWS)
    assert result["read_gb_s"] > 0 and all(v > 0 for v in result["peak_gmac_s"].values())
    entries = result["calls"]
    shapes = {(c.n, c.k, c.gguf_type, c.precision) for c in calls}
    assert sorted((e["n"], e["k"], e["type"], e["precision"]) for e in entries) == sorted(shapes)  # each once
    assert sum(e["count"] for e in entries) == result["forward"]["count"] == len(expected)
    hidden = model.config.hidden_size
    shared = next(e for e in entries if "q_proj|k_proj|v_proj" in e["layers"])
    heads = model.config.num_attention_heads
    kv = hidden // heads * model.config.num_key_value_heads
    assert (shared["n"], shared["k"]) == (hidden + 2 * kv, hidden)  # the group's outputs concatenated
    by_shape = {(c.n, c.k, c.gguf_type, c.precision): c for c in calls}
    for e in entries:
        assert e["bytes"] == by_shape[(e["n"], e["k"], e["type"], e["precision"])].codes.nbytes()
        assert [p["rows"] for p in e["points"]] == list(ROWS)
        for p in e["points"]:
            macs = p["rows"] * e["n"] * e["k"]
            assert p["mac_per_byte"] == pytest.approx(macs / e["bytes"], abs=1e-3)
            assert p["gmac_s"] == pytest.approx(macs / (p["ms"] / 1e3) / 1e9, rel=0.02, abs=0.01)
            assert p["gb_s"] == pytest.approx(e["bytes"] / (p["ms"] / 1e3) / 1e9, rel=0.02, abs=0.01)
            assert p["of_roof"] == pytest.approx(max(p["of_read"], p["of_peak"]), abs=2e-3)
    forward = result["forward"]
    assert forward["bytes"] == sum(e["bytes"] * e["count"] for e in entries)
    for i, p in enumerate(forward["points"]):
        assert p["ms"] == pytest.approx(sum(e["points"][i]["ms"] * e["count"] for e in entries), rel=0.01)
        macs = sum(p["rows"] * e["n"] * e["k"] * e["count"] for e in entries)
        assert p["mac_per_byte"] == pytest.approx(macs / forward["bytes"], abs=1e-3)
    meta = {"roofline": result, "cpu": "test"}
    assert len(table_rows(result)) == (len(entries) + 1) * len(ROWS)
    assert "## Roofline" in section(meta) and "forward (coded calls)" in section(meta)
    assert roofline_plot(meta, tmp_path / "roofline.png") == tmp_path / "roofline.png"
    assert (tmp_path / "roofline.png").stat().st_size > 0


def test_the_bench_cost_curves_carry_the_roofline_of_the_engines_model(gguf_dir, tmp_path):
    from specfree.bench.cli import cost_curves

    model, _ = load_model(str(tiny_file(gguf_dir, T.Q4_K, tied=True)), cache_dir=tmp_path)
    adapter = HFAdapter(model, check_tree_mask=False, precision="exact")
    meta = cost_curves(model, adapter, None, None, tmp_path, threads=torch.get_num_threads())
    result = meta["roofline"]
    assert "roofline_skipped" not in meta and result["rows"] == [1, 2, 4, 8, 16]
    assert result["forward"]["count"] == len(forward_calls(model)) and json.dumps(result)


def test_a_float_models_roofline_is_skipped_with_its_reason(tiny_model_dir, tmp_path):
    model, _ = load_model(str(tiny_model_dir), cache_dir=tmp_path)
    HFAdapter(model, check_tree_mask=False)
    result = roofline(model, rows=ROWS, rounds=1)
    assert result == {"skipped": "no layer is held as a quantized file's codes (a float model): no coded call to time"}
    meta = {"roofline_skipped": result["skipped"]}
    assert section(meta) == f"## Roofline\n\nNot measured: {result['skipped']}."
    assert roofline_plot(meta, tmp_path / "roofline.png") is None and not (tmp_path / "roofline.png").exists()


@pytest.mark.parametrize("args", [["--out"], ["-m", "threads=2"]])
def test_the_standalone_command_says_its_usage_before_loading_anything(args, capsys):
    from specfree.cli import USAGE_ERROR, main

    assert main(["roofline", *args]) == USAGE_ERROR
    assert capsys.readouterr().err.startswith("error: usage: python -m specfree roofline [--out DIR]")
