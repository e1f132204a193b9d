"""``specfree ceiling BENCH``: how fast could a perfect copier have been on a bench run?

Lookup drafters (prompt lookup, trie, retrieval) can only propose text that already exists.
On a run's baseline outputs, a *perfect copier* drafts, at every step, the longest
continuation that appears anywhere in the prompt or the output so far, and never wastes a
row: a step of k rows emits k tokens. Priced with the model's measured forward-cost curve,
that is a ceiling for copy-based drafting on this machine. Measured speedups sit below it;
a target above it cannot be reached by better ranking, only by drafts that know more.

The perfect copier knows the next token before it copies. A *matched copier* does not: it copies
only what followed an earlier occurrence of the last committed token, the least context any
copying drafter matches (prompt lookup, SuffixDecoding, SAM, the trie), choosing the occurrence
whose continuation agrees longest with what the model went on to say. With at most k rows every
step, no drafter copying from the same text (the request's prompt and output) does better, with
one chain or a tree. Both are also given as wall-time bounds over the same path's autoregressive
loop: the loop's measured prefill, which no drafter shortens, plus the modelled decode.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table

from specfree.bench import store as store_mod
from specfree.bench.methods import same_path_baseline, system_paths
from specfree.bench.metrics import BASELINE, COMPILED, summarize
from specfree.bench.report import markdown_table, wide_console
from specfree.errors import ConfigError
from specfree.settings import use_threads

ROWS = (4, 8, 16)


def copyable(context: Sequence[int], output: Sequence[int], limit: int, matched: bool = False) -> np.ndarray:
    """[len(output)]: for each position i, the longest L <= ``limit`` such that output[i:i+L]
    occurs in context + output[:i] (the text a drafter could copy from at that point); with
    ``matched``, such that the last committed token followed by output[i:i+L] occurs there."""
    # Token ids as characters: str.find is a fast, aligned substring search.
    text = "".join(map(chr, [*context, *output]))
    start = len(context)
    lengths = np.zeros(len(output), dtype=np.int64)
    for i in range(len(output)):
        committed = start + i
        lead = int(matched)  # the pattern starts at the last committed token
        if committed < lead:
            continue
        length = 0
        while length < limit and i + length < len(output) \
                and text.find(text[committed - lead : committed + length + 1], 0, committed) >= 0:
            length += 1
        lengths[i] = length
    return lengths


def perfect_copier(lengths: np.ndarray, rows: int) -> list[int]:
    """Rows of each step of a copier that drafts exactly the copyable tokens (at most rows - 1)."""
    steps, i = [], 0
    while i < len(lengths):
        k = 1 + min(int(lengths[i]), rows - 1, len(lengths) - i - 1)
        steps.append(k)
        i += k
    return steps


@dataclass
class CeilingRow:
    task: str
    tokens: int
    copyable: float  # share of output tokens a copy drafter could have drafted
    tokens_per_step: dict[int, float]  # rows cap -> the perfect copier's tokens per step
    speedup: dict[int, float]  # rows cap -> modeled speedup over one-row steps
    measured: tuple[str, float] | None  # the run's fastest system and its speedup
    matched_tokens_per_step: dict[int, float] = field(default_factory=dict)  # rows cap -> the matched copier's
    matched_speedup: dict[int, float] = field(default_factory=dict)
    # rows cap -> (perfect, matched) copier's wall-time speedup over the same path's autoregressive
    # loop, its measured prefill included; empty where the run recorded no prefill times
    wall: dict[int, tuple[float, float]] = field(default_factory=dict)
    measured_wall: tuple[str, float] | None = None  # the fastest system by tokens/s, prefill included


def ceiling_rows(records: Sequence[dict], contexts: Callable[[dict], list[list[int]]],
                 cost: Callable[[int], float], rows: Sequence[int] = ROWS,
                 systems_meta: Sequence[dict] = ()) -> list[CeilingRow]:
    """One row per task and overall, from the baseline's records; ``contexts(record)`` gives
    each turn's prompt ids."""
    base = [r for r in records if r["system"] == BASELINE and not r.get("error") and r.get("repeat", 0) == 0]
    if not base:
        raise ConfigError("ceiling: the run has no successful autoregressive records to measure")
    totals: dict[str, dict] = defaultdict(lambda: {"tokens": 0, "copyable": 0, "steps": defaultdict(int),
                                                  "seconds": defaultdict(float), "matched_steps": defaultdict(int),
                                                  "matched_seconds": defaultdict(float)})
    for record in base:
        for context, turn in zip(contexts(record), record["turns"]):
            lengths = copyable(context, turn["tokens"], max(rows) - 1)
            matched = copyable(context, turn["tokens"], max(rows) - 1, matched=True)
            for task in (record["category"], "overall"):
                total = totals[task]
                total["tokens"] += len(lengths)
                total["copyable"] += int((lengths > 0).sum())
                for cap in rows:
                    for kind, found in (("", lengths), ("matched_", matched)):
                        steps = perfect_copier(found, cap)
                        total[f"{kind}steps"][cap] += len(steps)
                        total[f"{kind}seconds"][cap] += sum(cost(k) for k in steps)
    fastest, fastest_wall = _fastest(records, systems_meta), _fastest(records, systems_meta, wall=True)
    walls = _loop_walls(records)
    out = []
    for task, total in sorted(totals.items(), key=lambda item: item[0] == "overall"):
        n = max(1, total["tokens"])
        row = CeilingRow(
            task, total["tokens"], total["copyable"] / n,
            {cap: n / max(1, total["steps"][cap]) for cap in rows},
            {cap: n * cost(1) / total["seconds"][cap] for cap in rows},
            fastest.get(task),
            {cap: n / max(1, total["matched_steps"][cap]) for cap in rows},
            {cap: n * cost(1) / total["matched_seconds"][cap] for cap in rows},
            measured_wall=fastest_wall.get(task))
        if task in walls:
            wall, prefill = walls[task]
            row.wall = {cap: (wall_speedup(wall, prefill, row.speedup[cap]),
                              wall_speedup(wall, prefill, row.matched_speedup[cap])) for cap in rows}
        out.append(row)
    return out


