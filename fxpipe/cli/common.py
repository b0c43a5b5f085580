"""What every command shares: the two consoles, one-line errors, the progress spinner and size parsing.

Nothing here imports torch, so ``fxpipe --help`` answers at once.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

# torch warns on import when NumPy is absent; fxpipe never needs NumPy, so the warning is noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from fxpipe.errors import FxpipeError, OptionError  # noqa: E402  (after the filter: it must precede torch)

out = Console()
err = Console(stderr=True)


@contextmanager
def one_line_errors() -> Iterator[None]:
    """An FxpipeError becomes one line on stderr and exit code 2; Ctrl-C exits 130."""
    try:
        yield
    except FxpipeError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(code=130) from None


@contextmanager
def progress(*, disable: bool) -> Iterator[Callable[[str, int, int], None]]:
    """A transient spinner on stderr (drawn only on a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=err, transient=True, disable=disable or not err.is_terminal)
    with bar:
        task = bar.add_task("starting", total=None)

        def step(description: str, done: int, total: int) -> None:
            bar.update(task, description=description, completed=done, total=total or None)

        yield step


_SIZE = re.compile(r"^\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
         "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str, option: str) -> float:
    """``8GiB``, ``512MB``, ``1.5e9`` -> bytes."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNIT:
        raise OptionError(f"{option} {text!r} is not a size; write e.g. 8GiB, 512MB or 1.5e9")
    return float(match.group(1)) * _UNIT[match.group(2).lower()]
