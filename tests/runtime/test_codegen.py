"""Compiled stages (``fxpipe run --codegen inductor``): the same losses as the eager stages, step after step; without
a C++ compiler one line and the eager stages; the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import Result

from fxpipe.runtime import codegen
from tests._helpers import MLP_PLAN, fxpipe_cli, ok, one_line_error, plan_fixture

plan = plan_fixture(*MLP_PLAN)  # zb-h1 on 2 stages, 4 microbatches


def _run_args(plan: Path) -> tuple[str | Path, ...]:
    """3 steps of SGD with momentum, so every gradient shows in the later losses."""
    return ("run", plan, "--steps", "3", "--momentum", "0.9", "--lr", "0.05", "--json")


@pytest.fixture(scope="module")
def eager_fallback(plan: Path) -> Result:
    """``--codegen inductor`` with no C++ compiler found: the launcher says so in one line and starts the ranks with
    ``--codegen eager``, the command line of a plain eager run. One launch for two tests: the fallback test reads its
    warning, the compiled test its losses as the eager ones (a second eager launch cost ~7 s on 2 cores)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(codegen, "cpp_compiler", lambda: None)
        return ok(fxpipe_cli(*_run_args(plan), "--codegen", "inductor"))


@pytest.mark.skipif("codegen.cpp_compiler() is None",  # as a test starts: collecting imports no Inductor
                    reason="needs a C++ compiler for Inductor's CPU code")
def test_compiled_stages_train_like_the_eager_ones(plan: Path, eager_fallback: Result) -> None:
    """zb-h1 runs F, B, W, W_set and W_acc: all five compiled graphs; 3 steps of SGD with momentum, so every
    gradient shows in the later losses."""
    eager = json.loads(eager_fallback.stdout)["losses"]
    compiled = json.loads(ok(fxpipe_cli(*_run_args(plan), "--codegen", "inductor")).stdout)["losses"]
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-6)
    assert eager[2] != eager[0]  # the steps changed the weights: the later losses check the gradients


def test_without_a_cpp_compiler_the_stages_run_eagerly_with_one_line(eager_fallback: Result) -> None:
    result = eager_fallback
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --codegen inductor needs a C++ compiler (g++ or clang on PATH) for CPU code; none "
                        "found, so the stages run eagerly"]
    assert json.loads(result.stdout)["losses"]


@pytest.mark.parametrize(("args", "words"), [
    (("--codegen", "tvm"), "Invalid value for '--codegen': 'tvm' is not one of 'eager', 'inductor'"),
    (("--codegen", "inductor", "--schedule", "async-1f1b"), "--codegen inductor compiles synchronous schedules"),
])
def test_refusals_are_one_line(plan: Path, args: tuple[str, ...], words: str) -> None:
    if "async-1f1b" in args and codegen.cpp_compiler() is None:
        pytest.skip("without a compiler --codegen inductor falls back before the schedule is checked")
    line = one_line_error(fxpipe_cli("run", plan, "--steps", "1", *args))
    assert words in line, line


def test_compiled_code_is_cached_where_the_docs_say(tmp_path: Path) -> None:
    """fxpipe run's ranks (whose temporary folder, Inductor's default, is the run's report directory, removed after
    the run) get fxpipe's cache folder, or the user's own ``TORCHINDUCTOR_CACHE_DIR``; the library leaves the
    environment alone: ``check_codegen`` in a fresh process sets no cache folder of fxpipe's (Inductor's own
    probe sets its default)."""
    import os
    import subprocess
    import sys

    from fxpipe.runtime.codegen import cache_env

    mine = str(tmp_path / "fxpipe" / "inductor")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    assert cache_env({"XDG_CACHE_HOME": "/x"}) == {"TORCHINDUCTOR_CACHE_DIR": "/x/fxpipe/inductor"}
    assert cache_env({"TORCHINDUCTOR_CACHE_DIR": "/users/own"}) == {"TORCHINDUCTOR_CACHE_DIR": "/users/own"}
    script = ("import os; from fxpipe.runtime.codegen import cache_env, check_codegen; "
              "print(cache_env(os.environ)['TORCHINDUCTOR_CACHE_DIR']); check_codegen('inductor'); "
              "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    ours, after = done.stdout.split()
    assert ours == mine and after != mine