def wall_speedup(wall_s: float, prefill_s: float, decode_speedup: float) -> float:
    """A loop's wall time over that of the same prompts with the decode ``decode_speedup`` times
    faster and the prefill as it was."""
    return wall_s / (prefill_s + (wall_s - prefill_s) / decode_speedup)


def _loop_walls(records: Sequence[dict]) -> dict[str, tuple[float, float]]:
    """Per task and overall, the wall and prefill seconds of the autoregressive loop of the path the
    run's strategies took (compiled where it compiled); tasks whose turns lack a prefill time are left out."""
    loop = BASELINE + COMPILED if any(r["system"] == BASELINE + COMPILED for r in records) else BASELINE
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    incomplete = set()
    for record in records:
        if record["system"] != loop or record.get("error") or record.get("repeat", 0) != 0:
            continue
        for turn in record["turns"]:
            for task in (record["category"], "overall"):
                if turn.get("prefill_s") is None:
                    incomplete.add(task)
                sums[task][0] += turn["wall_s"]
                sums[task][1] += turn.get("prefill_s") or 0.0
    return {task: (wall, prefill) for task, (wall, prefill) in sums.items() if task not in incomplete and wall > 0}


def _fastest(records: Sequence[dict], systems_meta: Sequence[dict], wall: bool = False) -> dict[str, tuple[str, float]]:
    """Per task, the strategy whose decode loop ran fastest against the autoregressive decode loop of
    its own path: what the ceiling models too (decode steps against one-row steps, one curve); with
    ``wall``, by tokens/s with the prefill included."""
    paths = system_paths(systems_meta)
    summary = {(row.category, row.system): row for row in summarize(records)}
    best: dict[str, tuple[str, float]] = {}
    for (category, system), row in summary.items():
        base = summary.get((category, same_path_baseline(paths.get(system, ""))))
        mine, theirs = ((row.tokens_per_s, base.tokens_per_s) if wall and base is not None
                        else (row.decode_tokens_per_s, base.decode_tokens_per_s) if base is not None else (None, None))
        if system in (BASELINE, BASELINE + COMPILED) or not mine or not theirs:
            continue
        ratio = mine / theirs
        if ratio > best.get(category, ("", 0.0))[1]:
            best[category] = (system, ratio)
    return best


TITLE = "Perfect / matched copier on the baseline's outputs; speedups modeled with the measured cost curve"
CAPTION = ("≤k: at most k rows per forward; each cell: perfect copier / matched copier (copies only what followed an "
           "earlier occurrence of the last token). copyable: share of tokens that already occurred in the text before "
           "them. decode: over one-row steps; fastest measured: decode tok/s over the same path's autoregressive decode "
           "tok/s. wall: over the same path's autoregressive loop with its measured prefill; fastest measured wall: "
           "tok/s over that loop's.")


def _pair(a: float, b: float, unit: str = "") -> str:
    return f"{a:.2f}{unit} / {b:.2f}{unit}"


def cells(rows: Sequence[CeilingRow]) -> tuple[list[str], list[list[str]]]:
    caps = list(rows[0].speedup) if rows else []
    walls = any(row.wall for row in rows)
    headers = ["task", "tokens", "copyable", *[f"tok/step ≤{c}" for c in caps], *[f"decode ≤{c}" for c in caps],
               "fastest measured", *([f"wall ≤{c}" for c in caps] + ["fastest measured wall"] if walls else [])]
    body = []
    for row in rows:
        line = [row.task, str(row.tokens), f"{row.copyable:.0%}",
                *[_pair(row.tokens_per_step[c], row.matched_tokens_per_step[c]) for c in caps],
                *[_pair(row.speedup[c], row.matched_speedup[c], "x") for c in caps],
                f"{row.measured[1]:.2f}x {row.measured[0]}" if row.measured else "–"]
        if walls:
            line += [_pair(*row.wall[c], "x") if row.wall else "–" for c in caps]
            line.append(f"{row.measured_wall[1]:.2f}x {row.measured_wall[0]}" if row.measured_wall else "–")
        body.append(line)
    return headers, body


