"""llama.cpp's own cost of a forward of 1-16 rows, beside specfree's forward curve in ``bench``.

``llama-batched-bench`` (llama.cpp's tool, built by ``scripts/build_llama_cpp.sh`` beside
``llama-server``) on the model's own GGUF: ``B`` sequences share one prompt of ``CONTEXT`` tokens
(``-pps``, one unified KV), then each decodes one token a step, so each step is one forward of ``B``
rows over ``CONTEXT`` tokens and more: the shape of a verify step at the forward curve's context
(its rows see one another only through the shared prompt, a tree's rows also see their ancestors:
a few keys apart). A step's cost is the tool's text-generation time over its steps. Flash attention
and the rest as llama.cpp's defaults, the run's threads.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from specfree.bench.llama_server import tool, tool_env

NAME = "llama-batched-bench"
ROWS = (1, 2, 4, 8, 16)  # the forward curve's rows
CONTEXT = 256  # tokens of context: the forward curve's
STEPS = 16  # decode steps timed per row count
TIMEOUT_S = 1800


def command(exe: Path, gguf: Path, threads: int, rows: Sequence[int] = ROWS, context: int = CONTEXT,
            steps: int = STEPS) -> list[str]:
    n_ctx = context + max(rows) * steps + 64  # the shared prompt and every sequence's steps, one unified KV
    return [str(exe), "-m", str(gguf), "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads),
            "-npp", str(context), "-ntg", str(steps), "-npl", ",".join(map(str, rows)), "-pps", "-kvu",
            "--output-format", "jsonl"]


def parse(output: str) -> dict[int, float]:
    """ms per decode step by rows in the step, from the tool's JSON lines (its log lines skipped)."""
    curve = {}
    for line in output.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if {"pl", "tg", "t_tg"} <= row.keys() and row["tg"] > 0:
            curve[int(row["pl"])] = round(1e3 * row["t_tg"] / row["tg"], 2)
    return dict(sorted(curve.items()))


def forward_curve(gguf: Path, cache_dir: Path, threads: int) -> tuple[dict[int, float] | None, str]:
    """(ms per step of 1-16 rows, or None, a line saying what ran or why nothing did)."""
    exe = tool(cache_dir, NAME)
    if exe is None:
        return None, f"{NAME} not built (scripts/build_llama_cpp.sh): no llama.cpp curve"
    args = command(exe, gguf, threads)
    try:
        done = subprocess.run(args, env=tool_env(exe), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"{NAME} ran past {TIMEOUT_S} s: no llama.cpp curve"
    curve = parse(done.stdout)
    if done.returncode != 0 or set(curve) != set(ROWS):
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
        return None, f"{NAME} failed (exit {done.returncode}: {tail}): no llama.cpp curve"
    return curve, f"{NAME}: {' '.join(args[1:])}"
