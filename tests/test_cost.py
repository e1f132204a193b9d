"""The forward-cost curve: measured once per setup, cached, re-measured when the setup changes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specfree.adapters.hf import HFAdapter
from specfree.adapters.norms import stock_norms
from specfree.kernels import load_kernels, stock_linears
from specfree.cost import CostModel
from tests.tiny_models import tiny_model


def test_one_dear_point_does_not_lift_the_points_above_it():
    # A stall while two rows were timed: the counts above stay at their own times, two rows at theirs.
    curve = CostModel([1, 2, 4, 8], [1.0, 27.0, 1.3, 1.6])
    assert curve.seconds.tolist() == [1.0, 1.3, 1.3, 1.6]
    curve.add(3, 50.0)
    assert curve(3) == pytest.approx(1.3) and curve(8) == pytest.approx(1.6)


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

    monkeypatch.setattr(CostModel, "quick", classmethod(fake_measure))
    monkeypatch.setattr(CostModel, "holds", lambda self, adapter: True)  # the fake curves' shapes are not real
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


def test_a_cached_curve_whose_shape_no_longer_holds_is_measured_again(tmp_path):
    """A file that says 8 rows cost 3x one row, where they cost far less (a tiny model's forward is
    mostly fixed overhead), is measured again and rewritten; pricing never reads the stale shape."""
    adapter = HFAdapter(tiny_model("llama"), check_tree_mask=False)
    first = CostModel.cached(adapter, tmp_path)
    path, = (tmp_path / "costs").iterdir()
    stale = CostModel([1, 8], [1e-3, 3e-3])
    assert not stale.holds(adapter)
    path.write_text(json.dumps(stale.as_dict()))
    again = CostModel.cached(adapter, tmp_path)
    # measured again: a quick curve's sizes (one row and two at least), not the stale file's [1, 8]
    # (no ratio of its times is asserted: a loaded machine may time 8 rows at any multiple of one)
    assert again.rows.tolist()[:2] == first.rows.tolist()[:2] == [1, 2]
    assert json.loads(path.read_text()) == again.as_dict()


def test_the_curve_grows_with_the_context_and_prices_each_step_at_its_own():
    adapter = HFAdapter(tiny_model("llama"), check_tree_mask=False)
    assert adapter.max_length >= 400
    costs = CostModel.measure(adapter, context=64, sizes=(1, 4), repeats=1, longer=320)
    assert costs.context == 64 and costs.growth is not None and np.all(costs.growth >= 0)
    again = CostModel.from_dict(costs.as_dict())
    assert again.at(320).seconds.tolist() == costs.at(320).seconds.tolist()
    curve = CostModel([1, 8], [1.0, 1.4], context=256, growth=[0.0, 0.5 / 1024])  # 8 rows: +0.5 s per 1024 tokens
    assert curve.at(256) is curve
    assert curve.at(1280)(8) == pytest.approx(1.9) and curve.at(1280)(1) == pytest.approx(1.0)
    assert curve.at(0)(8) == pytest.approx(1.4 - 0.125)
    flat = CostModel([1, 8], [1.0, 1.4])  # no growth measured: the same curve at every context
    assert flat.at(4096) is flat


def test_a_longer_context_keeps_fewer_rows():
    from specfree.pricer import Pricer
    from specfree.types import Proposal

    curve = CostModel([1, 2, 4, 8], [1.0, 1.05, 1.1, 1.2], context=256, growth=[0.0, 0.1 / 256, 0.3 / 256, 0.7 / 256])
    proposal = Proposal([[5, 6, 7, 8, 9, 10, 11]], source="prompt_lookup")
    pricer = Pricer(curve)
    for depth in range(1, 8):  # this drafter's tokens are accepted 80% of the time at every depth
        for hit in [True] * 79 + [False] * 20:
            pricer.acceptance.record("prompt_lookup", None, depth, hit)
    short = pricer.plan(4, proposal, max_depth=8, context=256)
    long = pricer.plan(4, proposal, max_depth=8, context=2048)
    assert len(short.tree) == 8 and len(long.tree) == 2  # 1.2 s for 8 rows at 256 tokens, 6.1 s at 2048


def test_the_engine_prices_each_step_at_its_context():
    from specfree.engine import Engine
    from tests.tiny_models import reference_greedy

    model = tiny_model("llama")
    # Rows are nearly free at 256 tokens of context and dear at 300+ (a steep growth).
    curve = CostModel([1, 2, 16], [1.0, 1.01, 1.02], context=256, growth=[0.0, 0.05, 0.1])
    prompt = [5, 6, 7, 8] * 80  # 320 tokens that prompt lookup matches everywhere
    rows = {}
    for price_context in (True, False):
        engine = Engine.from_model(model, None, "prompt_lookup", costs=curve, price_context=price_context)
        result = engine.generate(prompt, 12, ignore_eos=True)
        assert result.tokens == reference_greedy(model, prompt, 12, ignore_eos=True)
        rows[price_context] = max(s.rows for s in result.steps)
    assert rows == {True: 1, False: rows[False]} and rows[False] > 1


def test_a_first_curve_is_quick_and_bounded_by_its_budget(capsys, monkeypatch):
    adapter = HFAdapter(tiny_model("llama"), check_tree_mask=False)
    forwards = []
    handle = adapter.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    costs = CostModel.quick(adapter, budget=0.0)  # no budget at all: one row and two rows, best of two each
    assert costs.rows.tolist() == [1, 2] and len(forwards) == 1 + 3 + 2
    assert adapter.past_len == 0 and costs.growth is None
    monkeypatch.setattr("specfree.cost.NOTICE_S", 0.0)  # every first curve worth a line on stderr
    forwards.clear()
    costs = CostModel.quick(adapter, budget=1e9)  # every quick size, and the second context
    handle.remove()
    assert costs.rows.tolist() == [1, 2, 4, 8, 16] and costs.growth is not None
    assert len(forwards) == (1 + 3 + 2 * 4) + (1 + 3 * 5)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("specfree: timing this model's forwards to price drafts")


def test_a_row_count_never_timed_is_never_free():
    flat = CostModel([1, 8], [1.0, 1.0])
    assert flat(9) > flat(8) and flat(72) == pytest.approx(2.0)  # at least 1/64 of one row per row beyond
    alone = CostModel([1], [0.5])
    assert alone(1) == 0.5 and alone(65) == pytest.approx(1.0)
    assert CostModel([1, 2], [1.0, 1.5])(4) == pytest.approx(2.5)  # the last two points' slope, where steeper


def test_the_engine_learns_the_row_counts_its_curve_lacks(tmp_path):
    from specfree.cost import LEARN_SAMPLES
    from specfree.engine import Engine

    adapter = HFAdapter(tiny_model("llama"), check_tree_mask=False)
    path = tmp_path / "costs" / "curve.json"
    path.parent.mkdir()
    curve = CostModel([1, 2, 8], [1.0, 1.5, 2.0], context=64, growth=[0.0, 0.01, 0.02])
    curve.path = path
    learner = curve.learner()
    for seconds in (3.5, 3.1, 3.3)[:LEARN_SAMPLES]:
        learner.observe(4, seconds, context=164)  # 3.1 s at 164 tokens: 1.77 s at the curve's 64
        learner.observe(2, 9.0)  # a point the curve has stays as it is (without adapt_costs)
    assert curve.rows.tolist() == [1, 2, 4, 8] and curve(4) == pytest.approx(3.1 - 100 * 0.04 / 3) and curve(2) == 1.5
    assert CostModel.from_dict(json.loads(path.read_text())).rows.tolist() == [1, 2, 4, 8]
    adapting = curve.learner(adapt=True)
    adapting.observe(2, 2.5)
    assert curve(2) == pytest.approx(1.6)
    # The engine's own curve learns; one it was given is the caller's, moved only with adapt_costs.
    own = Engine.from_model(adapter.model, None, "prompt_lookup", adapter=adapter, cache_dir=str(tmp_path))
    assert own._costs.curve is own.costs and not own._costs.adapt
    given = Engine.from_model(adapter.model, None, "prompt_lookup", adapter=adapter, costs=curve)
    assert given._costs is None


def test_a_quick_curve_without_growth_gets_it_at_the_next_build(tmp_path, monkeypatch):
    adapter = HFAdapter(tiny_model("llama"), check_tree_mask=False)
    first = CostModel.cached(adapter, tmp_path)
    path, = (tmp_path / "costs").iterdir()
    quick = CostModel([1, 2, 4], [1e-3, 1.1e-3, 1.2e-3], context=64)  # as a real model's first curve: no growth
    path.write_text(json.dumps(quick.as_dict()))
    monkeypatch.setattr(CostModel, "holds", lambda self, adapter: True)  # its made-up shape is not checked
    again = CostModel.cached(adapter, tmp_path)
    assert again.rows.tolist() == [1, 2, 4] and again.growth is not None and np.all(np.diff(again.growth) >= 0)
    assert json.loads(path.read_text()) == again.as_dict()
    steep = CostModel([1, 2], [1e-3, 1e-1], context=64)  # two rows 100x one: growing them costs too much
    assert not steep.grow(adapter) and steep.growth is None
    assert first.rows[0] == 1
