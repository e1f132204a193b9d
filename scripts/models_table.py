"""The models table of README.md#models-and-gguf from a ``scripts/readme_run.sh`` folder: per
SmolLM2 type, the default precision's bench (beside llama-server) and the ``precision=exact``
bench, each row's overall tokens/s with the prefill (decode alone in brackets), the file's size
and the peak RSS.

    python scripts/models_table.py docs/bench/run_bg
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from specfree.bench.metrics import OVERALL, Row, summarize

TYPES = ("Q4_1", "Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")
HEADER = ("| file | precision | compiled loop | hybrid, tokens/step | hybrid over its loop | one-row decode over "
          "llama-server | hybrid over llama.cpp's best | llama-server | llama-server ngram-mod, tokens/step | "
          "size, peak RSS |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def overall(bench: Path) -> tuple[dict, dict[str, Row]]:
    data = json.loads((bench / "bench.json").read_text())
    return data, {row.system: row for row in summarize(data["records"]) if row.category == OVERALL}


def peaks(run: Path) -> dict[str, list[float]]:
    """GB per type, from ``peak_rss.txt`` ('round KiB KiB overrides...')."""
    found: dict[str, list[float]] = {}
    path = run / "peak_rss.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        _, kib, _, *overrides = line.split()
        named = re.search(r"smollm2\.(\w+)\.gguf", " ".join(overrides))
        found.setdefault(named.group(1) if named else "Q4_1", []).append(int(kib) * 1024 / 1e9)
    return found


def sizes(run: Path) -> dict[str, int]:
    """Bytes per type, from ``sizes.txt`` ('type bytes', written as each type's bench ends)."""
    return {kind: int(size) for kind, size in (line.split() for line in (run / "sizes.txt").read_text().splitlines())}


def rate(row: Row) -> str:
    return f"{row.tokens_per_s:.1f} ({row.decode_tokens_per_s:.1f})"


def table(run: Path) -> str:
    lines, rss, files = [HEADER], peaks(run), sizes(run)
    for kind in TYPES:
        if not (run / f"bench_{kind}" / "bench.json").is_file():
            continue
        data, rows = overall(run / f"bench_{kind}")
        servers = [s for s in data["systems"] if s["strategy"] == "llama_server"]
        plain = next(rows[s["label"]] for s in servers if s["params"]["spec_type"] == "none")
        spec = next(rows[s["label"]] for s in servers if s["params"]["spec_type"] != "none")
        best = max(plain.tokens_per_s, spec.tokens_per_s)
        gb = rss.get(kind, [])
        span = sorted({f"{value:.2f}" for value in (min(gb), max(gb))}) if gb else []
        held = f"{files[kind] / 1e6:.0f} MB, " + ("-".join(span) + " GB" if span else "–")
        benches = [("int8 (default)", rows)]
        if (run / f"bench_{kind}_exact" / "bench.json").is_file():
            benches.append(("exact", overall(run / f"bench_{kind}_exact")[1]))
        for precision, mine in benches:
            loop, hybrid = mine["autoregressive (compiled)"], mine["hybrid"]
            lines.append(" | ".join([
                f"| SmolLM2 {kind}", precision, rate(loop), f"{rate(hybrid)}, {hybrid.mean_accepted:.2f}",
                f"{hybrid.tokens_per_s / loop.tokens_per_s:.2f}x",
                f"{loop.decode_tokens_per_s / plain.decode_tokens_per_s:.2f}x",
                f"{hybrid.tokens_per_s / best:.2f}x", rate(plain), f"{rate(spec)}, {spec.mean_accepted:.2f}",
                held]) + " |")
            identical = {name: f"{row.identical}/{row.compared}" for name, row in mine.items()}
            print(f"{kind} {precision}: identical to its eager loop {identical}", file=sys.stderr)
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
