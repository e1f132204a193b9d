"""A roofline of a model's coded calls: each measured against this machine's limits, taken in the same run.

A forward's products on a quantized GGUF's codes are ``specfree::coded_linear`` calls: one per group
of sibling layers sharing their input (q|k|v, gate|up: ``kernels/shared_input.py``, their codes
concatenated), one per other coded layer (o_proj, down_proj, the head). Each distinct call shape
(outputs N, inputs K, GGUF type, precision) is timed at each row count of ``ROWS`` and read against
three limits measured here and now:

- the read bandwidth: ``specfree::read_pass`` over as many bytes as the forward's codes (the floor
  of ``linear_curves``: the kernel's split among threads, the best of 1, 2, 4 or 8 streams a thread);
- the arithmetic peak at the call's precision: ``specfree::fma_peak`` (float32 FMAs, ``exact``) or
  ``specfree::int8_peak`` (byte dot products as the int8 kernel sums them, ``int8``), every thread
  on registers alone.

Work is counted in multiply-adds (rows * N * K; a flop count is twice that) and bytes as the codes'
tensors hold them (codes, scales, offsets, super-block scales), so a call's arithmetic intensity is
multiply-adds per byte. A call cannot beat ``max(bytes / bandwidth, multiply-adds / peak)``: its
``of_roof`` share is that time over its own. The whole forward's coded calls are summed the same
way, each shape's time times its count. ``python -m specfree bench`` measures it with its cost curves
(``bench.cost_curves``); ``python -m specfree roofline`` measures it alone.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specfree.errors import ConfigError
from specfree.kernels.codes import CodedEmbedding, CodedLinear, Codes

ROWS = (1, 2, 4, 8, 16)
ROUNDS = 5  # best of this many passes per row count, after one to warm up
PROBE_ROUNDS = 3  # best of this many calls of each peak probe, after one to warm up
STREAMS = (1, 2, 4, 8)  # as linear_curves' floor: a thread's share read as this many streams side by side
READ_BYTES_MAX = 1 << 30  # the read probe's buffer past this is no better a measure, only more memory
USAGE = "usage: python -m specfree roofline [--out DIR] [key=value ...] (the decode config's overrides)"
HEADERS = ("call", "type", "count", "rows", "ms", "MB", "GB/s", "of read", "GMAC/s", "of peak", "MAC/B", "of roof")


@dataclass
class Call:
    """One ``coded_linear`` call a forward makes: its codes, bias, outputs ``n`` and inputs ``k``."""

    layers: str  # the layer names it computes, "q_proj|k_proj|v_proj" for a shared group
    codes: Codes
    bias: torch.Tensor | None
    n: int
    k: int
    gguf_type: str  # the GGUF type's name, or the code format where the codes were found in float weights
    precision: str

    @property
    def shape(self) -> tuple[int, int, str, str]:
        return self.n, self.k, self.gguf_type, self.precision


def _type_name(layer: CodedLinear) -> str:
    from specfree.kernels.gguf_blocks import GGUF_TYPES

    return next((t.name for t, row in GGUF_TYPES.items() if row is layer.block_type), layer.coded.kind)


def coded_calls(model: nn.Module) -> list[Call]:
    """Every coded call the model's forward makes, in module order: one per group of siblings sharing
    a call (over the shared tensors), one per other ``CodedLinear``; an embedding's own codes
    (``CodedEmbedding.table``) are looked up, not multiplied, and left out."""
    from specfree.kernels.shared_input import SharingLinear

    tables = {id(m._modules["table"]) for m in model.modules()
              if isinstance(m, CodedEmbedding) and "table" in m._modules}
    names = {id(m): name.rsplit(".", 1)[-1] for name, m in model.named_modules()}
    calls, groups = [], set()
    for module in model.modules():
        if not isinstance(module, CodedLinear) or id(module) in tables:
            continue
        if isinstance(module, SharingLinear):
            call = module.call
            if id(call) in groups:
                continue
            groups.add(id(call))
            calls.append(Call("|".join(names[id(m)] for m in call.members), call.codes, call.bias,
                              sum(call.sizes), module.in_features, _type_name(module), module.precision))
        else:
            calls.append(Call(names[id(module)], module.coded, module.bias, module.out_features,
                              module.in_features, _type_name(module), module.precision))
    return calls


def time_calls(calls: Sequence[Call], rows: Sequence[int], rounds: int, isa: str) -> list[dict[int, float]]:
    """Each call's best seconds per row count: every round runs all calls in the forward's order for
    each row count in turn (so each call's codes come from where a forward finds them, and a slow
    spell of a shared machine slows every row count alike); round 0 warms up."""
    inputs = {r: {k: torch.randn(r, k) for k in {c.k for c in calls}} for r in rows}
    best = [{r: float("inf") for r in rows} for _ in calls]
    with torch.no_grad():
        for round_ in range(rounds + 1):
            for r in rows:
                for call, times in zip(calls, best):
                    x = inputs[r][call.k]
                    start = time.perf_counter()
                    call.codes.linear(x, call.bias, call.n, isa, call.precision)
                    took = time.perf_counter() - start
                    if round_:
                        times[r] = min(times[r], took)
    return best


def read_bandwidth(sizes: Sequence[int], rounds: int) -> tuple[float, int]:
    """(bytes per second, bytes read): the best one read of a float32 buffer split as ``sizes`` (the
    calls' bytes, up to ``READ_BYTES_MAX``), each part split among threads as the kernel splits a
    call's codes. A buffer of its own: the codes' bits read as floats could be denormals, which
    some CPUs add slowly."""
    floats, total = [], 0
    for size in sizes:
        if total and total + size > READ_BYTES_MAX:
            break
        floats.append(max(1, size // 4))
        total += 4 * floats[-1]
    parts = list(torch.ones(sum(floats)).split(floats))
    best = float("inf")
    for round_, streams in itertools.product(range(rounds + 1), STREAMS):
        start = time.perf_counter()
        torch.ops.specfree.read_pass(parts, streams)
        if round_:
            best = min(best, time.perf_counter() - start)
    return total / best, total


def peaks(isa: str, rounds: int = PROBE_ROUNDS) -> dict[str, float]:
    """Multiply-adds per second on every thread, by precision: float32 FMAs (``exact``) and int8 byte
    dot products (``int8``) on the ISA path ``isa``; the best of ``rounds`` after one to warm up
    (the first call also wakes the threads)."""
    probes = {"exact": torch.ops.specfree.fma_peak, "int8": torch.ops.specfree.int8_peak}
    return {precision: max(probe(isa) for _ in range(rounds + 1)) for precision, probe in probes.items()}


def point(rows: int, seconds: float, nbytes: int, macs: int, at_read: float, at_peak: float,
          at_roof: float | None = None) -> dict[str, Any]:
    """One point of the roofline: ``at_read`` and ``at_peak`` are the seconds the bytes take at the
    read bandwidth and the multiply-adds at the peak, ``at_roof`` the least the call can take (one
    call: the larger of the two; calls summed: each call's larger); the shares are those over the
    measured time."""
    at_roof = max(at_read, at_peak) if at_roof is None else at_roof
    return {"rows": rows, "ms": round(1e3 * seconds, 4), "gb_s": round(nbytes / seconds / 1e9, 2),
            "of_read": round(at_read / seconds, 3), "gmac_s": round(macs / seconds / 1e9, 2),
            "of_peak": round(at_peak / seconds, 3), "mac_per_byte": round(macs / nbytes, 3),
            "of_roof": round(at_roof / seconds, 3)}


def skip_reason(model: nn.Module) -> str | None:
    """Why the model has no roofline here, None where it has one."""
    from specfree.kernels import load_kernels

    if next(model.parameters(), torch.empty(0)).device.type != "cpu":
        return "the model runs on a GPU: the roofline times specfree's CPU kernels"
    if not any(isinstance(m, CodedLinear) for m in model.modules()):
        return "no layer is held as a quantized file's codes (a float model): no coded call to time"
    if load_kernels(progress=False) is None:
        return "specfree's kernels cannot run on this machine"
    return None


def roofline(model: nn.Module, rows: Sequence[int] = ROWS, rounds: int = ROUNDS) -> dict[str, Any]:
    """The roofline of ``model``'s coded calls (an engine's ``adapter.model``) as a plain dict: the
    limits measured in this run, one entry per distinct call shape with its count in the forward,
    the forward's coded calls summed; ``{"skipped": why}`` where it has none (``skip_reason``)."""
    from specfree.kernels import process_isa

    why = skip_reason(model)
    if why is not None:
        return {"skipped": why}
    isa = process_isa()
    calls = coded_calls(model)
    best = time_calls(calls, rows, rounds, isa)
    bandwidth, read_bytes = read_bandwidth([c.codes.nbytes() for c in calls], rounds)
    peak = peaks(isa)
    shapes: dict[tuple, list[int]] = {}
    for i, call in enumerate(calls):
        shapes.setdefault(call.shape, []).append(i)
    # the forward's sums per row count: seconds, bytes, multiply-adds, at read, at peak, at roof
    entries, forward = [], {r: [0.0, 0, 0, 0.0, 0.0, 0.0] for r in rows}
    for (n, k, gguf_type, precision), members in shapes.items():
        nbytes = calls[members[0]].codes.nbytes()
        points = []
        for r in rows:
            seconds = sum(best[i][r] for i in members) / len(members)
            macs = r * n * k
            at_read, at_peak = nbytes / bandwidth, macs / peak[precision]
            points.append(point(r, seconds, nbytes, macs, at_read, at_peak))
            for j, value in enumerate((seconds, nbytes, macs, at_read, at_peak, max(at_read, at_peak))):
                forward[r][j] += value * len(members)
        layers = list(dict.fromkeys(calls[i].layers for i in members))
        entries.append({"shape": f"{n}x{k}", "n": n, "k": k, "type": gguf_type, "precision": precision,
                        "layers": ", ".join(layers), "count": len(members), "bytes": nbytes, "points": points})
    precisions = list(dict.fromkeys(c.precision for c in calls))
    return {"isa": isa, "threads": torch.get_num_threads(), "rows": list(rows), "rounds": rounds,
            "precision": ", ".join(precisions), "read_gb_s": round(bandwidth / 1e9, 2), "read_bytes": read_bytes,
            "peak_gmac_s": {p: round(v / 1e9, 1) for p, v in peak.items()},
            "calls": entries,
            "forward": {"count": len(calls), "bytes": forward[rows[0]][1],
                        "points": [point(r, *forward[r]) for r in rows]}}


def limits_line(result: dict[str, Any]) -> str:
    """The run's limits in one line: read bandwidth, peaks, and where the roofline bends."""
    peak = result["peak_gmac_s"]
    ridges = ", ".join(f"{p} {v:.0f} G multiply-adds/s (ridge at {v / result['read_gb_s']:.0f} MAC/B)"
                       for p, v in peak.items())
    return (f"limits measured in the same run ({result['isa']}, {result['threads']} threads): read "
            f"{result['read_gb_s']:.1f} GB/s (read_pass over {result['read_bytes'] / 1e6:.0f} MB); peaks: {ridges}; "
            f"coded calls at precision {result['precision']}")


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """The table's cells: each call shape at each row count, then the forward's coded calls summed."""
    out = []
    sections = [(f"{c['shape']} {c['layers']}", f"{c['type']} {c['precision']}", c["count"], c["bytes"], c["points"])
                for c in result["calls"]]
    sections.append(("forward (coded calls)", "", result["forward"]["count"], result["forward"]["bytes"],
                     result["forward"]["points"]))
    for name, kind, count, nbytes, points in sections:
        for p in points:
            out.append([name, kind, str(count), str(p["rows"]), f"{p['ms']:.3f}", f"{nbytes / 1e6:.2f}",
                        f"{p['gb_s']:.1f}", f"{p['of_read']:.0%}", f"{p['gmac_s']:.1f}", f"{p['of_peak']:.0%}",
                        f"{p['mac_per_byte']:.2f}", f"{p['of_roof']:.0%}"])
    return out


def section(meta: dict[str, Any]) -> str:
    """The bench report's roofline section (Markdown), or its one-line reason where it was skipped."""
    from specfree.bench.report import markdown_table

    if meta.get("roofline_skipped"):
        return f"## Roofline\n\nNot measured: {meta['roofline_skipped']}."
    result = meta.get("roofline")
    if not result:
        return ""
    return "\n\n".join([
        "## Roofline: each coded call against this machine's limits (same run)",
        limits_line(result) + ". ms: the best call; MB: its codes; of read: the time those bytes take at the "
        "read bandwidth over the call's; of peak: the time its multiply-adds (rows x N x K) take at the peak of "
        "its precision over the call's; of roof: the larger of the two over the call's (100% is the limit). "
        "Plot: roofline.png.",
        markdown_table(HEADERS, table_rows(result), left=2)])


def rich_table(result: dict[str, Any]):
    from rich.table import Table

    table = Table(*HEADERS, title="Roofline of the coded calls", caption=limits_line(result), header_style="bold")
    for column in table.columns[2:]:
        column.justify = "right"
    body = table_rows(result)
    for i, cells in enumerate(body):
        table.add_row(*cells, end_section=i + 1 == len(body) or body[i + 1][0] != cells[0])
    return table


def main(args: Sequence[str], console=None) -> int:
    """``python -m specfree roofline [--out DIR] [key=value ...]``: the roofline of the model the
    decode config names (``strategy=autoregressive``, ``compile=false`` unless given), printed; with
    ``--out``, ``roofline.json``, ``roofline.md`` and ``roofline.png`` written there."""
    import json

    from specfree.bench.plots import roofline_plot
    from specfree.bench.report import wide_console
    from specfree.config import engine_parts, load_config
    from specfree.engine import Engine
    from specfree.plugins import build_plugin_manager, registry
    from specfree.settings import use_threads

    args = list(args)
    out = None
    if "--out" in args:
        i = args.index("--out")
        if i + 1 >= len(args):
            raise ConfigError(USAGE)
        out = Path(args[i + 1])
        del args[i : i + 2]
    if any(a.startswith("-") for a in args):
        raise ConfigError(USAGE)
    reg = registry(build_plugin_manager())
    cfg = load_config(None, ["strategy=autoregressive", "compile=false", *args], reg)
    use_threads(cfg.threads)
    model = Engine(**engine_parts(cfg, reg)).adapter.model
    result = roofline(model)
    console = console or wide_console()
    meta = {"roofline": result} if "skipped" not in result else {"roofline_skipped": result["skipped"]}
    if "skipped" in result:
        console.print(f"roofline not measured: {result['skipped']}")
    else:
        console.print(rich_table(result))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "roofline.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        (out / "roofline.md").write_text(section(meta) + "\n", encoding="utf-8")
        roofline_plot(meta, out / "roofline.png")
        console.print(f"written: {out / 'roofline.json'}, roofline.md, roofline.png")
    return 0


if __name__ == "__main__":  # python -m specfree.bench.roofline: the same as python -m specfree roofline
    import sys

    from specfree.cli import main as cli_main

    raise SystemExit(cli_main(["roofline", *sys.argv[1:]]))
