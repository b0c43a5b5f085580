"""Checkpoints never lose or reach outside (issue 41, "Files lost"): every file's checksum is recorded when it is
written and checked on resume, cleanup removes only what fxpipe's record lists and never through a link, a lock
keeps a second run out, and the JSON and the metadata are read within bounds."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from fxpipe.errors import CheckpointError
from fxpipe.runtime import checkpoint
from tests._helpers import OneRank as _OneRank, load_checkpoints as _load, saved_checkpoints as _saved, tree


def xor_same_size(file: Path, start: int = 0, length: int = 10_000) -> None:
    data = bytearray(file.read_bytes())
    end = min(len(data), start + length)
    for i in range(start, end):
        data[i] ^= 0x5A
    file.write_bytes(bytes(data))


def test_a_same_size_corruption_is_passed_over_naming_the_bad_step(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 4))
    data = root / "step_000003" / "__0_0.distcp"
    size = data.stat().st_size
    xor_same_size(data, start=size // 2)
    assert data.stat().st_size == size
    step, warned, rt = _load(root)
    assert step == 2 and rt.loaded is not None and rt.loaded["params"]["a.weight"][0, 0] == 2.0
    assert warned == ["step_000003 is corrupt (__0_0.distcp does not match the checksum recorded when it was written); "
                      "resuming from step_000002"]
    info = json.loads((root / "step_000002" / checkpoint.MARKER).read_text())
    assert set(info["sha256"]) == {".metadata", "__0_0.distcp"}


def test_a_symlinked_step_is_neither_read_nor_removed_and_its_target_is_untouched(tmp_path: Path) -> None:
    user = tmp_path / "user"
    root = _saved(tmp_path / "ck", range(1, 3))
    _saved(user, range(7, 8))  # a real checkpoint step elsewhere, with the files cleanup would remove
    (root / "step_000009").symlink_to(user / "step_000007")
    before = tree(user)
    step, warned, _ = _load(root)
    assert step == 2 and warned[0].startswith("step_000009 is a symbolic link")
    with pytest.raises(CheckpointError, match=r"step_000009 is a symbolic link, which fxpipe did not make; nothing "
                                              "was removed"):
        checkpoint.clear(root)
    assert tree(user) == before and sorted(os.listdir(root)) == ["step_000001", "step_000002", "step_000009"]
    # pruning (keep 1) removes fxpipe's steps and leaves the link and its target
    (root / "step_000000").symlink_to(user / "step_000007")
    checkpoint.save(_OneRank(3.0), root, 3, keep=1)
    assert sorted(os.listdir(root)) == ["step_000000", "step_000003", "step_000009"] and tree(user) == before
    # a step saved where a link of its name is refuses, and writes nothing through it
    (root / "step_000004").symlink_to(user / "step_000007")
    with pytest.raises(CheckpointError, match="step_000004 is a symbolic link, which fxpipe does not write through"):
        checkpoint.save(_OneRank(4.0), root, 4)
    assert tree(user) == before


def test_a_users_file_named_like_dcps_is_not_removed(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 3))
    mine = root / "step_000005"
    mine.mkdir()
    (mine / ".metadata").write_text("the user's own")  # no fxpipe record lists it
    with pytest.raises(CheckpointError, match=r"step_000005 holds \.metadata, which fxpipe did not write"):
        checkpoint.clear(root)
    checkpoint.save(_OneRank(6.0), root, 6, keep=1)  # pruning passes over it too
    assert (mine / ".metadata").read_text() == "the user's own"
    (root / "step_000006" / "notes.txt").write_text("mine")  # a user's file inside a step fxpipe wrote
    checkpoint.save(_OneRank(7.0), root, 7, keep=1)
    assert (root / "step_000006" / "notes.txt").read_text() == "mine"


def test_a_second_writer_is_refused_by_the_lock(tmp_path: Path) -> None:
    held = checkpoint.lock(tmp_path / "ck")
    try:
        with pytest.raises(CheckpointError, match=r"ck is in use by another fxpipe run \(it holds \.fxpipe\.lock\)"):
            checkpoint.lock(tmp_path / "ck")
    finally:
        held.close()
    checkpoint.lock(tmp_path / "ck").close()  # released


def test_a_deeply_nested_record_is_passed_over_in_one_line(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 3))
    (root / "step_000002" / checkpoint.MARKER).write_text("[" * 200_000 + "]" * 200_000)
    step, warned, _ = _load(root)
    assert step == 1 and warned == [f"step_000002 is corrupt ({checkpoint.MARKER} nests arrays or objects deeper than "
                                    "the 100 levels fxpipe reads); resuming from step_000001"]


def test_metadata_claiming_more_elements_than_its_files_hold_is_passed_over(tmp_path: Path) -> None:
    root = _saved(tmp_path / "ck", range(1, 3))
    file = root / "step_000002" / ".metadata"
    md = checkpoint.read_metadata(file)
    item = md.state_dict_metadata["optim.state.a.weight.momentum_buffer"]
    md.state_dict_metadata["optim.state.a.weight.momentum_buffer"] = type(item)(
        properties=item.properties, size=torch.Size([10**13]), chunks=item.chunks)
    buffer = io.BytesIO()
    pickle.dump(md, buffer)
    file.write_bytes(buffer.getvalue())
    marker = root / "step_000002" / checkpoint.MARKER  # the checksum recorded as if it had been written so
    info = json.loads(marker.read_text())
    info["sha256"][".metadata"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    marker.write_text(json.dumps(info))
    step, warned, _ = _load(root)
    assert step == 1 and len(warned) == 1
    assert warned[0].startswith("step_000002 is corrupt (.metadata says optim.state.a.weight.momentum_buffer holds "
                                "10,000,000,000,000 elements, more than the ")
