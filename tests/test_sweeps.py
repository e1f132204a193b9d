"""Sweeps beyond one process: a multirun through Hydra's joblib launcher (parallel workers, each
on its own share of the cores), then ``compare`` over the sweep folder."""

from __future__ import annotations

import io
import json
import os
import re

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from specfree import cli
from specfree.sweeps import CoreShares, available_cpus, parallel_workers
from tests.helpers import run_cli

PINS = hasattr(os, "sched_setaffinity")


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Hydra writes run folders under the working directory: keep them out of the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("launcher, jobs, cores, workers", [
    (None, 4, 8, 1),                                # not under Hydra
    ({"_target_": "BasicLauncher"}, 4, 8, 1),       # one job after another
    ({"n_jobs": 2}, 4, 8, 2),
    ({"n_jobs": 2}, 1, 8, 1),                       # a one-job sweep has the machine to itself
    ({"n_jobs": -1}, 3, 8, 3),                      # -1: one worker per core, but only 3 jobs
    ({"n_jobs": -1}, 20, 8, 8),
    ({"n_jobs": -2}, 20, 8, 7),                     # joblib's count back from the cores
])
def test_parallel_workers_is_what_runs_at_once(launcher, jobs, cores, workers):
    assert parallel_workers(launcher, jobs, cores) == workers


@pytest.fixture
def under_joblib(monkeypatch):
    """This process looks like a job of a joblib sweep with n_jobs=2."""
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.setattr(HydraConfig.instance(), "cfg", OmegaConf.create({"hydra": {"launcher": {"n_jobs": 2}}}))


def test_jobs_running_at_once_get_disjoint_shares_and_an_explicit_threads_wins(under_joblib):
    cpus = available_cpus()
    size = max(1, len(cpus) // 2)
    first, second, explicit = (OmegaConf.create({"threads": t}) for t in (None, None, 3))
    with CoreShares(jobs=2) as shares:
        with shares.claim(first):
            held = available_cpus()
            with shares.claim(second):  # a second job while the first still runs (here: in one process)
                other = available_cpus()
        assert available_cpus() == cpus  # the worker is unpinned for its next job
        with shares.claim(explicit):
            assert available_cpus() == cpus  # threads=3 from the user: left alone
    assert first.threads == second.threads == size and explicit.threads == 3
    if PINS:
        assert held == cpus[:size] and len(other) == size and set(other) <= set(cpus)
        if len(cpus) >= 2:
            assert not set(held) & set(other)


def test_multirun_over_joblib_workers_then_compare(tiny_llama_dir, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep = tmp_path / "sweep"
    done = run_cli("decode", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                   "strategy=autoregressive,prompt_lookup", "model=local", f"model.path={tiny_llama_dir}",
                   "prompt=the cat , the dog : the cat ( and ) the dog", "max_new_tokens=8",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "Joblib.Parallel(n_jobs=2" in done.stderr  # the launcher really was joblib
    results = [json.loads((sweep / job / "result.json").read_text()) for job in ("0", "1")]
    assert [r["strategy"]["name"] for r in results] == ["autoregressive", "prompt_lookup"]
    assert results[0]["tokens"] == results[1]["tokens"] and len(results[0]["tokens"]) == 8  # lossless
    share = max(1, len(available_cpus()) // 2)
    for r in results:
        assert r["threads"] == r["config"]["threads"] == share  # each worker ran on its share of threads
        assert set(r["cpus"]) <= set(available_cpus()) and (len(r["cpus"]) == share or not PINS)
        assert not [o for o in r["overrides"] if o.startswith("hydra")]  # launcher settings are Hydra's only

    console = Console(file=io.StringIO(), width=200, record=True)
    assert cli.compare([str(sweep)], console=console) == 0
    rows = [line for line in console.export_text().splitlines() if re.match(r"│ [01] ", line)]
    assert len(rows) == 2 and all(re.search(r"│ yes +│$", row) for row in rows)
    assert "autoregressive" in rows[0] and "prompt_lookup" in rows[1]


@pytest.mark.parametrize("args, message", [
    (["decode", "-m", "hydra/launcher=nope", "prompt=hi"],
     "error: unknown hydra/launcher 'nope'; available: basic, "),
    (["decode", "-m", "strategy=autoregressive,prompt_lookup", "prompt=hi", "--cfg", "hydra"],
     "error: --cfg and --info show one job's config: drop -m"),
])
def test_launcher_mistakes_are_one_line(capsys, args, message):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_bench_runs_of_a_sweep_are_labelled_by_what_the_sweep_varied(tmp_path):
    from specfree.bench.compare import run_label

    for job, strategy in (("0", "autoregressive"), ("1", "prompt_lookup")):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(
            f"- bench=custom\n- strategy={strategy}\n- bench.prompts=p.jsonl\n- hydra.launcher.n_jobs=2\n")
    shared = {"bench=custom", "bench.prompts=p.jsonl"}
    assert run_label(tmp_path / "1", shared) == "strategy=prompt_lookup"
    assert run_label(tmp_path / "1") == "bench=custom,strategy=prompt_lookup,bench.prompts=p.jsonl"
