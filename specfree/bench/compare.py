"""``specfree compare PATH...``: one table over bench output folders and decode (multi)run folders.

A path may be a ``bench.json``/``result.json`` file or any folder: folders (a bench ``-m`` sweep
too) are searched for both. Bench runs keep their own same-run speedups; with several runs each
system is labelled by the overrides that tell its run apart. Decode results (``result.json`` from ``specfree
decode``) get their own table, each run against the autoregressive run with the same settings.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from specfree.bench import store as store_mod
from specfree.bench.metrics import BASELINE, summarize
from specfree.bench.plots import write_plots
from specfree.bench.report import markdown as markdown_report
from specfree.bench.report import rich_table, wide_console
from specfree.errors import ConfigError


def discover(paths: Sequence[str | Path]) -> tuple[list[Path], list[Path]]:
    """(bench.json files, decode result.json files) found under ``paths``, in a stable order."""
    bench, decode = [], []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise ConfigError(f"compare: {path} does not exist")
        files = [path] if path.is_file() else sorted(path.rglob("*.json"), key=_natural)
        for f in files:
            if f.name == store_mod.FILENAME:
                bench.append(f)
            elif f.name == "result.json" or path.is_file():  # a file named on the command line
                decode.append(f)
    return list(dict.fromkeys(bench)), list(dict.fromkeys(decode))


def run_overrides(folder: Path) -> list[str]:
    """A job's Hydra overrides (``strategy=trie``, ``strategy.budget=8``) when recorded."""
    overrides = folder / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return []
    from omegaconf import OmegaConf

    values = [str(v) for v in OmegaConf.load(overrides) or []]
    return [v for v in values if not v.startswith(("hydra.", "bench.out", "bench.resume"))]


def run_label(folder: Path, shared: set[str] = frozenset()) -> str:
    """The overrides that tell a job from the others (all but ``shared``), else its folder name."""
    return ",".join(v for v in run_overrides(folder) if v not in shared) or folder.name


def compare(paths: Sequence[str], out: str | None = None, markdown: bool = False,
            console: Console | None = None) -> int:
    """Print one table for all runs under ``paths``; with ``out``, also write compare.md and plots there."""
    console = console or wide_console()
    bench_files, decode_files = discover(paths)
    if not bench_files and not decode_files:
        raise ConfigError(f"compare: no {store_mod.FILENAME} or result.json under {', '.join(map(str, paths))}")
    if bench_files:
        rows, systems = bench_rows(bench_files)
        text = markdown_report(rows)
        if markdown:
            console.print(text, markup=False, highlight=False)
        else:
            console.print(rich_table(rows, "benchmark runs (speedups are within each run)"))
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "compare.md").write_text(text, encoding="utf-8")
            write_plots(rows, systems, out)
    if decode_files:
        console.print(decode_table(decode_results(decode_files)))
    return 0


def bench_rows(files: Sequence[Path]):
    """Summary rows of every bench run; system labels get the run's label when there are several."""
    rows, systems = [], []
    shared = set.intersection(*(set(run_overrides(f.parent)) for f in files))  # a sweep's fixed settings
    for f in files:
        doc = store_mod.read(f)
        prefix = f"{run_label(f.parent, shared)}: " if len(files) > 1 else ""
        order = [s["label"] for s in doc.get("systems", [])]
        rows += [replace(r, system=prefix + r.system)
                 for r in summarize(doc["records"], doc["meta"].get("baseline", BASELINE), order)]
        systems += [{**s, "label": prefix + s["label"]} for s in doc.get("systems", [])]
    tasks = _task_order(rows)
    rows.sort(key=lambda r: tasks.index(r.category))  # stable: keeps run/system order within a task
    return rows, systems


def _task_order(rows) -> list[str]:
    tasks = list(dict.fromkeys(r.category for r in rows))
    return [t for t in tasks if t != "overall"] + (["overall"] if "overall" in tasks else [])


def decode_results(files: Sequence[Path]) -> list[tuple[Path, dict[str, Any]]]:
    runs = []
    for f in files:
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{f} is not a readable JSON file: {exc}") from None
        if not isinstance(doc, dict) or doc.get("kind") != "decode":
            raise ConfigError(f"{f} is neither a bench records file nor a decode result")
        runs.append((f, doc))
    return runs


def decode_table(runs: list[tuple[Path, dict]]) -> Table:
    """Each run against the autoregressive run with the same config apart from the strategy."""
    baselines: dict[str, dict] = {}
    for _, res in runs:
        if res["strategy"]["name"] == BASELINE:
            baselines.setdefault(_comparable(res), res)
    shared = set.intersection(*(set(res.get("overrides") or []) for _, res in runs))
    table = Table("run", "model", "strategy", "tokens", "tok/s", "speedup", "tokens/step", "identical",
                  title="decode runs: speedup is tokens/s over the autoregressive run with the same settings")
    for path, res in runs:
        s, base = res["summary"], baselines.get(_comparable(res))
        speedup = identical = "–"
        if base is not None:
            if base["summary"]["tokens_per_s"] > 0:
                speedup = f"{s['tokens_per_s'] / base['summary']['tokens_per_s']:.2f}x"
            identical = "yes" if res["tokens"] == base["tokens"] else "NO"
        # The overrides that tell this run from the others (the swept ones), else its job folder.
        swept = [o for o in res.get("overrides") or [] if o not in shared and not o.startswith("strategy=")]
        label = " ".join(swept) or path.parent.name
        table.add_row(label, str(res["model"]), res["strategy"]["name"], str(s["new_tokens"]),
                      f"{s['tokens_per_s']:.1f}", speedup, f"{s['mean_accepted']:.2f}", identical)
    return table


def _comparable(res: dict) -> str:
    """The settings two runs must share for one to be the other's baseline."""
    cfg = {k: v for k, v in res.get("config", {}).items() if k not in ("strategy", "pool", "output", "threads")}
    return json.dumps([cfg, res.get("prompt")], sort_keys=True, default=str)


def _natural(path: Path):
    """Sort multirun job folders 0, 1, 2, ..., 10 rather than 0, 1, 10, 2."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts]
