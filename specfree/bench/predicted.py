"""What pricing predicted beside what happened: each priced step's forward time on its curve and
its drafted tokens expected accepted, summed beside the forward's measured time and the tokens the
model accepted, in all and per drafter (a hybrid's members).

A turn keeps the sums (``from_steps``); a table row adds its turns' (``combine``). The ratios are
of sums (predicted seconds over measured seconds), so a long step weighs what it costs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from specfree.types import StepRecord

SUMS = ("steps", "forward_s", "predicted_s", "accepted", "expected")


def from_steps(steps: Sequence[StepRecord]) -> dict | None:
    """The sums over a generation's priced steps (those with a predicted forward time); None if none was."""
    priced = [s for s in steps if s.predicted_s is not None and s.expected is not None]
    if not priced:
        return None
    accepted_by: Counter[str] = Counter()
    expected_by: Counter[str] = Counter()
    for step in priced:
        accepted_by.update(step.sources)
        expected_by.update(step.expected_by)
    return {"steps": len(priced), "forward_s": sum(s.forward_s for s in priced),
            "predicted_s": sum(s.predicted_s for s in priced), "accepted": sum(s.accepted for s in priced),
            "expected": sum(s.expected for s in priced), "accepted_by": dict(accepted_by),
            "expected_by": dict(expected_by)}


def combine(parts: Iterable[dict | None]) -> dict | None:
    """Several turns' sums as one (None: some turn was not priced, or none was given)."""
    parts = list(parts)
    if not parts or any(p is None for p in parts):
        return None
    out = {key: sum(p[key] for p in parts) for key in SUMS}
    for key in ("accepted_by", "expected_by"):
        total: Counter[str] = Counter()
        for p in parts:
            total.update(p[key])
        out[key] = dict(total)
    return out


def ratio(predicted: float, measured: float) -> str:
    return f"{predicted / measured:.2f}" if measured > 0 else "–"


HEADERS = ("system", "priced steps", "forward ms/step measured", "predicted", "predicted/measured",
           "accepted/step measured", "expected", "expected/measured", "by drafter: accepted / expected")


def cells(system: str, sums: dict) -> list[str]:
    steps = sums["steps"]
    members = sorted(set(sums["accepted_by"]) | set(sums["expected_by"]))
    by_member = " · ".join(f"{m} {sums['accepted_by'].get(m, 0) / steps:.2f} / {sums['expected_by'].get(m, 0.0) / steps:.2f}"
                           for m in members) if len(members) > 1 else "–"
    return [system, str(steps), f"{1e3 * sums['forward_s'] / steps:.2f}", f"{1e3 * sums['predicted_s'] / steps:.2f}",
            ratio(sums["predicted_s"], sums["forward_s"]), f"{sums['accepted'] / steps:.2f}",
            f"{sums['expected'] / steps:.2f}", ratio(sums["expected"], sums["accepted"]), by_member]
