"""Every command's rendered ``--help`` shows each option's default and its whole help text (rich once swallowed
``[default: ...]`` as markup); ``fxpipe run --help`` names every FXPIPE_* setting and the launcher's host flags."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from fxpipe.cli.main import app

ROOT = Path(__file__).parents[2]
WIDE = {"COLUMNS": "400", "TERMINAL_WIDTH": "400"}


def _commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    return {"": group, **group.commands}  # type: ignore[attr-defined]


def _help(name: str) -> str:
    result = CliRunner().invoke(app, [*([name] if name else []), "--help"], env=WIDE)
    assert result.exit_code == 0, result.output
    return result.stdout


def _flat(text: str) -> str:
    """Text with the table's borders and every space and line break removed: wrapping cannot hide a word."""
    return re.sub(r"[\s│╭╮╰╯─]", "", text)


def _rows(rendered: str) -> list[str]:
    """Each option's row of the rendered help (its first line and the lines that continue it)."""
    rows: list[list[str]] = []
    for line in rendered.splitlines():
        inner = line.strip().strip("│").rstrip()
        if re.match(r"^\s(\*\s+)?-", inner) or re.match(r"^\s\*?\s*[a-z_]+\s+<", inner):
            rows.append([inner])
        elif rows and inner.startswith("  ") and inner.strip():
            rows[-1].append(inner)
        elif not inner.strip() or line.startswith(("╰", "╭")):
            if rows and rows[-1] != ["<end>"]:
                rows.append(["<end>"])
    return [" ".join(r) for r in rows if r != ["<end>"]]


def _shown_default(param: Any) -> str | None:
    """What ``[default: ...]`` must say for ``param``, or None when it has no default to show (None, a bare flag that
    is off, or an option that words its own default in its help text)."""
    if param.default is None or getattr(param, "show_default", True) is False:
        return None
    if getattr(param, "is_flag", False):
        if param.secondary_opts:
            return (param.opts[0] if param.default else param.secondary_opts[0]).lstrip("-")
        return None if param.default is False else str(param.default)
    default = getattr(param.default, "value", param.default)  # an enum shows its value
    if isinstance(default, (list, tuple)):
        return ", ".join(map(str, default)) if default else None
    return str(default)


@pytest.mark.parametrize("name", list(_commands()))
def test_every_option_shows_its_default_and_its_whole_help(name: str) -> None:
    rendered = _help(name)
    command = _commands()[name]
    assert _flat(command.help or "") in _flat(rendered), f"fxpipe {name}: its description is cut"
    rows = _rows(rendered)
    checked = 0
    for param in command.params:
        if getattr(param, "hidden", False) or param.name == "help":
            continue
        flag = next((o for o in param.opts if o.startswith("--")), param.name)
        row = [r for r in rows if re.match(rf"^\s*(\*\s+)?{re.escape(flag)}(\s|,|$)", r)]
        assert len(row) == 1, f"fxpipe {name}: {flag}: {len(row)} rows in\n{rendered}"
        if param.help:  # the help text whole: no [...] taken for markup
            assert _flat(param.help).replace("\\[", "[") in _flat(row[0]), f"fxpipe {name} {flag}: {row[0]}"
        default = _shown_default(param)
        if default is not None:
            assert f"[default: {default}]" in row[0], f"fxpipe {name} {flag}: no [default: {default}] in {row[0]}"
            checked += 1
    assert checked or name in ("", "models", "inspect"), f"fxpipe {name}: no option with a default was checked"


def test_run_help_names_every_fxpipe_setting_and_the_host_flags() -> None:
    """Every FXPIPE_* name the sources read or set is in ``fxpipe run --help`` (found by grepping fxpipe/)."""
    names = set()
    for path in (ROOT / "fxpipe").rglob("*.py"):
        names |= set(re.findall(r"[\"'](FXPIPE_[A-Z_]+)[\"']", path.read_text()))
    assert {"FXPIPE_CALIBRATION", "FXPIPE_TORCH_LOG"} <= names
    shown = _flat(_help("run"))
    for setting in sorted(names):
        assert _flat(setting) + ":" in shown, setting
    for flag in ("--pin-ranks", "--gloo-loop-nice", "--send-yield", "--keep-freed-memory", "--nnodes", "--master-addr",
                 "--rdzv-endpoint"):
        assert flag in shown, flag
