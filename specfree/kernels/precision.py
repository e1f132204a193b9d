"""Which arithmetic layers held as codes run (``precision=``), and why: ``auto`` decides by a probe.

``int8`` (8-bit activations, integer sums: llama.cpp's arithmetic) pays only where the CPU sums
bytes cheaply. With AVX-512 VNNI (vpdpbusd) its rows are cheaper than ``exact`` (float32
activations, transformers' arithmetic); with AVX2 alone (maddubs) a Zen 3 ran one row at exact's
price and 4 or 8 rows dearer before AVX2 summed 4-bit blocks in 16 bits (issue 77; run CC). So
``auto`` runs a model read from a quantized GGUF file at int8 only where a probe finds it faster on
this CPU: one pass over some of the model's coded layers at each precision and row count of
``PROBE_ROWS``, the kind of pass bench's linear cost curves time (``kernels/passes.py``). The
probe's milliseconds are cached per CPU, thread count, kernel build, file type (the GGUF's quantized
types) and the shapes probed, in the cost curves' folder, so later loads decide from the file; the
decision is taken anew from the cached times.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specfree.files import cache_folder, fingerprint, write_atomic
from specfree.kernels.build import kernel_dir, load_kernels, process_isa
from specfree.kernels.codes import CodedLinear
from specfree.kernels.passes import best_ms, coded_passes, held_layers
from specfree.settings import DEFAULTS, EngineSettings

PROBE_ROWS = (1, 8)  # a plain step's one row, and a verify step's rows
PROBE_ROUNDS = 5  # best of this many passes, after one to warm up
# The layers probed, in the model's order, up to this many bytes of codes: past the last-level
# cache of the CPUs the kernels run on, so a pass streams its codes from memory, as a forward does
# (a 7B file's layers: a few of them; SmolLM2's Q4_1: 64 of its 211 layers, about 0.1 s at both
# precisions on a 2-core AMD EPYC Zen 4).
PROBE_BYTES = 48 << 20
# int8 is chosen only where a probed 1-row pass and 8-row pass together take at least this much
# less time at int8 than at exact: a tie keeps exact, transformers' arithmetic. Summed, the 8-row
# pass weighs most, where the two differ by 1.4x (Zen 4 with VNNI) or 0.9x (Zen 3) and noise does
# not flip the choice; at one row they are within a few percent on both.
MARGIN = 1.05

Probe = Callable[[nn.Module], dict[str, dict[int, float]]]  # the model -> ms by precision by rows


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a model's coded layers run and why (``describe()``, ``decode``'s result.json)."""

    precision: str
    why: str


def choose_precision(model: nn.Module, settings: EngineSettings = DEFAULTS,
                     probe: Probe | None = None) -> PrecisionChoice:
    """The arithmetic ``settings.precision`` names for ``model``'s coded layers: ``exact`` or ``int8`` as
    asked; ``auto``: ``exact`` for float weights (even where they are exactly some format's codes:
    a checkpoint's users expect transformers' output), and for a model read from a quantized GGUF
    file whichever the probe finds faster here (``probe``: the times, for tests; default
    ``probe_precisions``, its result cached under ``settings.cache_dir``)."""
    settings = settings.checked()
    precision, cache_dir = settings.precision, settings.cache_dir
    if precision != "auto":
        return PrecisionChoice(precision, "asked (precision=" + precision + ")")
    holdings = getattr(model, "gguf_holdings", None)
    if holdings is None or not holdings.coded:
        return PrecisionChoice("exact", "float weights: transformers' arithmetic")
    if not any(isinstance(m, CodedLinear) for m in model.modules()) or load_kernels(progress=False) is None:
        return PrecisionChoice("exact", "no layer runs specfree's codes here")
    path = probe_path(model, cache_dir)
    times = read_probe(path)
    cached = times is not None
    if times is None:
        times = (probe or probe_precisions)(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"ms": times}))
    return decide(times, "probe, cached" if cached else "probe")


def decide(times: dict[str, dict[int, float]], source: str) -> PrecisionChoice:
    """int8 where its passes at the probed row counts take ``MARGIN`` times less than exact's, in
    sum, else exact; the reason gives the speed-ups."""
    rows = sorted(times["exact"])
    speedup = sum(times["exact"].values()) / max(sum(times["int8"].values()), 1e-9)
    each = ", ".join(f"{times['exact'][r] / max(times['int8'][r], 1e-9):.2f}x at {r} row{'s' if r > 1 else ''}"
                     for r in rows)
    if speedup >= MARGIN:
        return PrecisionChoice("int8", f"int8 {speedup:.2f}x faster than exact on this CPU ({each}; {source})")
    return PrecisionChoice("exact", f"int8 not faster than exact on this CPU ({speedup:.2f}x: {each}; {source})")


def probe_path(model: nn.Module, cache_dir: str | Path | None = None) -> Path:
    """The probe's cache file for this CPU, thread count, kernel build and the model's file type,
    and the shapes it probes (a tiny test model's layers, all in cache, say nothing of a real one's)."""
    from specfree.runinfo import cpu_name

    types = sorted({qtype for counts in model.gguf_holdings.coded.values() for qtype in counts})
    shapes = sorted({(m.out_features, m.in_features) for m in probe_layers(model)})
    setup = [cpu_name(), process_isa(), torch.get_num_threads(), kernel_dir().name, types, shapes, PROBE_ROWS]
    return cache_folder(cache_dir) / "costs" / f"precision-{fingerprint(setup)}.json"


def read_probe(path: Path) -> dict[str, dict[int, float]] | None:
    """The cached probe's ms by precision by rows, or None (none yet, or a damaged file: probed again)."""
    try:
        saved = json.loads(path.read_text())["ms"]
        return {precision: {int(r): float(ms) for r, ms in saved[precision].items()} for precision in ("exact", "int8")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def probe_layers(model: nn.Module, budget: int = PROBE_BYTES) -> list[CodedLinear]:
    """The model's coded layers in its order, up to ``budget`` bytes of codes (the one that crosses it included)."""
    layers, total = [], 0
    for module in model.modules():
        if isinstance(module, CodedLinear) and total < budget:
            layers.append(module)
            total += sum(t.numel() * t.element_size() for t in module.coded.tensors() if t is not None)
    return layers


def probe_precisions(model: nn.Module, rows=PROBE_ROWS, rounds: int = PROBE_ROUNDS,
                     budget: int = PROBE_BYTES) -> dict[str, dict[int, float]]:
    """ms of one pass over the model's first coded layers (``probe_layers``) at each precision and
    row count, best of ``rounds``, the precisions interleaved."""
    return best_ms(coded_passes(held_layers(probe_layers(model, budget)), rows), rows, rounds)
