"""What pricing predicted beside what happened, the price kept to the machine, and a hybrid never
planning worse than one of its members alone (issue 82)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.bench import predicted
from specfree.cost import Corrected, Correction, CostModel
from specfree.pricer import Pricer
from specfree.pricing import AcceptanceModel, Calibration, Choice, Plan, StepPrices, node_rates, drafted_nodes, price
from specfree.draft_tree import DraftTree
from specfree.types import Proposal
from tests.tiny_models import reference_greedy, tiny_model

CPU = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4])


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[n] for n in tree.path_to(node)) for node in range(1, len(tree))}


def stats(rates: dict[tuple[str, int], float], seen: int = 1000) -> AcceptanceModel:
    """Acceptance statistics whose rate per (drafter, depth) is ``rates``' (seen ``seen`` times each)."""
    acceptance = AcceptanceModel()
    for (source, depth), rate in rates.items():
        hits = round(rate * seen)
        for hit in [True] * hits + [False] * (seen - hits):
            acceptance.record(source, None, depth, hit)
    return acceptance


# "a" guesses one token, often right; "b" a long chain whose first token is a little less likely
# and whose later ones are near certain. Merged, b's chain sits behind a's sibling and shares its
# token's probability; alone, it is worth more than anything the merged tree keeps.
SIBLINGS = Proposal([[1], [2, 3, 4, 5]], "hybrid", sources=["a", "b"])
RATES = {("a", 1): 0.55, ("b", 1): 0.5, **{("b", d): 0.95 for d in range(2, 6)}}


def test_the_planner_runs_a_lone_members_tree_where_it_pays_more_than_the_merged_tree():
    acceptance = stats(RATES)
    plan = price(0, SIBLINGS, acceptance, CPU, max_depth=8)
    assert paths(plan.tree) == {(2,), (2, 3), (2, 3, 4), (2, 3, 4, 5)}
    # What the merged tree alone would have paid, with the same rates and curve, is less.
    nodes = drafted_nodes(SIBLINGS, acceptance)
    choice = Choice(CPU, 1 << 30, False, False, 0.0, acceptance, None)
    merged = choice.tree(node_rates(SIBLINGS, acceptance, 8, nodes), nodes, [], [])
    chosen = (1 + plan.expected) / CPU(plan.rows)
    assert chosen > merged.score
    assert plan.offered == 6 and plan.nodes == nodes  # the step still learns from every drafter's nodes
    assert plan.expected_by.keys() == {"b"}


def test_the_merged_tree_runs_where_it_pays_more_than_any_member():
    # Each member's guess is half likely: together they cover more than either alone, on a flat curve.
    flat = CostModel([1, 2, 64], [1.0, 1.0, 1.0])
    acceptance = stats({("a", 1): 0.5, ("b", 1): 0.5})
    plan = price(0, Proposal([[1], [2]], "hybrid", sources=["a", "b"]), acceptance, flat, max_depth=8)
    assert paths(plan.tree) == {(1,), (2,)}


def test_a_plan_records_what_it_predicted():
    acceptance = stats(RATES)
    plan = price(0, SIBLINGS, acceptance, CPU, max_depth=8)
    assert plan.predicted_s == pytest.approx(CPU(plan.rows))
    assert plan.expected == pytest.approx(sum(q for _, q, _ in plan.kept))
    assert sum(plan.expected_by.values()) == pytest.approx(plan.expected)
    assert 0 < plan.expected < len(plan.tree) - 1
    plain = price(0, Proposal([], "d"), acceptance, CPU, max_depth=8)  # nothing drafted: one row, nothing expected
    assert (plain.predicted_s, plain.expected) == (CPU(1), 0.0)
    assert price(0, SIBLINGS, acceptance, None, max_depth=8).predicted_s is None  # rows free: no time predicted


def test_calibration_scales_a_kind_of_node_by_what_it_got():
    acceptance = stats(RATES)
    calibration = Calibration()
    before = price(0, SIBLINGS, acceptance, CPU, max_depth=8, calibration=calibration)
    for _ in range(20):  # b's chains expected ~2 tokens a step and got none
        calibration.record(before, [9], 0)
    assert calibration.factor("b") < 0.5 and calibration.factor("a") == 1.0
    after = price(0, SIBLINGS, acceptance, CPU, max_depth=8, calibration=calibration)
    assert after.expected < before.expected and (2,) not in paths(after.tree)
    # A kind that got what it expected keeps its factor near 1.
    honest = Calibration()
    for _ in range(50):
        honest.record(Plan(DraftTree.root_only(0), [], [], 2, {(1,): before.nodes[(1,)]}, kept=[((1,), 0.5, 0.5)]),
                      [1, 7] if _ % 2 else [7], 1 if _ % 2 else 0)
    assert honest.factor("a") == pytest.approx(1.0, abs=0.05)


