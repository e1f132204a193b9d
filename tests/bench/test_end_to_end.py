"""``bench`` end to end on a tiny random Llama: records, resume, a failing prompt, Ctrl-C, report, plots, compare.

Timings are recorded but never asserted.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

from specfree.bench import cli
from specfree.bench.compare import compare
from specfree.bench.runner import WARMUP_PROMPT
from specfree.bench.systems import HFSystem
from specfree.kernels import load_kernels
from specfree.settings import EngineSettings

SYSTEMS = ["autoregressive", "prompt_lookup(draft_len=4)", "hf_generate",
           "hf_prompt_lookup(prompt_lookup_num_tokens=10)"]
PNG = b"\x89PNG\r\n\x1a\n"


def config(model_dir, prompts, out, **bench):
    return OmegaConf.create({
        "model": {"name": "local", "path": str(model_dir)},
        "strategy": {"name": "prompt_lookup", "draft_len": 4},
        "verifier": {"name": "greedy"}, "device": "cpu", "dtype": "float32", "seed": 0, "compile": False,
        "bench": {"prompts": str(prompts), "format": "jsonl", "fields": {"prompt": "prompt", "turns": "turns"},
                  "max_new_tokens": 6, "baselines": ["hf_generate", "hf_prompt_lookup"], "out": str(out),
                  **bench}})


def records(out):
    return json.loads((out / "bench.json").read_text())["records"]


def quiet():
    return Console(record=True, width=200, file=open("/dev/null", "w"))


def test_bench_runs_resumes_and_records_errors(tiny_model_dir, prompts, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert cli.run(config(tiny_model_dir, prompts, out, limit=2), quiet()) == 0
    first = records(out)
    # a float model: its cost curves have no roofline (no coded call), and the report says why
    report = (out / "report.md").read_text()
    assert "## Roofline\n\nNot measured: no layer is held as a quantized file's codes" in report
    assert not (out / "roofline.png").exists()
    assert [(r["prompt_id"], r["system"]) for r in first] == [(p, s) for p in ("rep", "chat") for s in SYSTEMS]
    for r in first:
        assert r["error"] is None and r["identical"] is True  # greedy: every system says the same
        assert len(r["turns"]) == (2 if r["prompt_id"] == "chat" else 1)
        for t in r["turns"]:
            assert 1 <= len(t["tokens"]) <= 6 and t["wall_s"] > 0 and t["steps"] >= 1
            if not r["system"].startswith("hf_"):
                assert sum(t["emitted"]) == len(t["tokens"]) and set(t["split"]) >= {"forward_s", "draft_s"}
                # accepted drafted tokens by drafter: never more than the steps emitted beyond their own
                assert sum(t["accepted_by"].values()) <= len(t["tokens"]) - t["steps"]

    # Resume with one more prompt: only the new prompt runs, and it fails (too long) without stopping.
    ran = []
    original = cli.Conversation.run
    monkeypatch.setattr(cli.Conversation, "run", lambda self, system, turns, n: ran.append(turns) or
                        original(self, system, turns, n))
    assert cli.run(config(tiny_model_dir, prompts, out, limit=3, resume=True), quiet()) == 0
    assert {turns[0] for turns in ran if turns != [WARMUP_PROMPT]} == {"far too long " * 20}
    second = records(out)
    assert second[:8] == first  # finished records kept untouched
    failed = second[8:]
    assert sorted(r["system"] for r in failed) == sorted(SYSTEMS)  # who goes first rotates per prompt
    assert all("context" in r["error"] and r["turns"] == [] for r in failed)

    report = (out / "report.md").read_text()
    assert "| overall | prompt_lookup(draft_len=4) | 2 |" in report and "failed: prompt long" in report
    for name in ("speedup.png", "accepted_length.png"):
        assert (out / name).read_bytes()[:8] == PNG
    import matplotlib.image

    assert matplotlib.image.imread(out / "speedup.png").ndim == 3


def test_sigterm_keeps_records_exits_130_and_resume_finishes(tiny_model_dir, prompts, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def interrupted(self, ids, max_new_tokens):  # as if `kill` (SIGTERM) arrived mid-run
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler turns the signal into KeyboardInterrupt before this ends
        raise AssertionError("SIGTERM did not interrupt the run")

    before = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as m:
        m.setattr(cli, "warm_up", lambda *a, **k: None)
        m.setattr(HFSystem, "run", interrupted)
        console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
        assert cli.run(config(tiny_model_dir, prompts, out, limit=1, baselines=["hf_generate"]), console) == 130
    assert [r["system"] for r in records(out)] == SYSTEMS[:2]  # what finished before the signal
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored
    assert "autoregressive" in console.export_text()  # the partial table was printed
    assert cli.run(config(tiny_model_dir, prompts, out, limit=1, baselines=["hf_generate"], resume=True),
                   quiet()) == 0
    assert [r["system"] for r in records(out)] == SYSTEMS[:3]


def test_sweep_plot_and_compare(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "sweep"
    cfg = config(tiny_model_dir, prompts, out, limit=1, baselines=[], warmup=0, repeats=2,
                 strategies=[{"name": "prompt_lookup", "draft_len": 2}, "prompt_lookup"])
    assert cli.run(cfg, quiet()) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["meta"]["verification"].startswith("llama: verifies draft trees")  # what the probes chose
    assert (doc["meta"]["precision_ran"], doc["meta"]["precision_because"]) == ("exact", None)  # no layer holds codes
    assert f"drafts verified: {doc['meta']['verification']}" in (out / "report.md").read_text()
    labels = [s["label"] for s in doc["systems"]]
    assert labels == ["autoregressive", "prompt_lookup(draft_len=4)", "prompt_lookup(draft_len=2)", "prompt_lookup"]
    assert {r["repeat"] for r in doc["records"]} == {0, 1}
    assert (out / "sweep.png").read_bytes()[:8] == PNG

    decode = tmp_path / "multirun" / "0"
    decode.mkdir(parents=True)
    (decode / "result.json").write_text(json.dumps({
        "kind": "decode", "model": "m", "strategy": {"name": "autoregressive"}, "tokens": [1, 2], "config": {},
        "overrides": [], "summary": {"tokens_per_s": 10.0, "mean_accepted": 1.0, "new_tokens": 2}}))
    console = Console(record=True, width=250, file=open("/dev/null", "w"))  # noqa: SIM115
    assert compare([str(out), str(tmp_path / "multirun")], out=str(tmp_path / "cmp"), console=console) == 0
    text = console.export_text()
    assert "prompt_lookup(draft_len=2)" in text and "decode runs" in text
    assert (tmp_path / "cmp" / "compare.md").is_file() and (tmp_path / "cmp" / "sweep.png").is_file()


def test_seeded_sampling_is_compared_with_specfrees_own_sampling_loop(tiny_model_dir, prompts, tmp_path):
    """verifier=sampling: every system samples with the run's seed, and each output must equal the
    eager sampling loop's, token for token (lossless sampling), not greedy decoding's."""
    greedy_out, sampled_out = tmp_path / "greedy", tmp_path / "sampled"
    assert cli.run(config(tiny_model_dir, prompts, greedy_out, limit=2, baselines=[]), quiet()) == 0
    sampling = config(tiny_model_dir, prompts, sampled_out, limit=2, baselines=[])
    sampling.verifier = {"name": "sampling", "temperature": 5.0}
    assert cli.run(sampling, quiet()) == 0
    sampled = records(sampled_out)
    assert sorted({r["system"] for r in sampled}) == ["autoregressive", "prompt_lookup(draft_len=4)"]
    assert all(r["error"] is None and r["identical"] is True for r in sampled)

    def tokens(rs):
        return [t["tokens"] for r in rs if r["system"] == "autoregressive" for t in r["turns"]]

    assert tokens(sampled) != tokens(records(greedy_out))  # it sampled: near-uniform at temperature 5
    assert "new tokens · sampling (temperature=5.0), seed 0" in (sampled_out / "report.md").read_text()
    assert "sampling" not in (greedy_out / "report.md").read_text().splitlines()[0]


def test_bad_bench_configs_are_config_errors(tmp_path):
    from specfree.errors import ConfigError

    model = {"name": "smollm2", "path": None}
    with pytest.raises(ConfigError, match="bench.prompts is not set"):
        cli.BenchSettings.from_config({"model": model, "bench": {"prompts": None, "out": str(tmp_path)}})
    with pytest.raises(ConfigError, match="needs a bench config"):
        cli.BenchSettings.from_config({"model": model})
    with pytest.raises(ConfigError, match=r"verifier=sampling with temperature: set 'bench.baselines=\[\]'"):
        cli.BenchSettings.from_config({"model": model, "verifier": {"name": "sampling", "temperature": 0.7},
                                       "bench": {"prompts": "p.jsonl", "out": str(tmp_path),
                                                 "baselines": ["hf_generate"]}})
    with pytest.raises(ConfigError, match="verifier=greedy or verifier=sampling, not 'mine'"):
        cli.BenchSettings.from_config({"model": model, "verifier": {"name": "mine"},
                                       "bench": {"prompts": "p.jsonl", "out": str(tmp_path), "baselines": []}})
    with pytest.raises(ConfigError, match="verifier.logits_processors cannot be set in a bench run"):
        cli.BenchSettings.from_config({"model": model, "verifier": {"name": "sampling", "logits_processors": [1]},
                                       "bench": {"prompts": "p.jsonl", "out": str(tmp_path), "baselines": []}})
    sampled = cli.BenchSettings.from_config({"model": model, "verifier": {"name": "sampling", "top_k": 5},
                                             "bench": {"prompts": "p.jsonl", "out": str(tmp_path), "baselines": []}})
    assert sampled.decoding == {"do_sample": True, "top_k": 5}
    greedy = cli.BenchSettings.from_config({"model": model, "verifier": {"name": "greedy"},
                                            "bench": {"prompts": "p.jsonl", "out": str(tmp_path)}})
    assert greedy.decoding == {} and greedy.meta()["decoding"] == "greedy"
    with pytest.raises(ConfigError, match="bench.strategies: each entry must be a name"):
        cli.BenchSettings.from_config({"model": model, "bench": {"prompts": "p.jsonl", "out": str(tmp_path),
                                                                 "strategies": [3]}})
    # the schema's types, then the ranges it cannot express, each one line naming the field
    with pytest.raises(ConfigError, match=r"^bench.limit: expected int or null, got 'ten'$"):
        cli.BenchSettings.from_config({"model": model, "bench": {"prompts": "p.jsonl", "limit": "ten"}})
    with pytest.raises(ConfigError, match=r"^bench.repeats must be >= 1, got 0$"):
        cli.BenchSettings.from_config({"model": model, "bench": {"prompts": "p.jsonl", "out": "o", "repeats": 0}})
    with pytest.raises(ConfigError, match=r"^model.path is required"):
        cli.BenchSettings.from_config({"model": {"name": "smollm2"}, "bench": {"prompts": "p.jsonl"}})
    settings = cli.BenchSettings.from_config({"model": model, "strategy": {"name": "trie"},
                                              "pool": {"name": "lru", "capacity": 10},
                                              "bench": {"prompts": "p.jsonl", "out": str(tmp_path)}})
    assert settings.strategies[0].knobs == {"pool": {"name": "lru", "capacity": 10}}
    assert settings.prompts == Path.cwd().resolve() / "p.jsonl" and settings.bench.max_new_tokens == 128  # the schema's


def test_transformers_baselines_run_as_shipped_on_the_shared_model():
    from specfree.adapters.attention import TREE_ATTENTION
    from specfree.adapters.hf import HFAdapter
    from specfree.adapters.norms import FusedRMSNorm
    from specfree.kernels import PanelLinear, load_kernels
    from tests.tiny_models import EOS, tiny_model

    model = tiny_model("llama")
    HFAdapter(model)  # a specfree engine over the shared model switches it to its CPU kernels
    assert model.config._attn_implementation == TREE_ATTENTION
    assert isinstance(model.lm_head, PanelLinear) == (load_kernels() is not None)
    norm = model.model.norm.original  # transformers' own
    seen = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda *_: seen.append((model.config._attn_implementation, type(model.lm_head), type(model.model.norm))))
    try:
        system = HFSystem.build(model, "hf_prompt_lookup", [EOS], max_length=512)
        system.run([5, 6, 7, 5, 6, 7, 5, 6], 6)
    finally:
        handle.remove()
    assert seen and set(seen) == {("sdpa", torch.nn.Linear, type(norm))}
    assert model.config._attn_implementation == TREE_ATTENTION  # the engines get theirs back
    assert isinstance(model.lm_head, PanelLinear) == (load_kernels() is not None)
    assert isinstance(model.model.norm, FusedRMSNorm)


def test_bench_compiled_rows(tiny_model_dir, prompts, tmp_path):
    """compile=true: the compiled autoregressive loop and transformers' static-cache compiled
    generate() run beside the eager baseline; every output is the baseline's; compile time is
    reported apart."""
    out = tmp_path / "out"
    cfg = config(tiny_model_dir, prompts, out, limit=1, baselines=["hf_static_compiled"])
    cfg.compile = True
    cfg.cache_dir = str(tmp_path / "cache")  # where the compile is noted: not the user's own cache
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    assert cli.run(cfg, console) == 0
    found = records(out)
    assert [r["system"] for r in found] == ["autoregressive", "autoregressive (compiled)",
                                            "prompt_lookup(draft_len=4)", "hf_static_compiled"]
    assert all(r["error"] is None and r["identical"] is True for r in found)
    meta = json.loads((out / "bench.json").read_text())["meta"]
    assert meta["compile"] == "true" and meta["compile_s"] > 0
    report = (out / "report.md").read_text()
    assert "compiled forward (strategies and 'autoregressive (compiled)'): one AOTInductor package" in report
    assert "CPU: " in report and meta["cpu"]
    # the cost curves: the linear layers alone (torch's kernels and specfree's) and the forward, each path
    assert "blas" in meta["linear_curves_ms"] and len(meta["linear_curves_ms"]["blas"]) == 5
    isa = load_kernels(progress=False)
    if isa:  # the engine's path also called from C++, as the compiled forward calls it
        assert all(ms > 0 for ms in meta["linear_curves_ms"][f"few_row-panels-{isa} from C++"].values())
    assert any(name.startswith("compiled") for name in meta["forward_curves_ms"])
    assert "linear layers alone, ms per pass (1, 2, 4, 8, 16 rows): blas " in report
    # what pricing read: the engine's first curve is the quick one (1 and 2 rows at least; the rest
    # is learned from its steps), measured when it was built
    assert "pricing curve of prompt_lookup(draft_len=4), ms (1, 2" in report
    # the strategy ran compiled, so its per-method speedup divides by the compiled loop's tokens/s
    doc = json.loads((out / "bench.json").read_text())
    assert [s["path"] for s in doc["systems"]] == ["eager", "compiled", "compiled", "transformers"]
    assert "| prompt_lookup(draft_len=4) | compiled | Saxena 2023 (prompt lookup decoding) |" in report
    assert (out / "cost_curves.png").stat().st_size > 0


def test_the_compiled_rows_run_the_configured_linear_kernel(monkeypatch):
    """model.linear_kernel (and precision) reach the compiled adapter too (linear_kernel once reached
    only the eager engines, so a few_row_fp32 run compiled coded weights)."""
    from types import SimpleNamespace

    asked = {}
    monkeypatch.setattr(cli, "build_adapter", lambda model, reg, settings, **knobs: asked.update(
        vars(settings), **knobs) or SimpleNamespace(compiled=False))
    engine = EngineSettings(compile="auto", precision="int8", linear_kernel="few_row_fp32")
    assert cli.compiled_adapter(torch.nn.Linear(2, 2), SimpleNamespace(engine=engine), slots=64) is None
    assert asked["linear_kernel"] == "few_row_fp32" and asked["compile"] == "true" and asked["precision"] == "int8"
    assert asked["slots"] == 64


def test_bench_concurrency_decodes_the_prompts_together_and_one_after_another(tiny_model_dir, prompts, tmp_path):
    """``bench.concurrency=2``: per eager specfree system a row of both sides, outputs identical,
    stored in bench.json's meta and shown in the report."""
    out = tmp_path / "out"
    assert cli.run(config(tiny_model_dir, prompts, out, limit=2, concurrency=2, baselines=[]), quiet()) == 0
    rows = json.loads((out / "bench.json").read_text())["meta"]["concurrency"]
    assert [r["system"] for r in rows] == ["autoregressive", "prompt_lookup(draft_len=4)"]
    for row in rows:
        assert row["batched_together"] and row["identical"] == row["requests"] == 2
        assert row["sequential"]["tokens"] == row["batched"]["tokens"] == 2 * 6  # EOS ignored: every token asked
    assert "## 2 requests, 2 at a time (bench.concurrency)" in (out / "report.md").read_text()
