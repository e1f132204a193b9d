"""Per-method rows: the speedup over the same path's autoregressive loop, paper numbers beside
them, in report.md, the console and a plot; and a multi-turn code-edit file run as a sequence of
requests whose drafter state carries from one prompt to the next."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from specfree.bench import cli
from specfree.bench.methods import method_rows, system_paths
from specfree.bench.papers import PAPERS, paper_for
from specfree.bench.prompts import SHIPPED

PNG = b"\x89PNG\r\n\x1a\n"


def record(prompt, system, tokens, wall, steps=None, rows=None, offered=None, category="edit"):
    turn = {"tokens": list(range(tokens)), "wall_s": wall, "steps": steps, "rows": rows, "offered": offered}
    return {"prompt_id": prompt, "category": category, "system": system, "repeat": 0, "turns": [turn],
            "error": None}


def test_speedup_is_over_the_same_paths_autoregressive_loop():
    meta = [{"label": "autoregressive", "kind": "specfree", "strategy": "autoregressive", "path": "eager"},
            {"label": "autoregressive (compiled)", "kind": "specfree", "strategy": "autoregressive",
             "path": "compiled"},
            {"label": "trie", "kind": "specfree", "strategy": "trie", "path": "compiled"},
            {"label": "mine", "kind": "specfree", "strategy": "mine", "path": "eager"},
            {"label": "hf_generate", "kind": "transformers", "strategy": "hf_generate", "path": "transformers"}]
    records = [record("1", "autoregressive", 12, 4.0), record("1", "autoregressive (compiled)", 12, 2.0),
               record("1", "trie", 12, 0.5, steps=4, rows=16, offered=40), record("1", "mine", 12, 3.0, steps=6),
               record("1", "hf_generate", 12, 4.0)]
    rows = {(r.category, r.system): r for r in method_rows(records, meta)}
    assert {s for _, s in rows} == {"trie", "mine"}  # strategies only: not the loops, not transformers
    trie = rows[("overall", "trie")]
    assert trie.baseline == "autoregressive (compiled)" and trie.speedup == pytest.approx(4.0)  # not 8x (eager)
    assert trie.accepted == pytest.approx(3.0) and trie.rows_per_step == pytest.approx((4.0, 10.0))
    assert trie.paper is PAPERS["trie"] and rows[("edit", "trie")].speedup == pytest.approx(4.0)
    mine = rows[("overall", "mine")]
    assert mine.baseline == "autoregressive" and mine.speedup == pytest.approx(4 / 3) and mine.paper is None
    assert mine.rows_per_step is None  # its turns recorded no rows
    # a file from before systems noted their path: a compiled loop in the run means compiled strategies
    old = [{k: v for k, v in m.items() if k != "path"} for m in meta]
    assert system_paths(old) == {**{m["label"]: m["path"] for m in meta}, "mine": "compiled"}
    without_compiled = [m for m in old if m["label"] != "autoregressive (compiled)"]
    assert system_paths(without_compiled)["trie"] == "eager"


def test_paper_table_entries_name_their_source():
    for strategy in ("lookahead", "trie", "prompt_lookup", "retrieval", "recycling", "suffix", "sam", "logit_spec"):
        paper = paper_for(strategy)
        assert paper is not None and paper.source and paper.paper
        assert paper.speedup is None or paper.speedup > 1.0
    assert paper_for("hybrid") is None
    assert PAPERS["prompt_lookup"].speedup_text() == "2.00–4.00x"
    assert PAPERS["lookahead"].speedup_text() == "up to 1.80x"


def code_edit_rows(count):
    """The shortest multi-turn code-edit conversations of the shipped set."""
    rows = [json.loads(line) for line in SHIPPED["code_edits_multi_turn"].read_text().splitlines()]
    return sorted(rows, key=lambda r: len(r["turns"][0]))[:count]


def test_multi_turn_code_edits_run_as_a_sequence_and_report_per_method(long_tiny_model_dir, write_jsonl, tmp_path):
    prompts = write_jsonl(tmp_path / "edits.jsonl", code_edit_rows(2))
    out = tmp_path / "out"
    cfg = OmegaConf.create({
        "model": {"name": "local", "path": str(long_tiny_model_dir)},
        "strategy": {"name": "trie", "persist": True},
        "verifier": {"name": "greedy"}, "device": "cpu", "dtype": "float32", "seed": 0, "compile": False,
        "bench": {"prompts": str(prompts), "format": "jsonl", "fields": {"turns": "turns"}, "max_new_tokens": 8,
                  "baselines": [], "strategies": ["prompt_lookup"], "warmup": 0, "cost_curves": False,
                  "out": str(out)}})
    console = Console(record=True, width=250, file=open("/dev/null", "w"))  # noqa: SIM115
    assert cli.run(cfg, console) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert [s["path"] for s in doc["systems"]] == ["eager", "eager", "eager"]
    for r in doc["records"]:
        assert r["error"] is None and r["identical"] is True
        assert len(r["turns"]) == r["category"].count("+") + 1  # every turn ran, each on the last answer
    report = (out / "report.md").read_text()
    assert "## Per method: measured here, and what its paper reports" in report
    assert ("| system | path | paper | paper's model, hardware, benchmark | accepted/step | paper: accepted/step | "
            "speedup vs same path's autoregressive | paper: speedup | rows/step kept/offered |") in report
    assert "| trie | eager | Zhao et al., KDD 2024 (PIA Lookahead, trie) |" in report
    assert "| prompt_lookup | eager | Saxena 2023 (prompt lookup decoding) |" in report
    assert "arXiv 2312.12728v3, abstract" in report  # where the paper's number was read
    text = console.export_text()
    assert "Per method, beside its paper's own numbers" in text and "2.66–6.26x" in text
    assert (out / "paper_vs_measured.png").read_bytes()[:8] == PNG


def test_the_runner_keeps_each_engines_drafter_state_across_prompts(long_tiny_model_dir, tmp_path):
    """Prompts run in order on one engine per system: a persistent trie still holds the first
    prompt's answer after the second prompt; a non-persistent one has dropped it."""
    from specfree.loading import load_model
    from specfree.bench.runner import Conversation, SystemSpec, build_systems, run_records
    from specfree.bench.prompts import PromptItem
    from specfree.bench.store import RecordStore

    model, tokenizer = load_model(str(long_tiny_model_dir))
    systems = build_systems(model, tokenizer, [SystemSpec("trie", {"persist": True, "priced": False}),
                                               SystemSpec("trie", {"persist": False, "priced": False})], [], seed=0)
    conversation = Conversation(systems[0].engine.encode, lambda ids: tokenizer.decode(ids), chat=True)
    store = RecordStore(tmp_path, {})
    items = [PromptItem("1", "a", ["def f(x):\n    return x + 1"]), PromptItem("2", "a", ["zzz"])]
    run_records(items, systems, conversation, store, max_new_tokens=8)
    answer = tuple(store.find("1", systems[1].label, 0)["turns"][0]["tokens"][:3])
    second = store.find("2", systems[1].label, 0)["turns"][0]["tokens"]
    assert answer not in {tuple(second[i:i + 3]) for i in range(len(second))}  # prompt 2 did not make it again
    kept = systems[1].engine.strategy.pool.to_dict()
    dropped = systems[2].engine.strategy.pool.to_dict()
    assert systems[1].label == "trie(priced=False)" and systems[2].label == "trie(persist=False,priced=False)"
    assert kept.get(answer, (0, 0))[1] > 0  # prompt 1's answer, counted as output, survived prompt 2
    assert dropped.get(answer, (0, 0))[1] == 0
