"""No output path may be an input (issue 41, "Files lost"): --trace, --svg, --out and --checkpoint-dir are refused,
in one line and before any work, where they would overwrite the plan being read or each other; and a checkpoint
directory another run holds is refused the same way."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from fxpipe.runtime import checkpoint
from tests._helpers import fxpipe_cli, ok, one_line_error


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("paths") / "plan"
    ok(fxpipe_cli("compile", "mlp-tiny", "--stages", "2", "--out", out))
    return out


def test_outputs_that_would_overwrite_the_plan_or_each_other_are_refused(plan: Path, tmp_path: Path,
                                                                        no_rank_starts: list[list[str]]) -> None:
    before = tree(plan)
    for args, says in [
        (["run", plan, "--trace", plan / "plan.json"], f"--trace '{plan / 'plan.json'}' would overwrite the plan "
                                                        f"directory '{plan}', which this command reads"),
        (["run", plan, "--checkpoint-dir", plan], "--checkpoint-dir"),
        (["run", plan, "--log-dir", plan / "logs"], f"--log-dir '{plan / 'logs'}' would overwrite the plan directory"),
        (["run", plan, "--log-dir", tmp_path / "ck", "--checkpoint-dir", tmp_path / "ck"], "are the same place"),
        (["run", plan, "--checkpoint-dir", tmp_path / "ck", "--trace", tmp_path / "ck" / "t.json"],
         "are the same place (or one is inside the other)"),
        (["simulate", plan, "--trace", plan / "stage_0.json"], "would overwrite the target"),
        (["simulate", plan, "--svg", plan / "plan.json"], "would overwrite the target"),
        (["simulate", plan, "--trace", tmp_path / "x", "--svg", tmp_path / "x"], "are the same place"),
    ]:
        line = one_line_error(fxpipe_cli(*args))
        assert says in line, (args, line)
    assert tree(plan) == before and not (tmp_path / "ck").exists()
    link = tmp_path / "link.json"  # through a link, the same file
    link.symlink_to(plan / "plan.json")
    assert "would overwrite the plan directory" in one_line_error(fxpipe_cli("run", plan, "--trace", link))
    data = tmp_path / "corpus.txt"
    data.write_text("some text " * 100)
    assert "would overwrite the --data file" in one_line_error(
        fxpipe_cli("run", plan, "--data", f"text:{data}", "--trace", data))
    model = tmp_path / "models" / "m.py"
    model.parent.mkdir()
    model.write_text("def build(): ...\n")
    assert "--out" in one_line_error(fxpipe_cli("compile", f"{model}:build", "--out", model.parent))
    assert tree(plan) == before


def test_a_checkpoint_directory_in_use_is_refused_before_any_rank_starts(plan: Path, tmp_path: Path,
                                                                         no_rank_starts: list[list[str]]) -> None:
    from tests._helpers import saved_checkpoints as _saved

    ck = _saved(tmp_path / "ck", range(1, 3))
    before = tree(ck)
    held = checkpoint.lock(ck)
    try:
        line = one_line_error(fxpipe_cli("run", plan, "--checkpoint-dir", ck, "--overwrite"))
    finally:
        held.close()
    assert line == (f"error: {ck} is in use by another fxpipe run (it holds .fxpipe.lock); wait for that run to end, "
                    "or use another checkpoint directory")
    assert tree(ck) == {**before, ".fxpipe.lock": hashlib.sha256(b"").hexdigest()}


def test_overwrite_leaves_a_symlinked_steps_target_untouched(plan: Path, tmp_path: Path,
                                                             no_rank_starts: list[list[str]]) -> None:
    from tests._helpers import saved_checkpoints as _saved

    ck, user = _saved(tmp_path / "ck", range(1, 3)), _saved(tmp_path / "user", range(5, 6))
    (ck / "step_000003").symlink_to(user / "step_000005")
    before = tree(user)
    line = one_line_error(fxpipe_cli("run", plan, "--checkpoint-dir", ck, "--overwrite"))
    assert "step_000003 is a symbolic link, which fxpipe did not make; nothing was removed" in line
    assert tree(user) == before and os.path.islink(ck / "step_000003")
    assert sorted(os.listdir(ck)) == [".fxpipe.lock", "step_000001", "step_000002", "step_000003"]
