"""Text is text (issue 11): brackets in a module name, a path or an exception are printed as they are, and no
table cuts a value to "…" when its output is piped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import Result
from rich.console import Console
from typer.testing import CliRunner

from fxpipe.cli.main import app
from fxpipe.render import print_reports
from fxpipe.report import Report
from tests._helpers import HANG_S

MARKUP = "x[/bold]y[bold]z[/]"  # a MarkupError in rich markup, and a style that would vanish


def fxpipe_cli(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_brackets_in_a_path_are_printed_literally(tmp_path: Path) -> None:
    out = tmp_path / MARKUP
    result = fxpipe_cli("compile", "mlp-tiny", "--out", out)
    assert result.exit_code == 0 and result.exception is None, result.output
    assert f"wrote {out} (2 stages)" in result.stderr
    result = fxpipe_cli("inspect", out)
    assert result.exit_code == 0 and f"plan{out}" in "".join(result.stdout.split())  # a long title wraps


def test_brackets_in_a_missing_path_are_one_literal_error_line(tmp_path: Path) -> None:
    result = fxpipe_cli("inspect", tmp_path / MARKUP)
    assert result.exit_code == 2 and result.exception is None or isinstance(result.exception, SystemExit)
    assert result.stderr.startswith("error: ") and MARKUP in result.stderr and "Traceback" not in result.output


def test_brackets_in_an_exception_and_a_module_name(tmp_path: Path) -> None:
    model = tmp_path / "brackets.py"
    model.write_text(textwrap.dedent(f"""\
        import torch

        def build():
            m = torch.nn.Sequential()
            m.add_module("fc[/bold]0", torch.nn.Linear(8, 8))
            m.add_module("act[bold]", torch.nn.ReLU())
            m.add_module("fc1", torch.nn.Linear(8, 8))
            return m, (torch.randn(4, 8),)

        def broken():
            raise ValueError("bad {MARKUP} value")
        """))
    result = fxpipe_cli("compile", f"{model}:broken")
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert MARKUP in result.stderr and "Traceback" not in result.output
    result = fxpipe_cli("compile", f"{model}:build", "--tracer", "fx", "--granularity", "1")
    assert result.exit_code == 0 and result.exception is None, result.output
    assert "fc[/bold]0" in result.stdout and "act[bold]" in result.stdout


def test_report_cells_titles_and_notes_are_text() -> None:
    console = Console(record=True, width=200, force_terminal=True, file=open(os.devnull, "w"))
    print_reports([Report(f"title {MARKUP}", ("col[/]", "b"), ((MARKUP, 1),), (f"note {MARKUP}",))], console=console)
    text = console.export_text()
    assert f"title {MARKUP}" in text and "col[/]" in text and f"note {MARKUP}" in text
    assert text.count(MARKUP) == 3


def test_a_narrow_terminal_folds_cells_instead_of_cutting_them() -> None:
    console = Console(record=True, width=30, force_terminal=True, file=open(os.devnull, "w"))
    long = "a_very_long_layer_name_" * 3
    print_reports([Report("t", ("name",), ((long,),))], console=console)
    text = console.export_text()
    assert "…" not in text
    assert long in "".join(line.strip("│ ") for line in text.splitlines()[4:])


def test_piped_output_keeps_every_value(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run(f"{sys.executable} -m fxpipe.cli.main compile gpt-tiny | cat", shell=True, text=True,
                          capture_output=True, env=env, timeout=HANG_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    assert " .. " in proc.stdout and "wte .." in proc.stdout  # stage names: first .. last, on one line


@pytest.mark.parametrize("plain", [False, True])
def test_models_listing_is_whole_off_a_terminal(plain: bool) -> None:
    result = fxpipe_cli("models", *(["--plain"] if plain else []))
    assert result.exit_code == 0
    assert "…" not in result.stdout
    assert "conv features + large FC classifier holding most parameters (the SplitBrain target)" in result.stdout
