"""bench's llama.cpp rows: skipped with one line (or refused, when asked for) without llama-cpp-python
or without a GGUF; prompt processing and decoding reported apart; on the real SmolLM2 GGUF where
llama-cpp-python is installed."""

from __future__ import annotations

import json
import sys

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from specfree.bench import cli
from specfree.bench import llama_cpp as llama_rows
from specfree.bench.metrics import prompt_and_decode
from specfree.bench.runner import SystemSpec
from specfree.conf.schema import DEFAULT_BASELINES
from specfree.errors import ConfigError

INSTALL = 'pip install "specfree[llama-cpp]"'


def specs(*names):
    return [SystemSpec(name, {}) for name in names]


@pytest.fixture
def without_llama_cpp(monkeypatch):
    """``import llama_cpp`` fails, as where the extra is not installed."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


def bench_config(model, prompts, out, **bench):
    return OmegaConf.create({
        "model": {"name": "local", "path": str(model)}, "strategy": {"name": "prompt_lookup", "draft_len": 4},
        "verifier": {"name": "greedy"}, "device": "cpu", "dtype": "float32", "seed": 0, "compile": False,
        "bench": {"prompts": str(prompts), "format": "jsonl", "fields": {"prompt": "prompt", "turns": "turns"},
                  "max_new_tokens": 6, "out": str(out), "limit": 1, "warmup": 0, "cost_curves": False, **bench}})


def quiet():
    return Console(record=True, width=200, file=open("/dev/null", "w"))


def test_without_llama_cpp_the_default_rows_are_skipped_with_the_install_line(without_llama_cpp):
    rows, line = llama_rows.select(specs(*DEFAULT_BASELINES), "/models/m.gguf")
    assert rows == [] and line.startswith("llama.cpp rows (llama_cpp, llama_cpp_lookup) skipped") and INSTALL in line
    assert llama_rows.select(specs("hf_generate"), "/models/m.gguf") == ([], None)  # none asked for: no line


def test_without_llama_cpp_rows_asked_for_are_one_config_error(without_llama_cpp):
    with pytest.raises(ConfigError, match=r"bench.baselines asks for llama_cpp_lookup, which need "
                                          r"llama-cpp-python: pip install \"specfree\[llama-cpp\]\""):
        llama_rows.select(specs("hf_generate", "llama_cpp_lookup"), "/models/m.gguf")


def test_llama_cpp_knobs_are_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="llama_cpp_lookup takes no draft_len; its knobs: num_pred_tokens, "
                                          "max_ngram_size"):
        llama_rows.select([SystemSpec("llama_cpp_lookup", {"draft_len": 4})], "/models/m.gguf")
    with pytest.raises(ConfigError, match="llama_cpp_lookup.num_pred_tokens must be >= 1, got 0"):
        llama_rows.select([SystemSpec("llama_cpp_lookup", {"num_pred_tokens": 0})], "/models/m.gguf")
    assert llama_rows.label("llama_cpp_lookup", {"num_pred_tokens": 4, "max_ngram_size": 2}, "F32") == \
        "llama_cpp_lookup(num_pred_tokens=4)[F32]"


def test_a_model_from_a_folder_has_no_gguf_for_llama_cpp(tmp_path):
    for asked in (DEFAULT_BASELINES, ("llama_cpp",)):
        rows, line = llama_rows.select(specs(*asked), str(tmp_path))
        assert rows == [] and f"{tmp_path} is not a GGUF file" in line and "model.path=FILE.gguf" in line


def test_bench_refuses_rows_it_cannot_run_before_loading_the_model(without_llama_cpp, prompts, tmp_path):
    cfg = bench_config(tmp_path / "missing.gguf", prompts, tmp_path / "out", baselines=["llama_cpp"])
    with pytest.raises(ConfigError, match=r"specfree\[llama-cpp\]"):  # not "GGUF file not found"
        cli.run(cfg, quiet())


def test_bench_without_a_gguf_says_so_once_and_times_prompt_and_decode_apart(tiny_model_dir, prompts, tmp_path,
                                                                              capsys):
    out = tmp_path / "out"
    assert cli.run(bench_config(tiny_model_dir, prompts, out, baselines=["hf_generate", "hf_prompt_lookup",
                                                                         "llama_cpp"]), quiet()) == 0
    said = capsys.readouterr().err
    assert said.count("llama.cpp rows (llama_cpp) skipped") == 1 and "is not a GGUF file" in said
    doc = json.loads((out / "bench.json").read_text())
    assert [s["label"] for s in doc["systems"]] == ["autoregressive", "prompt_lookup(draft_len=4)", "hf_generate",
                                                    "hf_prompt_lookup(prompt_lookup_num_tokens=10)"]
    for record in doc["records"]:
        for turn in record["turns"]:
            assert 0 < turn["prefill_s"] <= turn["wall_s"]
            # transformers makes its first tokens in the prefill; specfree's prefill makes none
            made = turn["prefill_emitted"]
            assert made >= 1 if record["system"].startswith("hf_") else made == 0
            assert made <= len(turn["tokens"])
    report = (out / "report.md").read_text()
    assert "| prompt tok/s | decode tok/s |" in report and "llama.cpp rows (llama_cpp) skipped" in report
    overall = [line.split(" | ") for line in report.splitlines() if line.startswith("| overall |")]
    assert len(overall) == 4 and all(cells[6] != "–" and cells[7] != "–" for cells in overall)


def test_prompt_and_decode_rates_count_what_each_phase_made():
    turns = [{"tokens": [1] * 10, "wall_s": 3.0, "prompt_tokens": 40, "prefill_s": 1.0, "prefill_emitted": 0},
             {"tokens": [1] * 5, "wall_s": 2.0, "prompt_tokens": 20, "prefill_s": 1.0, "prefill_emitted": 1}]
    assert prompt_and_decode(turns) == (pytest.approx(60 / 2.0), pytest.approx(14 / 3.0))
    assert prompt_and_decode([*turns, {"tokens": [1], "wall_s": 1.0, "prompt_tokens": 3, "prefill_s": None}]) == \
        (None, None)


@pytest.mark.model
def test_llama_cpp_rows_on_the_smollm2_gguf_and_its_f32_copy(tmp_path, write_jsonl, capsys):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install \"specfree[llama-cpp]\")")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Count: one, two, three, four,"}])
    out = tmp_path / "out"
    cfg = bench_config("x", prompts, out, baselines=["llama_cpp", "llama_cpp_lookup"], max_new_tokens=8)
    cfg.model, cfg.strategy, cfg.threads = "smollm2", "autoregressive", 1  # one thread: quick on a busy CI machine
    assert cli.run(cfg, quiet()) == 0
    doc = json.loads((out / "bench.json").read_text())
    said = capsys.readouterr().err
    labels = ["llama_cpp[F32]", "llama_cpp[Q4_1]", "llama_cpp_lookup[F32]", "llama_cpp_lookup[Q4_1]"]
    if "llama_cpp[Q4_1], llama_cpp_lookup[Q4_1] skipped: llama.cpp crashed" in said:
        labels = labels[::2]  # this machine's llama.cpp cannot run the Q4_1 file (an AMX Xeon): one line says so
    assert [s["label"] for s in doc["systems"]] == ["autoregressive", *labels]
    f32 = next(s for s in doc["systems"] if s["label"] == "llama_cpp[F32]")["params"]["gguf"]
    assert llama_rows.gguf_precision(llama_rows.Path(f32)) == "F32"
    for record in (r for r in doc["records"] if r["system"] in labels):
        assert record["error"] is None and record["identical"] in (True, False)
        turn, = record["turns"]
        assert 1 <= len(turn["tokens"]) <= 8 and turn["stop_reason"] in ("eos", "max_new_tokens")
        assert 0 < turn["prefill_s"] < turn["wall_s"] and sum(turn["emitted"]) == len(turn["tokens"])
    report = (out / "report.md").read_text()
    assert "llama.cpp rows: llama-cpp-python 0.3." in report and "(F32, " in report  # each file's type and size
    assert ("(Q4_1, " in report) == (len(labels) == 4) and ("skipped" in said) == (len(labels) == 2)


@pytest.mark.parametrize("probe, said", [
    ("pass", None),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crashed (SIGSEGV)"),
    ("raise SystemExit('error: no such tensor')", "failed (error: no such tensor)"),
])
def test_a_gguf_llama_cpp_cannot_run_is_found_in_a_child_process(tmp_path, probe, said):
    assert llama_rows.crash(tmp_path / "m.gguf", llama_rows.llama_params(256, 1), probe=probe) == said
