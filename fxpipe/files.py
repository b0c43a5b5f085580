"""One safe way to write a file: never through a link, never over a file fxpipe did not write, whole or not at all.

``write_file(path, data, ours=...)`` writes a temporary file that it creates itself beside ``path`` (``O_CREAT |
O_EXCL | O_NOFOLLOW``: an existing name, a link included, is never opened), then renames it onto ``path``. An
existing ``path`` is replaced only when it is a regular file (not a link) that ``ours`` recognises as fxpipe's own
(a trace, an SVG, a config it wrote), or with ``overwrite``; otherwise :class:`OutputError`, one line.
``append_line`` appends to a log file fxpipe made, refusing a link in its place.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from fxpipe.errors import OutputError

__all__ = ["OutputError", "append_line", "check_new_or_ours", "write_file"]


def check_new_or_ours(path: Path, what: str, ours: Callable[[Path], bool] | None, *, overwrite: bool = False) -> None:
    """Refuse, before any work, a ``path`` that :func:`write_file` would refuse."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (the caller checks the directory)
        return
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"{what} {str(path)!r} is a symbolic link, which fxpipe does not write through; give "
                          "another path")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{what} {str(path)!r} exists and is not a regular file; give another path")
    if not overwrite and (ours is None or not ours(path)):
        raise OutputError(f"{what} {str(path)!r} exists and fxpipe did not write it; give another path, or move "
                          "that file")


def write_file(path: str | os.PathLike[str], data: str | bytes, *, what: str = "the output",
               ours: Callable[[Path], bool] | None = None, overwrite: bool = False) -> Path:
    """Write ``data`` to ``path`` whole (a new temporary file renamed onto it); see the module's docstring."""
    path = Path(path)
    check_new_or_ours(path, what, ours, overwrite=overwrite)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        check_new_or_ours(path, what, ours, overwrite=overwrite)  # again: it may have appeared meanwhile
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # our own temporary file (O_EXCL made it)
        raise
    return path


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append ``line`` to ``path`` (made if missing), refusing a link or a special file in its place."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        if os.path.islink(path):
            raise OutputError(f"{str(path)!r} is a symbolic link, which fxpipe does not write through") from None
        raise
    with os.fdopen(fd, "a", encoding="utf-8") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OutputError(f"{str(path)!r} is not a regular file; fxpipe appends only to its own logs")
        handle.write(line)