def test_the_correction_follows_measured_forward_times_per_row_count():
    correction = Correction()
    curve = Corrected(CPU, correction)
    assert curve(4) == CPU(4)  # nothing measured yet: the curve as it is
    for _ in range(40):
        correction.observe(1, 0.5 * CPU(1), CPU(1))  # this machine: one row half the curve's
        correction.observe(8, 3.0 * CPU(8), CPU(8))  # eight rows three times
        correction.observe(32, 3.0 * CPU(32), CPU(32))
    assert curve(1) == pytest.approx(0.5 * CPU(1), rel=0.01)
    assert curve(8) == pytest.approx(3 * CPU(8), rel=0.01)
    # A count no step has run: between its neighbours' corrections, or the optimistic price if lower.
    one, optimism = 0.5 * CPU(1), correction.optimism
    assert one * (1 + optimism * 15) < 3 * CPU(16)  # the cap binds here
    assert curve(16) == pytest.approx(one * (1 + optimism * 15), rel=0.01)
    factor_4 = 0.5 + (3.0 - 0.5) * 3 / 7  # between one row's and eight rows' corrections
    assert curve(4) == pytest.approx(min(factor_4 * CPU(4), one * (1 + optimism * 3)), rel=0.01)
    assert curve(64) == pytest.approx(3 * CPU(64))  # past twice the most rows set: not tried yet
    correction.observe(8, 100.0 * CPU(8), CPU(8))  # one stall moves a set count's price a bounded step
    assert curve(8) < 4.5 * CPU(8)
    assert curve.at(512)(8) == curve(8)  # a curve without growth is the same at any context


def test_a_count_the_curve_learns_from_its_steps_is_priced_at_what_they_measured():
    """The correction's ratio for a count is taken against the curve's guess; once the curve learns
    the count from the same steps, the ratio is re-based onto it (not applied to the learned time again)."""
    from specfree.planner import StepPlanner

    curve = CostModel([1, 2, 4], [1.0, 1.2, 1.5])  # 6 rows: 1.95 by the last two points' slope
    pricer = Pricer(curve, correction=Correction())
    planner = StepPlanner(pricer, price_context=False, timing=curve.learner())
    for _ in range(3):
        planner.timed(1, 1.0)
        planner.timed(6, 3.0)  # the machine's six rows: dearer than the guess
    assert 6 in curve.rows and curve(6) == pytest.approx(3.0)
    assert pricer.curve_at(None)(6) == pytest.approx(3.0)  # not 3.0 * (3.0 / 1.95)


def test_counts_past_a_point_taken_too_dear_are_priced_along_the_counts_run():
    """A curve point far above what the machine's counts cost (a slow spell, a shorter context than
    the steps') priced every count past it out of reach; untried counts now cost at most what the
    counts run cost, along their slope."""
    stale = CostModel([1, 2, 3, 4, 6], [1.0, 1.1, 1.2, 1.3, 3.0])  # six rows timed in a stall
    correction = Correction()
    for _ in range(3):
        for rows in (1, 2, 3, 4):
            correction.observe(rows, stale(rows), stale(rows))
    curve = Corrected(stale, correction)
    run_slope = (1.3 - 1.0) / 3
    assert curve(6) == pytest.approx(1.3 + 2 * run_slope)  # not 3.0: no step ran six rows yet
    assert curve(8) == pytest.approx(1.3 + 4 * run_slope)  # up to twice the most rows set
    assert curve(9) > 3.0  # past it: the curve's own price, until the steps get there


def test_a_count_priced_far_too_dear_at_start_up_is_tried_and_then_priced_as_measured():
    stalled = CostModel([1, 2, 4], [1.0, 30.0, 31.0])  # two rows timed during a stall
    correction = Correction()
    curve = Corrected(stalled, correction)
    acceptance = stats({("d", 1): 0.6, ("d", 2): 0.6})
    proposal = Proposal([[1, 2]], "d")
    assert price(0, proposal, acceptance, curve, max_depth=8).rows == 1  # dear: not worth a try yet
    for _ in range(3):
        correction.observe(1, 1.0, 1.0)
    # Priced optimistically until their own times set them, up to twice the most rows set: 2, then 3.
    assert price(0, proposal, acceptance, curve, max_depth=8).rows == 2
    for _ in range(3):
        correction.observe(2, 1.2, stalled(2))
    assert curve(2) == pytest.approx(1.2)
    assert price(0, proposal, acceptance, curve, max_depth=8).rows == 3
    for _ in range(3):
        correction.observe(3, 1.3, stalled(3))
    assert curve(3) == pytest.approx(1.3)
    assert price(0, proposal, acceptance, curve, max_depth=8).rows == 3  # and it pays as measured
    assert curve(16) == pytest.approx(stalled(16) * correction.factors([16])[0])  # past 2 x 3 rows: not tried yet
    for _ in range(3):
        correction.observe(4, 60.0, stalled(4))  # a count as dear as the curve said stays dear
    assert curve(4) == pytest.approx(60.0)


