"""Every code block of README.md and docs/*.md (but architecture.md and glossary.md, which hold no examples) runs.

A page's fenced blocks run in order in one fresh directory (with ``examples/`` linked in), so a page's commands
may build on each other:

- ```` ```sh ````: a bash script (``set -euo pipefail``), with this interpreter's ``bin`` first on PATH: the
  commands a user types after ``source .venv/bin/activate``.
- ```` ```python ````: a script run with this interpreter; or, after ``<!-- file: NAME -->``, written to NAME
  for a later block to run (a torchrun script, a model file).
- ```` ```text ````: output, not commands; it must hold no command line.
- ``<!-- not run: REASON -->`` right before a block skips it (a GPU, several machines, Slurm, a long search);
  any other block the test does not run fails it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")
                              if p.name not in ("architecture.md", "glossary.md"))]
SHELL, PYTHON, OUTPUT = "sh", "python", "text"
COMMAND = re.compile(r"^\s*(\$ |fxpipe |torchrun |python3? |pip |sbatch |srun )", re.M)
TIMEOUT = 300


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based, of the opening fence
    lang: str
    text: str
    marker: str  # the HTML comment right before the fence ("" if none)

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The fenced blocks of ``page`` with the comment on the nearest non-blank line before each."""
    lines = (ROOT / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"{page}:{i + 1}: a code block is never closed"
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = lines[k].strip() if k >= 0 and lines[k].strip().startswith("<!--") else ""
        indent = len(opening.group(1))
        found.append(Block(page, i + 1, opening.group(2), "\n".join(ln[indent:] for ln in lines[i + 1:j]) + "\n",
                           marker))
        i = j + 1
    return found


def _skip_reason(block: Block) -> str | None:
    m = re.fullmatch(r"<!--\s*not run:\s*(.*?)\s*-->", block.marker)
    return m.group(1) if m else None


def _file_name(block: Block) -> str | None:
    m = re.fullmatch(r"<!--\s*file:\s*(\S+)\s*-->", block.marker)
    return m.group(1) if m else None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(OMP_NUM_THREADS="1", FXPIPE_CALIBRATION="off", COLUMNS="160")
    return env


def _run(block: Block, cwd: Path) -> None:
    if block.lang == SHELL:
        argv = ["bash", "-c", "set -euo pipefail\n" + block.text]
    else:
        script = cwd / f"block_{block.line}.py"
        script.write_text(block.text)
        argv = [sys.executable, script.name]
    proc = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (f"{block.where()} ({block.lang}) exited {proc.returncode}:\n{block.text}\n"
                                  f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")


@pytest.mark.parametrize("page", PAGES)
def test_every_block_of_the_page_runs_or_says_why_not(page: str, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    ran = 0
    for block in blocks(page):
        reason = _skip_reason(block)
        if block.marker and reason is None and _file_name(block) is None:
            pytest.fail(f"{block.where()}: unknown marker {block.marker!r}; use <!-- not run: REASON --> or "
                        "<!-- file: NAME -->")
        if reason is not None:
            assert reason, f"{block.where()}: <!-- not run: --> needs a reason"
            continue
        if block.lang == OUTPUT:
            assert not COMMAND.search(block.text), (f"{block.where()}: a text block holds a command; make it a sh "
                                                    "block (run) or mark it <!-- not run: REASON -->")
            continue
        assert block.lang in (SHELL, PYTHON), (f"{block.where()}: a ```{block.lang} block is neither run nor marked; "
                                               "use sh, python or text, or mark it <!-- not run: REASON -->")
        name = _file_name(block)
        if name is not None:
            assert block.lang == PYTHON, f"{block.where()}: <!-- file: --> is for python blocks"
            (tmp_path / name).write_text(block.text)
            continue
        _run(block, tmp_path)
        ran += 1
    assert ran or page != "README.md", "the README runs none of its examples"


@pytest.mark.parametrize("page", PAGES)
def test_no_command_hides_in_an_indented_block(page: str) -> None:
    """Commands go in fenced blocks (which the test above runs), never in indented ones it cannot see."""
    text = (ROOT / page).read_text()
    fenced = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    hidden = [ln for ln in fenced.splitlines() if re.match(r"^ {4,}(\$ |fxpipe |torchrun |import |pip )", ln)]
    assert not hidden, f"{page}: indented commands outside a fenced block: {hidden[:3]}"


def test_the_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(ln for ln in ci.splitlines() if ln.startswith("python3 -m venv"))
    assert command in (ROOT / "README.md").read_text()


def test_the_readme_stays_short_and_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    for page in PAGES[1:]:
        assert f"({page})" in readme, f"README.md does not link {page}"
