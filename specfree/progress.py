"""The one progress bar of long commands (bench, datastore, building compiled graphs)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def progress_bar(console: Console | None = None, *, counted: bool = True, remaining: bool = False,
                 transient: bool = False, show: bool = True) -> Progress:
    """Description, bar, done/total (``counted``), time elapsed (and left, ``remaining``) on
    ``console`` (default stderr). Drawn only on a terminal: in a log, its last frame would sit
    above the lines that follow."""
    console = console or Console(stderr=True)
    columns = [TextColumn("{task.description}"), BarColumn(), *([MofNCompleteColumn()] if counted else []),
               TimeElapsedColumn(), *([TimeRemainingColumn()] if remaining else [])]
    return Progress(*columns, console=console, transient=transient, disable=not (show and console.is_terminal))
