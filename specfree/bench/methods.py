"""Per-method rows: what each strategy did here, against the same path's autoregressive loop,
beside what its paper reports (``specfree.bench.papers``).

The same path: a strategy on the compiled forward is divided by ``autoregressive (compiled)``,
one on the eager forward by ``autoregressive``, so the speedup counts the drafting alone, not
the compiler. Records written before systems noted their path are read by their labels: with a
compiled autoregressive loop in the run, every strategy ran compiled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specfree.bench.metrics import BASELINE, COMPILED, OVERALL, categories, summarize_group
from specfree.bench.papers import PaperResult, paper_for


@dataclass
class MethodRow:
    category: str
    system: str
    strategy: str
    path: str
    baseline: str  # the autoregressive loop of the same path
    accepted: float | None = None  # tokens per step
    rows_per_step: tuple[float, float] | None = None  # kept, offered
    speedup: float | None = None  # tokens/s over ``baseline``'s on the same prompts and repeat
    speedup_range: tuple[float, float] | None = None
    paper: PaperResult | None = None


def system_paths(systems_meta: Sequence[dict]) -> dict[str, str]:
    """label -> eager, compiled or transformers (inferred from labels where not recorded)."""
    compiled_run = any(m["label"] == BASELINE + COMPILED for m in systems_meta)
    paths = {}
    for meta in systems_meta:
        label = meta["label"]
        if meta.get("path"):
            paths[label] = meta["path"]
        elif meta.get("kind") == "transformers":
            paths[label] = "transformers"
        elif label == BASELINE:
            paths[label] = "eager"
        else:
            paths[label] = "compiled" if compiled_run else "eager"
    return paths


def same_path_baseline(path: str) -> str | None:
    return {"eager": BASELINE, "compiled": BASELINE + COMPILED}.get(path)


def method_rows(records: Sequence[dict], systems_meta: Sequence[dict]) -> list[MethodRow]:
    """One row per (task, strategy) and per strategy overall, for every specfree system other than
    the autoregressive loops; in the systems' order, tasks in file order, ``overall`` last."""
    paths = system_paths(systems_meta)
    strategies = [m for m in systems_meta if paths[m["label"]] in ("eager", "compiled")
                  and m["label"] not in (BASELINE, BASELINE + COMPILED)]
    rows = []
    for category in [*categories(records), OVERALL]:
        group = [r for r in records if category == OVERALL or r["category"] == category]
        for meta in strategies:
            label = meta["label"]
            if not any(r["system"] == label for r in group):
                continue
            baseline = same_path_baseline(paths[label])
            summary = summarize_group(group, label, baseline, category)
            rows.append(MethodRow(category, label, meta.get("strategy", label), paths[label], baseline,
                                  summary.mean_accepted, summary.rows_per_step, summary.speedup,
                                  summary.speedup_range if summary.repeats > 1 else None,
                                  paper_for(meta.get("strategy", ""))))
    return rows


# Text first (system, path, the paper and its setting), then each number measured here beside the paper's.
HEADERS = ("system", "path", "paper", "paper's model, hardware, benchmark", "accepted/step", "paper: accepted/step",
           "speedup vs same path's autoregressive", "paper: speedup", "rows/step kept/offered")
TEXT_COLUMNS = 4


def cells(row: MethodRow) -> list[str]:
    speedup = "–" if row.speedup is None else f"{row.speedup:.2f}x"
    if row.speedup_range and row.speedup_range[0] != row.speedup_range[1]:
        speedup += f" ({row.speedup_range[0]:.2f}–{row.speedup_range[1]:.2f})"
    paper = row.paper
    return [row.system, row.path, paper.paper if paper else "–", (paper.setting() or "–") if paper else "–",
            "–" if row.accepted is None else f"{row.accepted:.2f}",
            f"{paper.accepted:.2f}" if paper and paper.accepted is not None else "–", speedup,
            (paper.speedup_text() or "–") if paper else "–",
            f"{row.rows_per_step[0]:.1f}/{row.rows_per_step[1]:.1f}" if row.rows_per_step else "–"]


def overall(rows: Sequence[MethodRow]) -> list[MethodRow]:
    return [r for r in rows if r.category == OVERALL]


def speedup_matrix(rows: Sequence[MethodRow]) -> tuple[list[str], list[list[str]]]:
    """Strategies down, tasks across: the speedup over the same path's autoregressive loop."""
    tasks = list(dict.fromkeys(r.category for r in rows))
    lookup = {(r.category, r.system): r.speedup for r in rows}
    names = list(dict.fromkeys(r.system for r in rows))
    body = [[name, *("–" if lookup.get((t, name)) is None else f"{lookup[(t, name)]:.2f}x" for t in tasks)]
            for name in names]
    return ["system", *tasks], body


def sources(rows: Sequence[MethodRow]) -> list[str]:
    """One note per paper quoted: where its numbers were read."""
    papers = {r.paper.method: r.paper for r in rows if r.paper is not None}
    return [f"{p.paper}: {p.source}" for p in papers.values()]
