"""Strategies replayed on a bench run's outputs: token-only drafters unpriced step for step as the
run ran them; the flattened curve; bad input in one line each."""

from __future__ import annotations

import json

import pytest

from specfree.bench import ceiling, cli, replay
from specfree.cli import main
from specfree.errors import ConfigError
from specfree.plugins import build_plugin_manager, registry
from tests.bench.test_end_to_end import config, quiet

STRATEGIES = [{"name": "prompt_lookup", "priced": False, "draft_len": 4},
              {"name": "suffix", "priced": False}]


@pytest.fixture(scope="module")
def run(long_tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("replay")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        {"id": "rep", "category": "code", "prompt": "abc abc abc abc abc"},
        {"id": "chat", "category": "chat", "turns": ["hello there", "and again"]}]) + "\n")
    out = folder / "out"
    assert cli.run(config(long_tiny_model_dir, prompts, out, baselines=[], warmup=0, max_new_tokens=24,
                          strategies=STRATEGIES), quiet()) == 0
    return out


def test_token_only_drafters_unpriced_replay_the_run_step_for_step(run):
    data = json.loads((run / "bench.json").read_text())
    contexts, cost, _ = ceiling._conversation_and_cost(data["meta"])
    turns = replay.record_sequences(data["records"], contexts)  # no logits: these drafters read tokens only
    from specfree.loading import load_model

    model, _ = load_model(data["meta"]["model"])
    systems = [s["label"] for s in data["systems"] if s["knobs"].get("priced") is False]
    assert len(systems) == 2
    drafted = 0
    for label, strategy, priced in replay._strategies(systems, data["systems"], registry(build_plugin_manager())):
        assert not priced
        done = replay.replay(strategy, turns, model.config.vocab_size, model.config.max_position_embeddings, cost,
                             None, 24, price_context=False)
        recorded = [t["emitted"] for r in data["records"] if r["system"] == label for t in r["turns"]]
        assert done.per_step == recorded, label
        assert done.drafting_s > 0  # the strategy's own calls, timed
        drafted += done.tokens - done.steps
    assert drafted > 0  # some drafts were accepted: the comparison is not of one-token steps alone


def test_the_flattened_curve_keeps_one_row_and_sets_eight():
    flat = replay.flattened(lambda rows: 0.02 * rows, 1.15)
    assert flat(1) == pytest.approx(0.02) and flat(8) == pytest.approx(0.023)
    assert flat(16) > flat(8)  # linear beyond 8 rows too


def test_replay_prints_a_table_and_writes_it(run):
    from rich.console import Console

    console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    assert replay.main([str(run), "--flat", "1.1"], console) == 0
    text = console.export_text()
    assert "tok/step" in text and "suffix(priced=False)" in text
    written = (run / "replay_flat_1.1.md").read_text()
    assert "| suffix(priced=False) |" in written and "8 rows 1.1x one row" in written
    assert "drafting ms/step" in written


def test_bad_replays_are_one_clear_error(run, tmp_path, capsys):
    assert main(["replay", str(tmp_path)]) == 2
    assert "pass a bench output folder" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="lookahead cannot be replayed"):
        replay.main([str(run), "lookahead"])
    with pytest.raises(ConfigError, match="--flat takes a number"):
        replay.main([str(run), "--flat", "steep"])
    with pytest.raises(ConfigError, match="cheaper than one"):
        replay.main([str(run), "--flat", "0.5"])


def test_a_bench_records_the_curve_each_engine_priced_on_and_replay_prices_on_it(run):
    from rich.console import Console

    data = json.loads((run / "bench.json").read_text())
    curves = data["meta"]["pricing_curves"]
    priced = [s["label"] for s in data["systems"]
              if s["strategy"] != "autoregressive" and s["knobs"].get("priced", True)]
    unpriced = [s["label"] for s in data["systems"] if s["knobs"].get("priced") is False]
    assert priced and set(priced) <= set(curves) and not set(unpriced) & set(curves)
    assert all(len(c["rows"]) == len(c["seconds"]) > 1 for c in curves.values())
    console = Console(record=True, width=250, file=open("/dev/null", "w"))  # noqa: SIM115
    assert replay.main([str(run), *priced], console) == 0
    assert "its engine's curve, each step's context" in console.export_text()


def other_run(run, folder, curves):
    """A copy of ``run``'s bench.json in ``folder`` whose recorded forward curves are ``curves``."""
    data = json.loads((run / "bench.json").read_text())
    data["meta"]["forward_curves_ms"] = curves
    folder.mkdir()
    (folder / "bench.json").write_text(json.dumps(data))
    return folder


def test_replay_prices_the_same_drafts_on_another_runs_curve(run, tmp_path):
    """On a curve where any number of rows costs one row, the modelled speedup is the tokens a step."""
    from rich.console import Console

    rows = ["1", "2", "4", "8", "16", "32"]
    flat = other_run(run, tmp_path / "flat", {"eager, few_row-coded-avx2": dict.fromkeys(rows, 10.0)})
    console = Console(record=True, width=250, file=open("/dev/null", "w"))  # noqa: SIM115
    assert replay.main([str(run), "--curve", str(flat)], console) == 0
    written = (run / "replay_curve.md").read_text()
    assert "'s eager, few_row-coded-avx2 curve (--curve)" in written
    lines = [line.split("|") for line in written.splitlines() if line.startswith("| ") and "x |" in line]
    assert len(lines) == 3  # the run's three strategies
    for cells in lines:
        assert cells[5].strip() == cells[2].strip() + "x"  # speedup on the flat curve == tokens per step
    with pytest.raises(ConfigError, match=r"--curve .* recorded no forward curve: run its bench with bench.cost_curves"):
        replay.main([str(run), "--curve", str(other_run(run, tmp_path / "none", {}))])
    with pytest.raises(ConfigError, match="--curve takes another bench run's bench.json or folder"):
        replay.main([str(run), "--curve"])
