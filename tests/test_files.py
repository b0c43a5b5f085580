"""fxpipe.files: the one way fxpipe writes an output file: never through a link, never over a file it did not write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fxpipe.files import OutputError, append_line, write_file


def _ours(path: Path) -> bool:
    return path.read_text().startswith("ours")


def test_a_new_file_is_written_whole_and_an_own_file_replaced(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    write_file(out, "ours 1", ours=_ours)
    write_file(out, "ours 2", ours=_ours)
    assert out.read_text() == "ours 2" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_a_users_file_a_link_and_a_special_file_are_refused_untouched(tmp_path: Path) -> None:
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's")
    outside = tmp_path / "outside.txt"
    outside.write_text("elsewhere")
    link = tmp_path / "link.txt"
    link.symlink_to(outside)
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "nowhere.txt")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="exists and fxpipe did not write it"):
        write_file(mine, "ours", what="--trace", ours=_ours)
    for path in (link, dangling):
        with pytest.raises(OutputError, match="is a symbolic link, which fxpipe does not write through"):
            write_file(path, "ours", ours=_ours)
    with pytest.raises(OutputError, match="is not a regular file"):
        write_file(fifo, "ours", ours=_ours)
    assert mine.read_text() == "the user's" and outside.read_text() == "elsewhere"
    assert not (tmp_path / "nowhere.txt").exists() and link.is_symlink()
    # A link where the temporary file would go is not opened either (O_EXCL | O_NOFOLLOW).
    (tmp_path / f".new.txt.{os.getpid()}.tmp").symlink_to(outside)
    with pytest.raises(FileExistsError):
        write_file(tmp_path / "new.txt", "ours", ours=_ours)
    assert outside.read_text() == "elsewhere"


def test_append_refuses_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("elsewhere\n")
    (tmp_path / "log.jsonl").symlink_to(outside)
    with pytest.raises(OutputError, match="symbolic link"):
        append_line(tmp_path / "log.jsonl", "{}\n")
    append_line(tmp_path / "own.jsonl", "{}\n")
    append_line(tmp_path / "own.jsonl", "{}\n")
    assert outside.read_text() == "elsewhere\n" and (tmp_path / "own.jsonl").read_text() == "{}\n{}\n"
