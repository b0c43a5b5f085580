"""Reports to text: deterministic plain tables (tabulate) for logs and goldens, rich tables for terminals."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fxpipe.report import Report


def render_text(report: Report) -> str:
    """A plain-text table: the title, the grid, then the notes; stable for golden files."""
    from tabulate import tabulate

    body = tabulate([list(r) for r in report.rows], headers=list(report.columns), tablefmt="simple",
                    disable_numparse=True)
    lines = [report.title, body, *(f"  {n}" for n in report.notes)]
    return "\n".join(lines)


def render_rich(report: Report) -> Any:
    """A rich Table with the notes as its caption."""
    from rich.table import Table

    table = Table(title=report.title, title_justify="left", caption="\n".join(report.notes) or None,
                  caption_justify="left")
    for i, col in enumerate(report.columns):
        numeric = bool(report.rows) and all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool)
                                            for r in report.rows)
        table.add_column(col, justify="right" if numeric else "left")
    for row in report.rows:
        table.add_row(*(_cell(v) for v in row))
    return table


def print_reports(reports: Iterable[Report], *, plain: bool = False, console: Any = None) -> None:
    """Print reports to the terminal (rich) or as plain text."""
    if plain:
        for report in reports:
            print(render_text(report) + "\n")
        return
    from rich.console import Console

    console = console or Console()
    for report in reports:
        console.print(render_rich(report))
        console.print()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
