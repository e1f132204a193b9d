"""Timed passes over a model's linear layers: every layer once with ``rows`` rows of activations,
the best of several rounds. What bench's linear cost curves time (``specfree/bench/linear_curves.py``)
and what ``precision=auto``'s probe times (``kernels/precision.py``), so both read the same clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from specfree.kernels.build import load_kernels
from specfree.kernels.codes import PRECISIONS, CodedLinear
from specfree.kernels.panels import PanelLinear

# A layer as the coded passes take it: its codes (or None), its panels where it has none, bias, n, k.
Held = tuple


def held_layers(modules: Sequence[nn.Module], coded_only: bool = False) -> list[Held]:
    """The engine's packed layers as ``coded_passes`` takes them (``coded_only``: those held as codes)."""
    return [(m.coded if isinstance(m, CodedLinear) else None, None if isinstance(m, CodedLinear) else m.panels,
             m.bias, m.out_features, m.in_features)
            for m in modules if isinstance(m, CodedLinear) or (isinstance(m, PanelLinear) and not coded_only)]


def coded_passes(held: Sequence[Held], rows: Sequence[int], isa: str | None = None) -> dict[str, dict[int, Callable]]:
    """One pass per precision (``PRECISIONS``) and row count: each layer as an engine holds it,
    codes at that precision, else its panels; {} where no layer holds codes or the kernel cannot
    run (``isa`` None: the one it loads)."""
    isa = isa or load_kernels(progress=False)
    if isa is None or all(c is None for c, *_ in held):
        return {}
    activations = {r: {k: torch.randn(r, k) for *_, k in held} for r in rows}
    passes = {}
    for precision in PRECISIONS:
        products = [(lambda x, c=c, b=b, n=n, precision=precision: c.linear(x, b, n, isa, precision)) if c is not None
                    else (lambda x, p=p, b=b, n=n: torch.ops.specfree.panel_linear(x, p, b, n, isa))
                    for c, p, b, n, _ in held]
        passes[precision] = {r: (lambda xs=activations[r], products=products:
                                 [f(xs[k]) for f, (*_, k) in zip(products, held)]) for r in rows}
    return passes


def best_ms(passes: dict[str, dict[int, Callable]], rows: Sequence[int], rounds: int) -> dict[str, dict[int, float]]:
    """The best pass per (variant, rows) in ms: rows take turns within each round, and the variants
    within each row count (a slow spell of a shared machine slows them alike); round 0 warms up."""
    best = {name: {m: float("inf") for m in rows} for name in passes}
    with torch.no_grad():
        for round_ in range(rounds + 1):  # round 0 warms up
            for m in rows:
                for name, per_rows in passes.items():
                    start = time.perf_counter()
                    per_rows[m]()
                    if round_:
                        best[name][m] = min(best[name][m], time.perf_counter() - start)
    return {name: {m: round(1e3 * s, 2) for m, s in per_rows.items()} for name, per_rows in best.items()}
