"""Where a command's start-up goes: seconds by phase, from the process's start to its first token
(``decode``'s result.json, ``startup``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext


def process_age_s() -> float | None:
    """Seconds since this process started (the interpreter's own start-up and the imports before
    ``main`` included), from /proc (Linux, 10 ms ticks); None elsewhere."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
            return max(0.0, float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupSplit:
    """Phases timed one after another from the moment it is made (the command's ``main``); what no
    phase claims is ``other_s``."""

    def __init__(self):
        self.before_s = process_age_s()  # the interpreter and the imports that reached main
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.ended(name, since=begin)

    def ended(self, name: str, since: float) -> None:
        """Phase ``name`` ran from ``since`` (a ``time.perf_counter()`` reading) to now."""
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - since

    def unclaimed(self, name: str) -> None:
        """Phase ``name``: the time since ``main`` that no phase has claimed yet."""
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - self.start - sum(self.seconds.values())

    def as_dict(self) -> dict[str, float | None]:
        """``{"before_main_s", <phase>_s..., "other_s", "total_s"}`` up to now; ``total_s`` counts
        from the process's start where that is known, else from ``main``."""
        since_main = time.perf_counter() - self.start
        phases = {f"{name}_s": round(s, 4) for name, s in self.seconds.items()}
        other = since_main - sum(self.seconds.values())
        return {"before_main_s": None if self.before_s is None else round(self.before_s, 3), **phases,
                "other_s": round(other, 4), "total_s": round(since_main + (self.before_s or 0.0), 3)}


def phase_of(split: StartupSplit | None, name: str):
    """``split.phase(name)``, or nothing timed where no split is kept."""
    return split.phase(name) if split is not None else nullcontext()
