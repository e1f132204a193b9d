"""Tables of summary rows: a rich table for the terminal and the same cells as Markdown."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from specfree.bench import methods, predicted
from specfree.bench.metrics import OVERALL, PHASES, Row

HEADERS = ("task", "system", "prompts", "new tokens", "wall s", "tokens/s", "prompt tok/s", "decode tok/s",
           "speedup", "accepted/step", "rows/step kept/offered", "split % draft/mask/fwd/verify/other", "identical")
SHORT_HEADERS = ("task", "system", "n", "tokens", "wall s", "tok/s", "prompt t/s", "decode t/s", "speedup", "acc/step",
                 "rows k/o", "d/m/f/v/o %", "identical")


def wide_console() -> Console:
    """stdout; when it is not a terminal (a log file, a pipe), wide enough that cells do not wrap."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _num(value: float | None, fmt: str, spread: tuple[float, float] | None = None, suffix: str = "") -> str:
    if value is None:
        return "–"
    text = f"{value:{fmt}}{suffix}"
    if spread is not None and spread[0] != spread[1]:
        text += f" ({spread[0]:{fmt}}–{spread[1]:{fmt}})"
    return text


def cells(row: Row) -> list[str]:
    """The table cells of one row; ranges are min–max over repeats."""
    spread = row.repeats > 1
    split = "/".join(f"{100 * row.split[k]:.0f}" for k in PHASES) if row.split else "–"
    identical = f"{row.identical}/{row.compared}" if row.compared else "–"
    if row.errors:
        identical += f" ({row.errors} failed)"
    return [row.category, row.system, str(row.prompts), f"{row.new_tokens:.0f}", f"{row.wall_s:.2f}",
            _num(row.tokens_per_s, ".1f", row.tokens_per_s_range if spread else None),
            _num(row.prompt_tokens_per_s, ".0f"), _num(row.decode_tokens_per_s, ".1f"),
            _num(row.speedup, ".2f", row.speedup_range if spread else None, "x"),
            _num(row.mean_accepted, ".2f"),
            f"{row.rows_per_step[0]:.1f}/{row.rows_per_step[1]:.1f}" if row.rows_per_step else "–", split, identical]


def rich_table(rows: Sequence[Row], title: str | None = None) -> Table:
    table = Table(*SHORT_HEADERS, title=title, header_style="bold",
                  caption="prompt/decode t/s: the prefill and the decode loop apart; split: share of step time in "
                          "draft/mask/forward/verify/other; ranges: min–max over repeats")
    for col in table.columns[2:]:
        col.justify = "right"
    table.columns[1].overflow = "fold"
    for i, row in enumerate(rows):
        last_of_task = i + 1 == len(rows) or rows[i + 1].category != row.category
        style = "bold" if row.category == OVERALL else None
        table.add_row(*cells(row), style=style, end_section=last_of_task)
    return table


def markdown_table(headers: Sequence[str], body: Sequence[Sequence[str]], left: int = 2) -> str:
    """A GitHub Markdown table; the first ``left`` columns are text, the rest right-aligned numbers."""
    def line(values):
        return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"

    align = ["---" if i < left else "---:" for i in range(len(headers))]
    return "\n".join([line(headers), "| " + " | ".join(align) + " |", *map(line, body)])


def speedup_matrix(rows: Sequence[Row]) -> tuple[list[str], list[list[str]]]:
    """Systems down, tasks across: the speedup of each (Spec-Bench's usual view)."""
    tasks = list(dict.fromkeys(r.category for r in rows))
    names = list(dict.fromkeys(r.system for r in rows))
    lookup = {(r.category, r.system): r for r in rows}
    body = [[name, *(_num(lookup[(t, name)].speedup, ".2f", suffix="x") if (t, name) in lookup else "–"
                     for t in tasks)] for name in names]
    return ["system", *tasks], body


def method_section(rows: Sequence[methods.MethodRow]) -> str:
    """Per method: measured here against the same path's autoregressive loop, beside its paper."""
    if not rows:
        return ""
    parts = ["## Per method: measured here, and what its paper reports",
             markdown_table(methods.HEADERS, [methods.cells(r) for r in methods.overall(rows)],
                            left=methods.TEXT_COLUMNS),
             "Speedup over the same path's autoregressive loop (compiled strategies over "
             "`autoregressive (compiled)`, eager ones over `autoregressive`), per task:",
             markdown_table(*methods.speedup_matrix(rows), left=1)]
    notes = methods.sources(rows)
    if notes:
        parts.append("Papers' numbers are their own headline results on their models and GPUs, read from: "
                     + "; ".join(notes) + ". A dash: not found there.")
    return "\n\n".join(parts)


def rich_method_table(rows: Sequence[methods.MethodRow]) -> Table:
    table = Table("system", "path", "paper", "its setting", "acc/step", "paper", "speedup (same path)", "paper",
                  "rows k/o", title="Per method, beside its paper's own numbers", header_style="bold")
    for col in table.columns[methods.TEXT_COLUMNS:]:
        col.justify = "right"
    for col in table.columns[:methods.TEXT_COLUMNS]:
        col.overflow = "fold"
    for row in methods.overall(rows):
        table.add_row(*methods.cells(row))
    return table


def members_section(rows: Sequence[Row]) -> str:
    """Whose drafts were accepted, for every system drafting from more than one source (a hybrid)."""
    body = []
    for row in rows:
        if row.category == OVERALL and row.accepted_by and len(row.accepted_by) > 1:
            total = sum(row.accepted_by.values())
            ranked = sorted(row.accepted_by.items(), key=lambda item: -item[1])
            body.append([row.system, str(total), " · ".join(
                f"{source} {count} ({count / total:.0%})" for source, count in ranked)])
    if not body:
        return ""
    return "\n\n".join(["## Accepted drafts by member (all prompts)",
                         markdown_table(["system", "accepted drafted tokens", "by member"], body, left=3)])


def pricing_section(rows: Sequence[Row]) -> str:
    """The report's table of predicted beside measured, one row per priced system."""
    body = [predicted.cells(row.system, row.priced) for row in rows
            if row.category == OVERALL and row.priced and row.priced["steps"]]
    if not body:
        return ""
    return "\n\n".join([
        "## Pricing: predicted beside measured (all prompts)",
        "Each priced step's forward time on the curve it was priced on (at its context), beside the "
        "forward's measured time; the drafted tokens it expected accepted, beside those the model accepted "
        "(per drafter: a node's drafter as the tree records it). Ratios of sums; 1.00 is a price that "
        "matches the machine.",
        markdown_table(predicted.HEADERS, body, left=1)])


def markdown(rows: Sequence[Row], title: str | None = None, notes: Sequence[str] = (),
             sections: Sequence[str] = ()) -> str:
    """The whole report: speedup per task, the detailed table, then ``sections`` (Markdown)."""
    parts = [f"# {title}"] if title else []
    parts += ["## Speedup vs autoregressive (same run)", markdown_table(*speedup_matrix(rows), left=1),
              "## Details", markdown_table(HEADERS, [cells(r) for r in rows])]
    parts += [s for s in sections if s]
    if notes:
        parts.append("\n".join(f"- {n}" for n in notes))
    return "\n\n".join(parts) + "\n"
