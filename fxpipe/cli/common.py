"""What every command shares: the two consoles, literal messages, one-line errors, signals, the progress
spinner, output checks and size parsing.

Every message is printed as text, never as rich markup: a ``[/bold]`` in a path, a module name or an
exception is printed as it is. Nothing here imports torch, so ``fxpipe --help`` answers at once.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import typer
from rich.console import Console
from rich.text import Text

# torch warns on import when NumPy is absent; fxpipe never needs NumPy, so the warning is noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from fxpipe.errors import FxpipeError, OptionError  # noqa: E402  (after the filter: it must precede torch)
from fxpipe.plan import check_schedule_size  # noqa: E402,F401  (the bound lives in fxpipe.plan.LIMITS)

out = Console()
err = Console(stderr=True)


def say(message: str, *, console: Console | None = None, style: str = "") -> None:
    """Print ``message`` literally (no markup, no highlighting, never cut): on stderr unless told."""
    (console or err).print(Text(message, style=style), highlight=False, soft_wrap=True)


class _Signalled(BaseException):
    """SIGTERM arrived: raised in the main thread so that every ``finally`` (stop the ranks, remove the
    temporary files) runs before the process exits. A BaseException, like KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum: int, frame: FrameType | None) -> None:
    raise _Signalled(signum)