def table(rows: Sequence[CeilingRow]) -> Table:
    headers, body = cells(rows)
    out = Table(title=TITLE, caption=CAPTION)
    for header in headers:
        out.add_column(header, justify="left" if header == "task" or header.startswith("fastest") else "right")
    for line in body:
        out.add_row(*line)
    return out


def markdown(rows: Sequence[CeilingRow], curve: str) -> str:
    headers, body = cells(rows)
    return f"# {TITLE}\n\n{markdown_table(headers, body, left=1)}\n\n- {CAPTION}\n- forward cost by rows: {curve}\n"


def main(args: Sequence[str], console: Console | None = None) -> int:
    """Entry point of ``python -m specfree ceiling PATH`` (a bench.json or its folder); the table
    is printed and written to ``ceiling.md`` beside the bench.json."""
    if len(args) != 1:
        raise ConfigError("usage: python -m specfree ceiling BENCH_JSON_OR_FOLDER")
    path, data = store_mod.read_output(args[0], "ceiling")
    meta = data.get("meta", {})
    contexts, cost, curve_name = _conversation_and_cost(meta)
    rows = ceiling_rows(data["records"], contexts, cost, systems_meta=data.get("systems", []))
    console = console or wide_console()
    console.print(table(rows))
    curve = ", ".join(f"{k}: {cost(k) * 1000:.0f} ms" for k in (1, 2, 4, 8, 16, 32)) + (
        f" (the run's own curve: {curve_name})" if curve_name else " (this machine's cached curve: the run recorded none)")
    out = path.parent / "ceiling.md"
    out.write_text(markdown(rows, curve), encoding="utf-8")
    console.print(f"written: {out}")
    return 0


def run_curve(meta: dict) -> tuple[str, Callable[[int], float]] | None:
    """(its name, the forward-cost curve) the bench run measured for the path its strategies ran:
    compiled where it compiled, else eager with specfree's kernels; None where it recorded none."""
    from specfree.cost import CostModel

    path = "compiled" if str(meta.get("compile")).lower() == "true" else "eager"
    for name, points in (meta.get("forward_curves_ms") or {}).items():
        if name.startswith(path) and "library" not in name:
            rows = sorted(int(r) for r in points)
            return name, CostModel(rows, [points[str(r)] / 1e3 for r in rows])
    return None


def run_engine(meta: dict):
    """An autoregressive engine over the run's model, device, dtype and threads."""
    from specfree.engine import Engine

    use_threads(meta.get("threads"))
    return Engine.from_pretrained(meta["model"], "autoregressive", device=meta.get("device", "cpu"),
                                  dtype=meta.get("dtype", "float32"))


def _conversation_and_cost(meta: dict, engine=None):
    """Each record's prompt ids, encoded by the bench's own ``Conversation`` (turn 2 sees the
    baseline's first answer); the cost curve the run recorded for its own path (``run_curve``), or
    where it recorded none, the cached curve of the model, device, dtype and threads it used; and
    the recorded curve's name (None for the cached one). ``engine``: the run's (``run_engine``),
    built here when not given."""
    from specfree.files import cache_folder
    from specfree.bench.prompts import load_prompts
    from specfree.bench.runner import Conversation
    from specfree.bench.systems import Turn
    from specfree.cost import CostModel

    engine = engine or run_engine(meta)
    tokenizer = engine.tokenizer
    conversation = Conversation(engine.encode, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                chat=meta.get("chat", True))
    items = {item.id: item for item in load_prompts(meta["prompts"], format=meta.get("format", "spec_bench"),
                                                     fields=meta.get("fields") or None)}

    class Replay:  # answers with the recorded turns, noting the ids each was asked with
        def __init__(self, turns: list[dict]):
            self.turns, self.seen = iter(turns), []

        def run(self, ids: list[int], max_new_tokens: int) -> Turn:
            self.seen.append(list(ids))
            recorded = next(self.turns)
            return Turn(tokens=recorded["tokens"], wall_s=0.0, prompt_tokens=len(ids))

    def contexts(record: dict) -> list[list[int]]:
        item = items.get(record["prompt_id"])
        if item is None:
            raise ConfigError(f"ceiling: prompt {record['prompt_id']!r} is not in {meta['prompts']}")
        replay = Replay(record["turns"])
        conversation.run(replay, item.turns[: len(record["turns"])], max_new_tokens=0)
        return replay.seen

    own = run_curve(meta)
    if own is not None:
        return contexts, own[1], own[0]
    return contexts, CostModel.cached(engine.adapter, cache_folder()), None  # measured here only if never before
