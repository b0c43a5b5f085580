"""The plan directory belongs to its manifest (issue 41, "Files lost"): fxpipe replaces only the files its
plan.json lists with their checksums, writes a new plan beside the old one and swaps it in, and reads JSON
only within bounds of size and depth."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.errors import PlanFileError
from fxpipe.plan_dir import MAX_JSON_DEPTH, check_depth, read_json
from tests._helpers import fxpipe_cli, ok, one_line_error, tree


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[models.ZooModel, fxpipe.Pipeline, fxpipe.Pipeline]:
    zoo = models.build("mlp-tiny")
    return (zoo, fxpipe.compile(zoo.model, zoo.example_inputs, stages=2),
            fxpipe.compile(zoo.model, zoo.example_inputs, stages=3))


def test_compile_into_a_directory_with_a_foreign_plan_json_exits_2_and_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "work"
    out.mkdir()
    (out / "plan.json").write_text('{"my": "travel plan"}')
    (out / "stage_0.py").write_text("print('mine')\n")
    before = tree(tmp_path)
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", "--out", out))
    assert line.startswith(f"error: {out} holds a plan.json whose manifest fxpipe cannot check")
    assert "--overwrite" in line
    assert tree(tmp_path) == before
    # --overwrite replaces them, and names what it replaced
    result = ok(fxpipe_cli("compile", "mlp-tiny", "--stages", "2", "--out", out, "--overwrite"))
    assert f"note: --overwrite replaced plan.json, stage_0.py in {out}, which fxpipe had not written" in result.stderr
    assert fxpipe.load(out).num_stages == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_a_users_stage_file_in_the_new_plans_way_is_refused(
    saved: tuple[models.ZooModel, fxpipe.Pipeline, fxpipe.Pipeline], tmp_path: Path,
) -> None:
    _, two, three = saved
    out = tmp_path / "plan"
    fxpipe.save(two, out)
    (out / "stage_2.py").write_text("# the user's stage 2 notes\n")  # not in the manifest
    before = tree(tmp_path)
    with pytest.raises(PlanFileError, match=r"holds stage_2\.py, which fxpipe did not write .*nothing was written"):
        fxpipe.save(three, out)
    assert tree(tmp_path) == before
    # A file fxpipe wrote and the user edited is no longer fxpipe's either: refused before any compile
    (out / "stage_2.py").unlink()
    (out / "stage_1.py").write_text((out / "stage_1.py").read_text() + "# my edit\n")
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", "--out", out))
    assert "holds stage_1.py, which fxpipe did not write (or which changed since" in line
    replaced: list[str] = []
    fxpipe.save(three, out, overwrite=True, replaced=replaced)
    assert replaced == ["stage_1.py"] and fxpipe.load(out).num_stages == 3


def test_a_failed_recompile_leaves_the_old_plan_whole_and_the_next_one_is_not_refused(
    saved: tuple[models.ZooModel, fxpipe.Pipeline, fxpipe.Pipeline], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    zoo, two, three = saved
    out = tmp_path / "plan"
    fxpipe.save(two, out)
    (out / "NOTES.txt").write_text("mine")
    (out / "stage_2.json").mkdir()  # a directory in the way of the new plan's stage 2
    before = tree(tmp_path)
    with pytest.raises(PlanFileError, match=r"stage_2\.json is in the way|holds stage_2\.json"):
        fxpipe.save(three, out, overwrite=True)
    assert tree(tmp_path) == before
    (out / "stage_2.json").rmdir()
    # A failure at the swap itself (the last rename): everything moved back, the old plan loads.
    real = os.replace
    calls: list[tuple[str, str]] = []

    def failing(src: Any, dst: Any) -> None:
        calls.append((str(src), str(dst)))
        if str(dst) == str(out) and Path(src).name.startswith(".plan.") and ".old." not in Path(src).name:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    before = tree(tmp_path)
    with pytest.raises(PlanFileError, match="No space left on device"):
        fxpipe.save(three, out)
    monkeypatch.setattr(os, "replace", real)
    assert any(dst == str(out) for _, dst in calls)  # it did reach the swap
    assert tree(tmp_path) == before
    torch.testing.assert_close(fxpipe.load(out)(*zoo.example_inputs), two(*zoo.example_inputs))
    fxpipe.save(three, out)  # not refused
    assert fxpipe.load(out).num_stages == 3 and (out / "NOTES.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_links_in_the_plan_directory_are_moved_as_links_never_followed(
    saved: tuple[models.ZooModel, fxpipe.Pipeline, fxpipe.Pipeline], tmp_path: Path,
) -> None:
    _, two, three = saved
    out, user = tmp_path / "plan", tmp_path / "user"
    user.mkdir()
    (user / "data.txt").write_text("precious")
    fxpipe.save(two, out)
    (out / "data").symlink_to(user)
    (out / "stage_2.pt").symlink_to(user / "data.txt")  # a link where the new plan writes
    before = tree(user)
    with pytest.raises(PlanFileError, match=r"stage_2\.pt"):
        fxpipe.save(three, out)
    with pytest.raises(PlanFileError, match=r"is not a file \(a folder or a link\)"):
        fxpipe.save(three, out, overwrite=True)
    (out / "stage_2.pt").unlink()
    fxpipe.save(three, out)
    assert os.readlink(out / "data") == str(user) and tree(user) == before
    link = tmp_path / "link"
    link.symlink_to(out)
    with pytest.raises(PlanFileError, match="is a symbolic link"):
        fxpipe.save(two, link)


def test_a_plan_without_checksums_for_every_file_still_loads_but_is_not_overwritten(
    saved: tuple[models.ZooModel, fxpipe.Pipeline, fxpipe.Pipeline], tmp_path: Path,
) -> None:
    zoo, two, _ = saved
    out = tmp_path / "plan"
    fxpipe.save(two, out)
    doc = json.loads((out / "plan.json").read_text())  # as an older fxpipe wrote it: no checksum of the .py files
    doc["sha256"] = {k: v for k, v in doc["sha256"].items() if not k.endswith(".py")}
    (out / "plan.json").write_text(json.dumps(doc))
    torch.testing.assert_close(fxpipe.load(out)(*zoo.example_inputs), two(*zoo.example_inputs))
    ok(fxpipe_cli("inspect", out))
    before = tree(tmp_path)
    assert "stage_0.py, stage_1.py, which fxpipe did not write" in one_line_error(
        fxpipe_cli("compile", "mlp-tiny", "--out", out))
    assert tree(tmp_path) == before


@pytest.mark.parametrize("which", ["plan.json", "stage_0.json"])
def test_deeply_nested_json_is_one_line(
    saved: tuple[models.ZooModel, fxpipe.Pipeline, fxpipe.Pipeline], tmp_path: Path, which: str,
) -> None:
    out = tmp_path / "plan"
    fxpipe.save(saved[1], out)
    (out / which).write_text("[" * 200_000 + "]" * 200_000)
    if which != "plan.json":  # the checksum would refuse it first: record the nested file's own
        doc = json.loads((out / "plan.json").read_text())
        doc["sha256"][which] = hashlib.sha256((out / which).read_bytes()).hexdigest()
        (out / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PlanFileError, match=rf"{which} nests arrays or objects deeper than the {MAX_JSON_DEPTH} "
                                            r"levels"):
        fxpipe.load(out)
    if which == "plan.json":
        assert f"{which} nests arrays" in one_line_error(fxpipe_cli("inspect", out))


def test_the_bounded_reader(tmp_path: Path) -> None:
    file = tmp_path / "x.json"
    file.write_text(json.dumps({"a": [[[1]]]}))
    assert read_json(file, max_bytes=100) == {"a": [[[1]]]}
    with pytest.raises(ValueError, match="nests arrays or objects deeper than the 3 levels"):
        read_json(file, max_bytes=100, max_depth=3)
    with pytest.raises(ValueError, match=r"is 14 bytes, more than the 10 fxpipe reads"):
        read_json(file, max_bytes=10)
    file.write_bytes(b"\xff")
    with pytest.raises(ValueError, match="is not UTF-8"):
        read_json(file, max_bytes=10)
    deep: Any = 1
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper than"):
        check_depth(deep)


def test_recompiling_keeps_the_directory_s_mode_and_out_dot_names_the_directory(
        saved: tuple[models.ZooModel, fxpipe.Pipeline, fxpipe.Pipeline], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is swapped in by renaming a new directory onto the old one: it takes the old one's mode (mkdtemp's
    0o700 did, before), and ``--out .`` from inside a plan directory writes that directory (it was EINVAL)."""
    _, pipe, _ = saved
    out = fxpipe.save(pipe, tmp_path / "plan")
    out.chmod(0o750)
    (out / "NOTES.txt").write_text("mine")
    fxpipe.save(pipe, out)
    assert out.stat().st_mode & 0o777 == 0o750 and (out / "NOTES.txt").read_text() == "mine"
    monkeypatch.chdir(out)
    ok(fxpipe_cli("compile", "mlp-tiny", "--stages", "2", "--out", "."))
    assert (tmp_path / "plan" / "NOTES.txt").read_text() == "mine" and (tmp_path / "plan" / "plan.json").is_file()
    assert (tmp_path / "plan").stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_a_save_stopped_by_a_file_size_limit_says_so(tmp_path: Path) -> None:
    """Under ``ulimit -f`` torch's zip writer reported 'unexpected pos 704 vs 598'; the line names the file and
    the likely causes (a child process: the limit is process-wide)."""
    import subprocess
    import sys

    script = (f"import resource, fxpipe\nfrom fxpipe import models\nfrom fxpipe.errors import PlanFileError\n"
              f"zoo = models.build('mlp-small')\npipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)\n"
              f"resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))\n"
              f"try:\n    fxpipe.save(pipe, {str(tmp_path / 'plan')!r})\nexcept PlanFileError as exc:\n    "
              "print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "could not be written whole: the disk is full, or a file-size limit (ulimit -f) stopped it" in proc.stdout
    assert not (tmp_path / "plan").exists()  # nothing half-written in its place
