"""The progress shown by long commands (bench, datastore) and by builds (the kernels, compiled forwards).

On a terminal, rich's bar or spinner; in a log (stderr not a terminal), a build still says what
it builds, with an estimate, in plain lines: a bar's last frame would sit above the lines that follow."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


def progress_bar(console: Console | None = None, *, counted: bool = True, remaining: bool = False,
                 transient: bool = False, show: bool = True) -> Progress:
    """Description, bar, done/total (``counted``), time elapsed (and left, ``remaining``) on
    ``console`` (default stderr). Drawn only on a terminal."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    console = console or Console(stderr=True)
    columns = [TextColumn("{task.description}"), BarColumn(), *([MofNCompleteColumn()] if counted else []),
               TimeElapsedColumn(), *([TimeRemainingColumn()] if remaining else [])]
    return Progress(*columns, console=console, transient=transient, disable=not (show and console.is_terminal))


def log_line(text: str) -> None:
    """One line on stderr, at once (a log read while the build runs shows it)."""
    print(f"specfree: {text}", file=sys.stderr, flush=True)


def on_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


@contextmanager
def building(what: str, estimate_s: float, show: bool = True) -> Iterator[None]:
    """``what`` is being built, about ``estimate_s`` seconds: a spinner on a terminal; in a log, a
    line when it starts and one with the time it took when it ends."""
    if not show:
        yield
        return
    about = f"{what} (first use: about {estimate_s:.0f} s)"
    if on_terminal():
        from rich.console import Console

        with Console(stderr=True).status(about):
            yield
        return
    log_line(f"building {about}")
    start = time.perf_counter()
    yield
    log_line(f"built {what} in {time.perf_counter() - start:.0f} s")


class StepsShown:
    """Progress through ``total`` steps of one build: rich's bar on a terminal; in a log, a line per
    step with the time so far and, from the second, an estimate of the time left (at the mean so far)."""

    def __init__(self, description: str, total: int, show: bool = True):
        self.total, self.done, self.show = total, 0, show
        self.start = time.perf_counter()
        self.bar = progress_bar(show=show, transient=True) if on_terminal() else None
        self.task = self.bar.add_task(description, total=total) if self.bar is not None else None
        if show and self.bar is None:
            log_line(f"{description}: {total} steps")

    def __enter__(self) -> StepsShown:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def starting(self, description: str) -> None:
        """The next step begins: ``description`` says which."""
        if self.bar is not None:
            self.bar.update(self.task, description=description)
        elif self.show:
            spent = time.perf_counter() - self.start
            left = f", about {spent / self.done * (self.total - self.done):.0f} s left" if self.done else ""
            log_line(f"{description} ({self.done + 1} of {self.total}, {spent:.0f} s so far{left})")

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.advance(self.task)
