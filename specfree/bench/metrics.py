"""Pure functions from per-prompt records to table rows. Nothing here is estimated: every number
is a sum or ratio of recorded events.

A record is ``{"prompt_id", "category", "system", "repeat", "turns": [turn...], "error"}`` where
a turn holds at least ``tokens`` (ids) and ``wall_s``, and optionally ``steps`` (forwards that
emitted tokens), ``emitted`` (tokens per step) and ``split`` (seconds per phase).

- tokens/s      = sum(new tokens) / sum(wall seconds) over the group's prompts, per repeat
- speedup       = tokens/s / the baseline's tokens/s over the SAME prompts and repeat of the run
- prompt tok/s  = sum(prompt tokens) / sum(prefill seconds), over every repeat
- decode tok/s  = sum(new tokens made after the prefill) / sum(wall - prefill seconds), over every repeat
- accepted/step = sum(new tokens) / sum(steps)
- rows/step     = sum(rows kept) / sum(steps), and of the rows the drafters offered (pricing keeps some)
- split         = each phase's share of the summed step time
- identical     = outputs token-identical (every turn) to the baseline's for that prompt and repeat
With several repeats, tokens/s and speedup are the median over repeats with their min and max.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specfree.bench import predicted

BASELINE = "autoregressive"
COMPILED = " (compiled)"  # label suffix of the compiled autoregressive loop (BASELINE + COMPILED)
OVERALL = "overall"
PHASES = ("draft_s", "mask_s", "forward_s", "verify_s", "other_s")


@dataclass
class Row:
    category: str
    system: str
    prompts: int = 0
    new_tokens: float = 0
    wall_s: float = 0.0
    tokens_per_s: float | None = None
    tokens_per_s_range: tuple[float, float] | None = None
    speedup: float | None = None
    speedup_range: tuple[float, float] | None = None
    prompt_tokens_per_s: float | None = None  # prompt processing (the prefill) alone
    decode_tokens_per_s: float | None = None  # the decode loop alone
    mean_accepted: float | None = None
    rows_per_step: tuple[float, float] | None = None  # (kept, offered): what pricing ran of what was offered
    split: dict[str, float] | None = None
    identical: int = 0
    compared: int = 0
    errors: int = 0
    repeats: int = 0
    accepted_hist: dict[int, int] = field(default_factory=dict)
    accepted_by: dict[str, int] | None = None  # accepted drafted tokens per drafter, over every turn
    priced: dict | None = None  # pricing's predictions beside the measurements (``predicted.from_steps``)

    @property
    def identical_frac(self) -> float | None:
        return self.identical / self.compared if self.compared else None


def same_output(a: dict, b: dict) -> bool:
    """True when two records produced the same tokens in every turn."""
    ta, tb = a.get("turns") or [], b.get("turns") or []
    return len(ta) == len(tb) and all(list(x["tokens"]) == list(y["tokens"]) for x, y in zip(ta, tb))


def new_tokens(record: dict) -> int:
    return sum(len(t["tokens"]) for t in record["turns"])


def wall_s(record: dict) -> float:
    return sum(t["wall_s"] for t in record["turns"])


def categories(records: Iterable[dict]) -> list[str]:
    return list(dict.fromkeys(r["category"] for r in records))


def systems(records: Iterable[dict]) -> list[str]:
    return list(dict.fromkeys(r["system"] for r in records))


def summarize(records: Sequence[dict], baseline: str = BASELINE, order: Sequence[str] | None = None) -> list[Row]:
    """One row per (category, system), then one ``overall`` row per system."""
    names = list(order) if order else systems(records)
    names += [s for s in systems(records) if s not in names]
    rows = []
    for category in [*categories(records), OVERALL]:
        group = [r for r in records if category == OVERALL or r["category"] == category]
        rows += [summarize_group(group, name, baseline, category) for name in names
                 if any(r["system"] == name for r in group)]
    return rows


def summarize_group(records: Sequence[dict], system: str, baseline: str = BASELINE,
                    category: str = OVERALL) -> Row:
    row = Row(category, system)
    mine = [r for r in records if r["system"] == system]
    row.errors = sum(1 for r in mine if r.get("error"))
    ok = [r for r in mine if not r.get("error")]
    base = {(str(r["prompt_id"]), r["repeat"]): r for r in records
            if r["system"] == baseline and not r.get("error")}
    if not ok:
        return row
    row.prompts = len({str(r["prompt_id"]) for r in ok})
    by_repeat: dict[int, list[dict]] = {}
    for r in ok:
        by_repeat.setdefault(r["repeat"], []).append(r)
    row.repeats = len(by_repeat)

    tokens, walls, tps, speedups = [], [], [], []
    for repeat, recs in sorted(by_repeat.items()):
        n, w = sum(map(new_tokens, recs)), sum(map(wall_s, recs))
        tokens.append(n)
        walls.append(w)
        if w > 0:
            tps.append(n / w)
        paired = [(r, base[(str(r["prompt_id"]), repeat)]) for r in recs if (str(r["prompt_id"]), repeat) in base]
        if paired:
            mine_w = sum(wall_s(r) for r, _ in paired)
            base_n, base_w = sum(new_tokens(b) for _, b in paired), sum(wall_s(b) for _, b in paired)
            if mine_w > 0 and base_n > 0 and base_w > 0:
                speedups.append((sum(new_tokens(r) for r, _ in paired) / mine_w) / (base_n / base_w))
    row.new_tokens = float(np.median(tokens))
    row.wall_s = float(np.median(walls))
    row.tokens_per_s, row.tokens_per_s_range = _median_range(tps)
    row.speedup, row.speedup_range = _median_range(speedups)

    turns = [t for r in ok for t in r["turns"]]
    row.prompt_tokens_per_s, row.decode_tokens_per_s = prompt_and_decode(turns)
    if all(t.get("steps") is not None for t in turns):
        steps = sum(t["steps"] for t in turns)
        row.mean_accepted = sum(len(t["tokens"]) for t in turns) / steps if steps else None
        if steps and all(t.get("rows") is not None and t.get("offered") is not None for t in turns):
            row.rows_per_step = (sum(t["rows"] for t in turns) / steps, sum(t["offered"] for t in turns) / steps)
    if all(t.get("split") for t in turns):
        totals = {k: sum(t["split"].get(k, 0.0) for t in turns) for k in PHASES}
        whole = sum(totals.values())
        row.split = {k: v / whole for k, v in totals.items()} if whole > 0 else None
    if all(t.get("accepted_by") is not None for t in turns):  # runs recorded before it was kept have none
        row.accepted_by = {}
        for t in turns:
            for source, count in t["accepted_by"].items():
                row.accepted_by[source] = row.accepted_by.get(source, 0) + count
    row.priced = predicted.combine(t.get("priced") for t in turns)
    lengths = [e for t in turns for e in (t.get("emitted") or [])]
    row.accepted_hist = {int(k): int(v) for k, v in zip(*np.unique(lengths, return_counts=True))} if lengths else {}

    for r in ok:
        b = base.get((str(r["prompt_id"]), r["repeat"]))
        if b is not None:
            row.compared += 1
            row.identical += same_output(r, b)
    return row


def prompt_and_decode(turns: Sequence[dict]) -> tuple[float | None, float | None]:
    """Tokens/s of the prompt processing and of the decode loop, apart; None where a turn lacks its prefill time."""
    if not turns or any(t.get("prefill_s") is None for t in turns):
        return None, None
    prefill = sum(t["prefill_s"] for t in turns)
    decode = sum(t["wall_s"] - t["prefill_s"] for t in turns)
    decoded = sum(len(t["tokens"]) - t.get("prefill_emitted", 0) for t in turns)
    return (sum(t["prompt_tokens"] for t in turns) / prefill if prefill > 0 else None,
            decoded / decode if decode > 0 else None)


def _median_range(values: list[float]) -> tuple[float | None, tuple[float, float] | None]:
    if not values:
        return None, None
    return float(np.median(values)), (float(min(values)), float(max(values)))


def sweeps(systems_meta: Sequence[dict]) -> dict[tuple[str, str], list[tuple[float, str]]]:
    """Find parameter sweeps: systems of one strategy whose knobs differ in exactly one number.

    A system's knobs are its ``params`` (defaults filled in) where recorded, else its ``knobs``.
    Returns ``{(strategy, knob): [(value, label), ...]}`` sorted by value, for sweeps of 2+ points.
    """
    by_strategy: dict[str, list[dict]] = {}
    for meta in systems_meta:
        by_strategy.setdefault(meta["strategy"], []).append(meta)
    found = {}
    for strategy, metas in by_strategy.items():
        if len(metas) < 2:
            continue
        knobs = [m.get("params") or m.get("knobs") or {} for m in metas]
        keys = set().union(*knobs)
        varying = [k for k in keys if len({repr(k_.get(k)) for k_ in knobs}) > 1]
        if len(varying) != 1:
            continue
        knob = varying[0]
        values = [(k_.get(knob), m["label"]) for k_, m in zip(knobs, metas)]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v, _ in values):
            found[(strategy, knob)] = sorted(values)
    return found
