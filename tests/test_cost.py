"""The forward-cost curve: measured once per setup, cached, re-measured when the setup changes."""

from __future__ import annotations

import numpy as np

from specfree.adapters.hf import HFAdapter
from specfree.adapters.norms import stock_norms
from specfree.kernels import load_kernels, stock_linears
from specfree.cost import CostModel
from tests.tiny_models import tiny_model


def test_a_measured_curve_is_sorted_and_never_falls():
    adapter = HFAdapter(tiny_model("llama"), check_tree_mask=False)
    costs = CostModel.measure(adapter, context=16, sizes=(4, 1, 2), repeats=1)
    assert costs.rows.tolist() == [1, 2, 4]
    assert np.all(np.diff(costs.seconds) >= 0) and costs.seconds[0] > 0
    assert adapter.past_len == 0  # the measurement leaves no KV behind


def test_the_curve_is_measured_once_per_setup(tmp_path, monkeypatch):
    measured = []

    def fake_measure(cls, adapter, **_):
        measured.append(adapter)
        return CostModel([1, 2], [1.0, 1.5 + len(measured)])

    monkeypatch.setattr(CostModel, "measure", classmethod(fake_measure))
    model = tiny_model("llama")
    adapter = HFAdapter(model, check_tree_mask=False)
    first = CostModel.cached(adapter, tmp_path)
    assert CostModel.cached(adapter, tmp_path).seconds.tolist() == first.seconds.tolist() == [1.0, 2.5]
    assert len(measured) == 1
    files = list((tmp_path / "costs").iterdir())
    files[0].write_text("{not json")  # a damaged file is measured again
    assert CostModel.cached(adapter, tmp_path).seconds.tolist() == [1.0, 3.5]
    if load_kernels() is not None:
        with stock_linears(model):  # other kernels, another curve
            CostModel.cached(adapter, tmp_path)
        assert len(measured) == 3 and len(list((tmp_path / "costs").iterdir())) == 2
    with stock_norms(model):  # transformers' norm layers: another curve
        CostModel.cached(adapter, tmp_path)
    assert len(list((tmp_path / "costs").iterdir())) == (3 if load_kernels() is not None else 2)
    before = len(measured)
    monkeypatch.setattr("specfree.cost.kernel_dir", lambda: tmp_path / "another-build")  # the ops' sources changed
    CostModel.cached(adapter, tmp_path)
    assert len(measured) == before + 1
