"""precision=auto (specfree/kernels/precision.py): a quantized GGUF's coded layers run int8 only
where a probe finds it faster on this CPU, else exact; the probe's times are cached per CPU and
file type, and the choice and its reason reach ``describe()`` and the adapter's record. The tests
inject the probe's times (none depends on how fast anything runs here), and run the real probe
once for its shape alone."""

from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as T

from specfree.adapters.hf import HFAdapter
from specfree.kernels import load_kernels, resolve_precision
from specfree.kernels.codes import CodedLinear
from specfree.kernels.precision import (MARGIN, PROBE_ROWS, PrecisionChoice, choose_precision, decide,
                                        probe_layers, probe_path, probe_precisions)
from specfree.loading import load_model
from specfree.settings import DEFAULTS, EngineSettings
from tests import tiny_models
from tests.test_gguf import tiny_file

ISA = load_kernels(progress=False)


def at(cache_dir, precision: str = "auto") -> EngineSettings:
    """The settings of an adapter at ``precision`` that caches under ``cache_dir``."""
    return DEFAULTS.changed(precision=precision, cache_dir=cache_dir)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")

INT8_FASTER = {"exact": {1: 13.0, 8: 26.0}, "int8": {1: 10.0, 8: 20.0}}  # 1.3x at both
INT8_DEARER = {"exact": {1: 13.7, 8: 34.6}, "int8": {1: 13.9, 8: 37.7}}  # issue 77's Zen 3


class Probe:
    """Injected times, counting the calls (a cached probe is not run again)."""

    def __init__(self, times):
        self.times, self.calls = times, 0

    def __call__(self, model):
        self.calls += 1
        return self.times


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-precision")


def from_file(gguf_dir, tmp_path, qtype=T.Q4_1):
    model, _ = load_model(str(tiny_file(gguf_dir, qtype)), cache_dir=tmp_path)
    return model


def test_int8_is_chosen_only_where_its_passes_take_less_time_by_the_margin():
    assert decide(INT8_FASTER, "probe") == PrecisionChoice(
        "int8", "int8 1.30x faster than exact on this CPU (1.30x at 1 row, 1.30x at 8 rows; probe)")
    slower = decide(INT8_DEARER, "probe, cached")
    assert slower == PrecisionChoice(
        "exact", "int8 not faster than exact on this CPU (0.94x: 0.99x at 1 row, 0.92x at 8 rows; probe, cached)")
    vnni = {"exact": {1: 8.7, 8: 20.5}, "int8": {1: 8.6, 8: 14.4}}  # run BG's Zen 4: a tie at one row
    assert decide(vnni, "probe").precision == "int8"
    at_margin = {"exact": {1: 10.0, 8: 20.0}, "int8": {1: 9.99 / MARGIN, 8: 19.99 / MARGIN}}
    assert decide(at_margin, "probe").precision == "int8"
    short = {"exact": {1: 10.0, 8: 20.0}, "int8": {1: 10.0, 8: 19.0}}  # 1.03x in sum
    assert decide(short, "probe").precision == "exact"


@pytest.mark.parametrize("times, expected", [(INT8_FASTER, "int8"), (INT8_DEARER, "exact")])
def test_auto_follows_the_probe_which_runs_once_and_is_read_from_its_cache_after(gguf_dir, tmp_path, times, expected):
    model = from_file(gguf_dir, tmp_path)
    probe = Probe(times)
    first = choose_precision(model, at(tmp_path), probe)
    assert first.precision == expected and first.why.endswith("; probe)") and probe.calls == 1
    saved = json.loads(probe_path(model, tmp_path).read_text())
    assert saved["ms"]["int8"] == {str(r): ms for r, ms in times["int8"].items()}
    again = choose_precision(model, at(tmp_path), probe)
    assert again.precision == expected and again.why.endswith("; probe, cached)") and probe.calls == 1
    assert resolve_precision(model, at(tmp_path)) == expected
    for asked in ("exact", "int8"):  # asked for: no probe
        chosen = choose_precision(model, at(tmp_path, asked), probe)
        assert chosen == PrecisionChoice(asked, f"asked (precision={asked})")
    assert probe.calls == 1


def test_a_damaged_cache_is_probed_again_and_each_file_type_has_its_own(gguf_dir, tmp_path):
    q4_1, q8_0 = from_file(gguf_dir, tmp_path), from_file(gguf_dir, tmp_path, T.Q8_0)
    assert probe_path(q4_1, tmp_path) != probe_path(q8_0, tmp_path)
    assert probe_path(q4_1, tmp_path) == probe_path(from_file(gguf_dir, tmp_path), tmp_path)  # same type, same file
    choose_precision(q4_1, at(tmp_path), Probe(INT8_FASTER))
    probe_path(q4_1, tmp_path).write_text("{not json")
    probe = Probe(INT8_DEARER)
    assert choose_precision(q4_1, at(tmp_path), probe).precision == "exact" and probe.calls == 1
    other = Probe(INT8_FASTER)
    assert choose_precision(q8_0, at(tmp_path), other).precision == "int8" and other.calls == 1


def test_float_weights_stay_exact_without_a_probe(tmp_path):
    rounded = tiny_models.tiny_model.__wrapped__("llama_gguf")  # float weights that are exactly codes
    HFAdapter(rounded, check_tree_mask=False, cache_dir=tmp_path)
    assert any(isinstance(m, CodedLinear) for m in rounded.modules())
    assert choose_precision(rounded, at(tmp_path), Probe(INT8_FASTER)) == PrecisionChoice(
        "exact", "float weights: transformers' arithmetic")
    assert not (tmp_path / "costs").exists()


@pytest.mark.parametrize("times, expected", [(INT8_FASTER, "int8"), (INT8_DEARER, "exact")])
def test_the_adapter_runs_and_says_the_choice_and_why(gguf_dir, tmp_path, times, expected):
    model = from_file(gguf_dir, tmp_path)
    choose_precision(model, at(tmp_path), Probe(times))  # the probe's times, cached for the adapter
    adapter = HFAdapter(model, check_tree_mask=False, cache_dir=tmp_path)
    assert {m.precision for m in model.modules() if isinstance(m, CodedLinear)} == {expected}
    record = adapter.path()
    why = decide(times, "probe, cached").why
    assert record["precision"] == expected and record["precision_because"] == why
    assert f"precision={expected} (layers held as codes multiply " in adapter.describe() and why in adapter.describe()
    exact = HFAdapter(model, check_tree_mask=False, cache_dir=tmp_path, precision="exact")
    assert exact.path()["precision_because"] == "asked (precision=exact)"


def test_the_probe_times_both_precisions_at_its_row_counts_within_its_budget(gguf_dir, tmp_path):
    model = from_file(gguf_dir, tmp_path)
    times = probe_precisions(model, rounds=1)
    assert set(times) == {"exact", "int8"} and all(set(t) == set(PROBE_ROWS) for t in times.values())
    assert all(ms > 0 for t in times.values() for ms in t.values())
    coded = [m for m in model.modules() if isinstance(m, CodedLinear)]
    assert probe_layers(model, budget=1) == coded[:1] and probe_layers(model) == coded  # a tiny model: all of it