@contextmanager
def one_line_errors() -> Iterator[None]:
    """An FxpipeError becomes one line on stderr and exit code 2; Ctrl-C exits 130 and SIGTERM 143,
    each after the command's cleanup ran."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_signalled) if main else None
    try:
        yield
    except FxpipeError as exc:
        err.print(Text.assemble(("error:", "bold red"), " ", str(exc)), highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    except KeyboardInterrupt:
        say("interrupted")
        raise typer.Exit(code=128 + signal.SIGINT) from None
    except _Signalled as exc:
        say(f"terminated ({signal.Signals(exc.signum).name})")
        raise typer.Exit(code=128 + exc.signum) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


TORCH_LOG = "FXPIPE_TORCH_LOG"  # a file for torch's own logged errors, which the CLI keeps off the terminal

# Every environment setting fxpipe reads (tests/cli/test_help.py finds each "FXPIPE_*" name of fxpipe/ here), shown
# under fxpipe run --help with the launcher's host flags, which reach the ranks as options, never as settings.
ENVIRONMENT = (
    ("FXPIPE_CALIBRATION", "on or off (default on): compile measures this machine's compute and the ranks their "
                           "link; off keeps the fixed cost model (compile --calibration overrides it)."),
    (TORCH_LOG, "a file for torch's own logged errors and tracebacks, which the CLI keeps off the terminal "
                "(default: dropped)."),
    ("FXPIPE_LAUNCHER_PID", "set by fxpipe run for its ranks, which leave when that process is gone; not a user "
                            "setting."),
)
HOST_FLAGS = ("--pin-ranks", "--gloo-loop-nice", "--send-yield", "--keep-freed-memory")


def run_epilog() -> str:
    """fxpipe run --help's last section: the environment settings and the launcher's host flags."""
    settings = "\n\n".join(f"{name}: {what}" for name, what in ENVIRONMENT)
    return (f"Environment settings:\n\n{settings}\n\nHost flags ({', '.join(HOST_FLAGS)}, under Host tuning) are "
            "the launcher's: fxpipe run hands them to each rank as options, and sets nothing in the environment but "
            "OMP_NUM_THREADS=1 and FXPIPE_LAUNCHER_PID for the ranks it starts.")


class _NoTorchTracebacks(logging.Filter):
    """Drops torch's logged errors and tracebacks (a failed fake-tensor run, a Dynamo guard) from the terminal:
    fxpipe says what went wrong in its one ``error:`` line. With ``$FXPIPE_TORCH_LOG`` set, they go to that
    file instead."""

    def __init__(self) -> None:
        super().__init__()
        path = os.environ.get(TORCH_LOG)
        self.file: logging.Handler | None = logging.FileHandler(path) if path else None
        if self.file is not None:
            self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is None and record.levelno < logging.ERROR:
            return True
        if self.file is not None:
            self.file.handle(record)
        return False


_QUIET = _NoTorchTracebacks.__name__


def quiet_torch_logs() -> None:
    """Once torch is imported (it sets up its loggers then): its logged errors stay off the terminal, in
    ``$FXPIPE_TORCH_LOG`` if set. For the CLI only: the library leaves logging to its caller."""
    names = [n for n in list(logging.Logger.manager.loggerDict) if n == "torch" or n.startswith("torch.")]
    shared: _NoTorchTracebacks | None = None
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if not any(type(f).__name__ == _QUIET for f in handler.filters):
                shared = shared or _NoTorchTracebacks()
                handler.addFilter(shared)


def check_writable_file(path: Path, option: str, ours: Callable[[Path], bool] | None = None) -> None:
    """Refuse an output file fxpipe could not write, before any work starts (so no result is lost).

    The file may not exist (its directory must exist and take a new file) or be one that ``ours`` says fxpipe
    wrote (``fxpipe.files``: a link, or a file of the user's, is refused). It is not touched here.
    """
    from fxpipe.files import check_new_or_ours

    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise OptionError(f"{option} {str(path)!r} is a directory; give a file path")
    check_new_or_ours(path, option, ours)
    if path.exists():
        if not os.access(path, os.W_OK):
            raise OptionError(f"{option} {str(path)!r} cannot be written (permission denied); choose another path")
        return
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise OptionError(f"{option} {str(path)!r}: {str(parent)!r} is not a directory; choose another path")
    if not parent.is_dir():
        raise OptionError(f"{option} {str(path)!r}: the directory {str(parent)!r} does not exist; create it or "
                          "choose another path")
    _probe(parent, option, path)


def check_writable_dir(path: Path, option: str) -> None:
    """Refuse an output directory fxpipe could not create or write into, before any work starts.

    Checks only that: whether an existing directory may be replaced is the writer's rule.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        return  # the writer names this case itself (e.g. "exists and is not a plan directory")
    base = path
    while not base.exists():  # the nearest existing ancestor must take the new directory
        if base.parent == base:
            break
        base = base.parent
    if not base.is_dir():
        raise OptionError(f"{option} {str(path)!r} cannot be created: {str(base)!r} is not a directory; "
                          "choose another path")
    _probe(base, option, path)
    if base == path:  # an existing directory is replaced by a sibling written next to it
        _probe(path.absolute().parent, option, path)


def _probe(directory: Path, option: str, path: Path) -> None:
    """Create and remove a file in ``directory`` (permissions alone cannot tell: root, read-only mounts)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".fxpipe-probe-", dir=directory)
    except OSError as exc:
        raise OptionError(f"{option} {str(path)!r} cannot be written ({exc.strerror or exc} in {str(directory)!r}); "
                          "choose another path") from None
    os.close(fd)
    os.unlink(name)


def check_outputs(reads: list[tuple[str, Path | None]], writes: list[tuple[str, Path | None]]) -> None:
    """Refuse, before any work, an output that would overwrite an input or another output.

    ``reads`` and ``writes`` are (what, path) pairs: for a read, ``what`` names it ("the plan directory");
    for a write, its option (``--trace``). A path is compared after resolving links (and by inode when
    both exist, for hard links); a path inside another (a file in the plan directory, a trace in the
    checkpoint directory) counts as the same place.
    """
    def place(path: Path) -> Path:
        return Path(os.path.realpath(path))

    def meet(a: Path, b: Path) -> bool:
        ra, rb = place(a), place(b)
        if ra == rb or ra.is_relative_to(rb) or rb.is_relative_to(ra):
            return True
        try:
            return a.exists() and b.exists() and os.path.samefile(a, b)
        except OSError:
            return False

    given = [(option, Path(path)) for option, path in writes if path is not None and str(path) != ""]
    for i, (option, path) in enumerate(given):
        for what, read in reads:
            if read is not None and meet(path, Path(read)):
                raise OptionError(f"{option} {str(path)!r} would overwrite {what} {str(read)!r}, which this command "
                                  "reads; write it elsewhere")
        for other, second in given[i + 1:]:
            if meet(path, second):
                raise OptionError(f"{option} {str(path)!r} and {other} {str(second)!r} are the same place (or one is "
                                  "inside the other); give each output its own path")


def write_output(path: Path, option: str, write: Callable[[Path], object]) -> None:
    """Run ``write(path)``; an OSError (disk full, removed directory) becomes one line naming the option."""
    try:
        write(path)
    except OSError as exc:
        raise OptionError(f"{option} {str(path)!r} could not be written ({exc.strerror or exc})") from None


@contextmanager
def progress(*, disable: bool) -> Iterator[Callable[[str, int, int], None]]:
    """A transient spinner on stderr (drawn only on a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=err, transient=True, disable=disable or not err.is_terminal)
    with bar:
        task = bar.add_task("starting", total=None)

        def step(description: str, done: int, total: int) -> None:
            bar.update(task, description=description, completed=done, total=total or None)

        yield step


MAX_SIMULATE_SLOTS = 500_000  # stages x microbatches for simulate alone: linear, about 10 s at this size


_SIZE = re.compile(r"^\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
         "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str, option: str) -> float:
    """``8GiB``, ``512MB``, ``1.5e9`` -> bytes."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNIT:
        raise OptionError(f"{option} {text!r} is not a size; write e.g. 8GiB, 512MB or 1.5e9")
    return float(match.group(1)) * _UNIT[match.group(2).lower()]
