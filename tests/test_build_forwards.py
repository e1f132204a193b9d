"""What a new user's first request costs, counted in forwards (not seconds, so it holds on any machine):
over a tiny model of every family the engine verifies, building the engine (probes and a first, quick
cost curve, measured fresh) and one short request stay under a fixed number of model forwards. The
whole curve (10 row counts, 6 rounds, two contexts) took 124 forwards on its own; a build that starts
measuring that much again fails here by count."""

from __future__ import annotations


import pytest

from specfree import Engine
from specfree.cost import BUDGET, QUICK_SIZES
from tests.tiny_models import CHAIN_FAMILIES, FAMILIES, RECURRENT_FAMILIES, tiny_model

PROMPT = [5, 6, 7, 8, 9] * 3 + [10, 11, 5, 6, 7]
NEW_TOKENS = 8
# The most a quick curve can run: a prefix, the one-row forward three times, two of each other size;
# the same again (three rounds) at a second context where the first took under a third of its budget.
CURVE = (1 + 3 + 2 * (len(QUICK_SIZES) - 1)) + (1 + 3 * len(QUICK_SIZES))
PROBES = 20  # the wrap-time probes (a chain family that also fails the tree probe runs the most: 16)
REQUEST = 2 * NEW_TOKENS + 1  # the prompt, one forward a step, and one replay after a cut chain
MOST = PROBES + CURVE + REQUEST


@pytest.fixture(autouse=True)
def quiet(quiet_families):
    yield


def test_the_bound_is_far_below_the_whole_curve():
    assert BUDGET <= 16 and MOST < 124


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", FAMILIES + RECURRENT_FAMILIES + CHAIN_FAMILIES)
def test_building_an_engine_and_one_request_stay_under_a_bound_in_forwards(family, tmp_path, monkeypatch):
    monkeypatch.setattr("specfree.engine.DEFAULT_CACHE", tmp_path)  # the curve measured fresh, kernels reused
    model = tiny_model.__wrapped__(family)  # fresh: no engine has prepared it yet
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    engine = Engine.from_model(model, None, "prompt_lookup")
    assert list((tmp_path / "costs").iterdir())  # a curve was measured, not read
    built = len(forwards)
    engine.generate(PROMPT, NEW_TOKENS, ignore_eos=True)
    assert built + 1 <= len(forwards) <= MOST, f"{built} forwards to build, {len(forwards) - built} for the request"
