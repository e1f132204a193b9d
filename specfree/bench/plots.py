"""PNG plots of summary rows, drawn with matplotlib's object API (no pyplot state, no GUI backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from specfree.bench.metrics import BASELINE, OVERALL, Row, sweeps


def _legend_below(ax, entries: int) -> None:
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=min(entries, 2), frameon=False)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def speedup_bars(rows: Sequence[Row], path: Path, baseline: str = BASELINE) -> Path | None:
    """Grouped bars: one group per task, one bar per system, height = speedup vs the baseline."""
    tasks = list(dict.fromkeys(r.category for r in rows))
    names = [s for s in dict.fromkeys(r.system for r in rows) if s != baseline]
    lookup = {(r.category, r.system): r.speedup for r in rows}
    if not names or not tasks:
        return None
    fig = Figure(figsize=(max(6.0, 1.1 * len(tasks) * max(1, len(names)) ** 0.5 + 2), 4.5 + 0.25 * len(names)))
    ax = fig.add_subplot()
    width = 0.8 / len(names)
    x = np.arange(len(tasks))
    for i, name in enumerate(names):
        heights = [lookup.get((t, name)) or 0.0 for t in tasks]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, heights, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, tasks, rotation=20, ha="right")
    ax.set_ylabel(f"speedup vs {baseline} (tokens/s ratio)")
    ax.set_title("Speedup per task, same run")
    _legend_below(ax, len(names))
    return _save(fig, path)


def accepted_histogram(rows: Sequence[Row], path: Path, baseline: str = BASELINE) -> Path | None:
    """Share of steps that emitted k tokens, per system (overall rows; systems with step records)."""
    hists = {r.system: r.accepted_hist for r in rows
             if r.category == OVERALL and r.system != baseline and r.accepted_hist}
    if not hists:
        return None
    top = max(max(h) for h in hists.values())
    ks = np.arange(1, top + 1)
    fig = Figure(figsize=(max(6.0, 0.35 * top + 3), 4.5 + 0.25 * len(hists)))
    ax = fig.add_subplot()
    width = 0.8 / len(hists)
    for i, (name, hist) in enumerate(hists.items()):
        counts = np.array([hist.get(int(k), 0) for k in ks], dtype=float)
        ax.bar(ks + (i - (len(hists) - 1) / 2) * width, counts / counts.sum(), width, label=name)
    ax.set_xticks(ks)
    ax.set_xlabel("tokens emitted per step (accepted drafts + 1)")
    ax.set_ylabel("share of steps")
    ax.set_title("Accepted length per step")
    _legend_below(ax, len(hists))
    return _save(fig, path)


def sweep_lines(rows: Sequence[Row], systems_meta: Sequence[dict], path: Path,
                baseline: str = BASELINE) -> Path | None:
    """Overall tokens/s against the one knob a strategy's configs differ in (a draft budget sweep)."""
    found = sweeps(systems_meta)
    if not found:
        return None
    overall = {r.system: r.tokens_per_s for r in rows if r.category == OVERALL}
    fig = Figure(figsize=(6.5, 4))
    ax = fig.add_subplot()
    for (strategy, knob), points in found.items():
        xs = [v for v, label in points if overall.get(label) is not None]
        ys = [overall[label] for _, label in points if overall.get(label) is not None]
        ax.plot(xs, ys, marker="o", label=f"{strategy} vs {knob}")
    if overall.get(baseline):
        ax.axhline(overall[baseline], color="black", linewidth=0.8, linestyle="--", label=baseline)
    knobs = {knob for _, knob in found}
    ax.set_xlabel(next(iter(knobs)) if len(knobs) == 1 else "knob value (draft budget)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("tokens/s (overall)")
    ax.set_title("Tokens/s vs draft budget")
    ax.legend(fontsize="small")
    return _save(fig, path)


def cost_curve_plot(meta: dict, path: Path) -> Path | None:
    """Two panels from a run's meta: ms per pass over the linear layers alone, and per forward,
    against the rows in the call (log-scaled rows)."""
    panels = [(key, title) for key, title in (("linear_curves_ms", "linear layers alone"),
                                              ("forward_curves_ms", "whole forward, 256 tokens of context"))
              if meta.get(key)]
    if not panels:
        return None
    fig = Figure(figsize=(5.5 * len(panels), 4.5))
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        floor = meta["linear_curves_ms"].get("read_pass") if meta.get("linear_curves_ms") else None
        ticks: set[int] = set()  # every curve's rows (llama.cpp's curve has fewer points than specfree's)
        for name, curve in meta[key].items():
            rows = [int(r) for r in curve]
            ticks.update(rows)
            if name != "read_pass":
                ax.plot(rows, list(curve.values()), marker="o", label=name)
        if floor:  # the same line in both panels: what one read of the weights costs in this run
            ax.axhline(min(floor.values()), color="black", linestyle="--", linewidth=1, label="read-pass floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(r) for r in sorted(ticks)])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("rows in the call")
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize="medium")
        _legend_below(ax, len(meta[key]))
    fig.suptitle(meta.get("cpu") or "", fontsize="small")
    return _save(fig, path)


def roofline_plot(meta: dict, path: Path) -> Path | None:
    """The roofline from a run's meta (``bench/roofline.py``), log-log: multiply-adds per byte of codes
    across, multiply-adds per second achieved up; the read bandwidth's slope and each precision's
    peak as lines (the run's precision solid); one marker per call shape and row count (rows
    written beside it), the forward's coded calls summed in black."""
    result = meta.get("roofline")
    if not result or not result.get("calls"):
        return None
    fig = Figure(figsize=(7.5, 5.5))
    ax = fig.add_subplot()
    series = [(f"{c['shape']} {c['type']} ({c['layers']}) x{c['count']}", c["points"], None) for c in result["calls"]]
    series.append((f"forward's coded calls, {result['forward']['count']} summed", result["forward"]["points"], "black"))
    xs = [p["mac_per_byte"] for _, points, _ in series for p in points]
    for label, points, color in series:
        x, y = [p["mac_per_byte"] for p in points], [p["gmac_s"] for p in points]
        line, = ax.plot(x, y, marker="o", markersize=4, linewidth=0.8, label=label, color=color)
        for p in points:
            ax.annotate(str(p["rows"]), (p["mac_per_byte"], p["gmac_s"]), textcoords="offset points",
                        xytext=(3, 3), fontsize="x-small", color=line.get_color())
    bandwidth, ran = result["read_gb_s"], set(result["precision"].split(", "))
    ridge = max(result["peak_gmac_s"].values()) / bandwidth  # the roofs drawn past their bend
    span = np.geomspace(min(xs) / 2, max(max(xs), ridge) * 2, 64)
    for precision, peak in result["peak_gmac_s"].items():
        style = "-" if precision in ran else ":"
        ax.plot(span, np.minimum(span * bandwidth, peak), color="grey", linestyle=style, linewidth=1.5,
                label=f"roof at {precision}: {bandwidth:.0f} GB/s read, {peak:.0f} G multiply-adds/s peak")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (multiply-adds per byte of codes)")
    ax.set_ylabel("achieved G multiply-adds/s")
    ax.set_title(f"Coded calls against this machine's limits ({result['isa']}, {result['threads']} threads)",
                 fontsize="medium")
    _legend_below(ax, len(series) + len(result["peak_gmac_s"]))
    fig.suptitle(meta.get("cpu") or "", fontsize="small")
    return _save(fig, path)


def paper_vs_measured(method_rows: Sequence, path: Path) -> Path | None:
    """Two panels, one bar pair per strategy (overall): speedup over the same path's autoregressive
    loop and accepted tokens per step, measured here beside its paper's number (hatched) where known."""
    rows = [r for r in method_rows if r.category == OVERALL]
    if not rows:
        return None
    names = [r.system for r in rows]
    x = np.arange(len(names))
    fig = Figure(figsize=(max(7.0, 1.2 * len(names) + 4), 4.8))
    panels = (("speedup", lambda p: p.speedup, "speedup vs same path's autoregressive"),
              ("accepted", lambda p: p.accepted, "accepted tokens per step"))
    for i, (attr, paper_value, label) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        measured = [getattr(r, attr) or 0.0 for r in rows]
        papers = [paper_value(r.paper) if r.paper is not None else None for r in rows]
        ax.bar(x - 0.2, measured, 0.4, label="measured here")
        ax.bar(x + 0.2, [p or 0.0 for p in papers], 0.4, hatch="//", fill=False, label="its paper")
        for xi, r in zip(x, rows):  # a reported range: its bottom marked on the bar
            if attr == "speedup" and r.paper is not None and r.paper.speedup_low:
                ax.hlines(r.paper.speedup_low, xi, xi + 0.4, color="black", linewidth=1.5)
        for xi, p in zip(x, papers):
            if p is None:
                ax.text(xi + 0.2, 0.02, "n/a", ha="center", va="bottom", fontsize="x-small", rotation=90)
        if attr == "speedup":
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(x, names, rotation=25, ha="right", fontsize="small")
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    fig.suptitle("Measured here vs the paper's own number (its model and GPU)", fontsize="medium")
    return _save(fig, path)


def write_plots(rows: Sequence[Row], systems_meta: Sequence[dict], folder: str | Path,
                baseline: str = BASELINE) -> list[Path]:
    folder = Path(folder)
    made = [speedup_bars(rows, folder / "speedup.png", baseline),
            accepted_histogram(rows, folder / "accepted_length.png", baseline),
            sweep_lines(rows, systems_meta, folder / "sweep.png", baseline)]
    return [p for p in made if p is not None]
