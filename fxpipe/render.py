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


def render_rich(report: Report, *, notes: bool = True) -> Any:
    """A rich Table with the notes as its caption (``notes=False``: without them, for a caller that prints them at
    its own width); every string is text (a ``[b]`` in a name stays), and a cell too wide for the terminal folds
    onto the next line instead of being cut to "…"."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(report.title), title_justify="left",
                  caption=Text("\n".join(report.notes)) if report.notes and notes else None, caption_justify="left")
    for i, col in enumerate(report.columns):
        numeric = bool(report.rows) and all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool)
                                            for r in report.rows)
        table.add_column(Text(str(col)), justify="right" if numeric else "left", overflow="fold")
    for row in report.rows:
        table.add_row(*(Text(_cell(v)) for v in row))
    return table


def print_reports(reports: Iterable[Report], *, plain: bool = False, console: Any = None) -> None:
    """Print reports to the terminal (rich) or as plain text.

    Off a terminal (a pipe, a file, ``| tee log``) rich would assume 80 columns and cut or fold wide
    tables, so each table is printed at its natural width instead. The notes under a table wrap to the
    console's width (the terminal's, or ``$COLUMNS``), not to the table's: a narrow table's caption would fold
    them into a column of a few words (off a terminal each note is one line).
    """
    if plain:
        for report in reports:
            print(render_text(report) + "\n")
        return
    from rich.console import Console

    console = console or Console()
    from rich.text import Text

    for report in reports:
        table = render_rich(report, notes=False)
        target = console if console.is_terminal else _wide_as(console, table)
        target.print(table)
        for note in report.notes:  # a terminal's width; off one, whole lines, as the tables are whole
            console.print(Text(note), highlight=False, soft_wrap=not console.is_terminal)
        target.print()


def _wide_as(console: Any, table: Any) -> Any:
    """A console on the same file, as wide as ``table`` wants to be (at least the console's own width)."""
    from rich.console import Console
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    return Console(file=console.file, width=max(natural, console.width), force_terminal=False,
                   no_color=console.no_color, highlight=False, stderr=console.stderr)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