def test_a_pricer_corrects_its_curve_from_timed_steps_at_their_context():
    curve = CostModel([1, 2, 4, 8], [1.0, 1.1, 1.2, 1.3], context=256, growth=[0.001] * 4)
    pricer = Pricer.calibrated(curve)
    for _ in range(40):
        pricer.timed(8, 2.0 * curve.at(1024)(8), context=1024)
    assert pricer.curve_at(1024)(8) == pytest.approx(2.0 * curve.at(1024)(8), rel=0.01)
    assert pricer.curve_at(256)(8) == pytest.approx(2.0 * curve(8), rel=0.01)


def test_the_engine_corrects_its_own_curve_and_a_given_one_only_when_asked(tmp_path):
    model = tiny_model("llama")
    given = CostModel.from_dict(CPU.as_dict())
    assert Engine.from_model(model, None, "suffix", costs=given).pricer.correction is None
    assert Engine.from_model(model, None, "suffix", costs=given, correct_costs=True).pricer.correction is not None
    assert Engine.from_model(model, None, "suffix", costs=given, adapt_costs=True).pricer.correction is not None
    assert Engine.from_model(model, None, "suffix", cache_dir=str(tmp_path)).pricer.correction is not None


@pytest.mark.parametrize("strategy", ["hybrid", "prompt_lookup"])
def test_every_priced_step_records_its_prediction_beside_its_measurement(strategy):
    model = tiny_model("llama")
    prompt = [5, 6, 7, 8, 9] * 3 + [5, 6]
    engine = Engine.from_model(model, None, strategy, costs=CostModel.from_dict(CPU.as_dict()), correct_costs=True)
    result = engine.generate(prompt, 24, ignore_eos=True)
    assert result.tokens == reference_greedy(model, prompt, 24, ignore_eos=True)
    for step in result.steps:
        assert step.predicted_s is not None and step.predicted_s > 0 and step.expected is not None
        assert 0.0 <= step.expected <= step.drafted
        assert sum(step.expected_by.values()) == pytest.approx(step.expected)
        assert step.drafted or step.expected == 0.0
        assert set(step.sources) <= set(step.expected_by)  # a drafter accepted only where it was expected
    sums = predicted.from_steps(result.steps)
    assert sums["steps"] == len(result.steps)
    assert sums["accepted"] == sum(s.accepted for s in result.steps)
    assert sums["predicted_s"] == pytest.approx(sum(s.predicted_s for s in result.steps))
    assert sums["forward_s"] == pytest.approx(sum(s.forward_s for s in result.steps))
    assert sum(sums["accepted_by"].values()) == sums["accepted"]
    assert predicted.combine([sums, sums])["expected"] == pytest.approx(2 * sums["expected"])
    row = predicted.cells("x", sums)
    assert row[1] == str(len(result.steps))


def test_an_unpriced_step_records_no_prediction():
    model = tiny_model("llama")
    result = Engine.from_model(model, None, "prompt_lookup", priced=False).generate([5, 6, 7] * 4, 12, ignore_eos=True)
    assert all(s.predicted_s is None and s.expected is None for s in result.steps)
    assert predicted.from_steps(result.steps) is None
    assert predicted.combine([None, None]) is None


@settings(max_examples=40, deadline=None)
@given(seen=st.lists(st.tuples(st.integers(1, 40), st.floats(0.2, 5.0)), max_size=12),
       asks=st.lists(st.lists(st.integers(1, 80), min_size=1, max_size=20), min_size=1, max_size=4))
def test_a_steps_price_table_gives_the_curves_own_numbers_for_every_count(seen, asks):
    """``StepPrices``: a step's curve read once, in a table grown as later trees ask for more rows."""
    correction = Correction()
    curve = Corrected(CPU, correction)
    for rows, ratio in seen:
        correction.observe(rows, curve(rows) * ratio, curve(rows))
    table = StepPrices.of(curve)
    for rows in asks:
        rows = np.array(rows)
        assert np.array_equal(table.many(rows), curve.many(rows))
        assert table(int(rows[0])) == curve(int(rows[0]))
