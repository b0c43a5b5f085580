"""Every code block of README.md and docs/*.md (but architecture.md and glossary.md, which hold no examples) runs.

A page's fenced blocks run in order in one fresh working directory (with ``examples/`` linked in), so a page's
commands may build on each other:

- ```` ```sh ````: commands, one by one, as a user types them after ``source .venv/bin/activate``: ``fxpipe ...``
  through its entry point in this process (a torch import saved per command), anything else (torchrun, ...) in
  bash with this interpreter's ``bin`` first on PATH.
- ```` ```python ````: a script, run as ``__main__`` in this process; or, after ``<!-- file: NAME -->``, written
  to NAME for a later block to run (a torchrun script, a model file).
- ```` ```text ````: output, not commands; it must hold no command line.
- ``<!-- not run: REASON -->`` right before a block skips it (a GPU, several machines, Slurm, a long search);
  any other block the test does not run fails it.
"""

from __future__ import annotations

import copy
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fxpipe
from fxpipe.cli.main import app
from tests._helpers import forked_ranks

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


def _commands(text: str) -> list[list[str]]:
    """A shell block's commands: continuation lines joined, comments dropped, each split as the shell would."""
    return [argv for line in re.sub(r"\\\n\s*", " ", text).splitlines() if (argv := shlex.split(line, comments=True))]


def _run_sh(block: Block, cwd: Path) -> None:
    """Each ``fxpipe ...`` command (with at most a ``> FILE``) runs in this process, as the installed command's
    entry point does (it saves a Python start and a torch import per command); anything else runs in bash."""
    for argv in _commands(block.text):
        into = None
        if len(argv) > 2 and argv[-2] == ">":
            argv, into = argv[:-2], argv[-1]
        if argv[0] != "fxpipe" or any(t in ("|", "&&", "||", ";", "<", ">", ">>", "2>") for t in argv):
            command = shlex.join(argv) + (f" > {shlex.quote(into)}" if into else "")
            proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + command], cwd=cwd, env=os.environ.copy(),
                                  capture_output=True, text=True, timeout=TIMEOUT)
            assert proc.returncode == 0, (f"{block.where()}: {command} exited {proc.returncode}:\n"
                                          f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
            continue
        result = CliRunner().invoke(app, argv[1:])
        assert result.exit_code == 0 and result.exception is None, (
            f"{block.where()}: {shlex.join(argv)} exited {result.exit_code} ({result.exception!r}):\n"
            f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
        if into:
            (cwd / into).write_text(result.stdout)


def _run_python(block: Block, cwd: Path) -> None:
    """A python block as a script (``__main__``), in this process."""
    script = cwd / f"block_{block.line}.py"
    script.write_text(block.text)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except BaseException as exc:
        pytest.fail(f"{block.where()} raised {type(exc).__name__}: {exc}\n{block.text}")


@pytest.mark.parametrize("page", PAGES)
def test_every_block_of_the_page_runs_or_says_why_not(page: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for name, value in {"OMP_NUM_THREADS": "1", "FXPIPE_CALIBRATION": "off", "COLUMNS": "160"}.items():
        monkeypatch.setenv(name, value)
    for name in [k for k in os.environ if k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))]:
        monkeypatch.delenv(name)
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
        if block.lang == SHELL:
            _run_sh(block, tmp_path)
        else:
            _run_python(block, tmp_path)
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


# -- the torchrun recipe (docs/python.md's train.py) on Hugging Face models -----------------------------------------

STEPS = 3


def _recipe() -> str:
    script = [b for b in blocks("docs/python.md") if _file_name(b) == "train.py"]
    assert len(script) == 1, "docs/python.md lost its torchrun recipe (<!-- file: train.py -->)"
    return script[0].text


def _gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, use_cache=False, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_the_recipe_trains_a_hugging_face_plan_like_one_process(make, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = make().double().train()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 96, (8, 16), generator=gen), torch.randint(0, 96, (8, 16), generator=gen))
               for _ in range(STEPS)]
    eager = copy.deepcopy(model)
    plan = fxpipe.save(fxpipe.compile(model, (batches[0][0][:2],), stages=2), tmp_path / "plan")  # one microbatch
    torch.save(batches, tmp_path / "batches.pt")
    namespace: dict[str, object] = {}
    exec(compile(_recipe().split("# A plan directory")[0], "docs/python.md recipe", "exec"), namespace)  # its loss_fn
    loss_fn = namespace["loss_fn"]

    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    expected = []
    for inputs, target in batches:
        opt.zero_grad()
        loss = loss_fn(eager(inputs), target)  # type: ignore[operator]
        loss.backward()
        opt.step()
        expected.append(loss.item())

    script = tmp_path / "train.py"
    script.write_text(_recipe() + '\nassert "transformers" not in sys.modules, '
                      '"the recipe imported the model library"\n')
    # 2 ranks as torchrun starts them, forked from the preloaded forkserver (the page's own torchrun command runs
    # under torchrun in the test above); the forkserver never imports transformers, so the check above still holds
    ranks = forked_ranks(2, [str(script), str(plan), str(tmp_path / "batches.pt")], cwd=tmp_path, timeout=TIMEOUT)
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-3000:]
    stdout = "".join(rank.stdout for rank in ranks)
    losses = [float(x) for x in re.findall(r"^loss (\S+)$", stdout, re.M)]
    assert len(losses) == STEPS, stdout
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-7, atol=1e-8)
    assert len(set(expected)) == STEPS  # the weights moved between steps


# -- the reference pages stay references: RESULTS has no dated headings, neither page grows into a notebook ----------

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = {ARCHITECTURE: 550, RESULTS: 820}  # issue 63: about 500 and about 800, with some room
_MONTH = (r"(Jan(uary)?|Feb(ruary)?|Mar(ch)?|Apr(il)?|May|June?|July?|Aug(ust)?|Sep(t(ember)?)?|Oct(ober)?|"
          r"Nov(ember)?|Dec(ember)?)\b\.?")
DATE = re.compile(rf"\b(19|20)\d\d-(0[1-9]|1[0-2])\b|\b{_MONTH}\s+\d{{1,2}}\b|\b\d{{1,2}}\s+{_MONTH}\b"
                  rf"|\b{_MONTH}\s+(19|20)\d\d\b")


def dated_headings(text: str) -> list[str]:
    """The headings (lines starting with '#', outside fenced blocks) that carry a date."""
    fenced = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return [ln for ln in fenced.splitlines() if ln.startswith("#") and DATE.search(ln)]


def test_no_results_heading_carries_a_date() -> None:
    dated = dated_headings(RESULTS.read_text())
    assert not dated, ("benchmarks/RESULTS.md is one current table per benchmark; a date belongs under the table "
                       f"(better: the commit) and the history in git, not in a heading: {dated}")


@pytest.mark.parametrize("page", sorted(MAX_LINES), ids=lambda p: p.name)
def test_the_reference_pages_stay_short(page: Path) -> None:
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES[page], (f"{page.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES[page]}): "
                                      "measured numbers go to benchmarks/RESULTS.md, history to git")


def test_the_date_check_can_fail() -> None:
    for heading in ("## Stage count (2026-12-07)", "### Send yield, 2026-12", "## Runs of Dec 7", "## 7 Dec runs",
                    "## Test suite time, December 2026"):
        assert dated_headings(f"# Measured results\n\n{heading}\n") == [heading], heading
    for heading in ("## Compile time at scale", "### gpt-1.5b at 8 stages", "## Decoder 12 layers",
                    "## torch 2.13.0 and cuda 12.8", "## Marching 4 stages"):
        assert not dated_headings(f"{heading}\n"), heading
    assert not dated_headings("```sh\n# 2026-12-07 a comment in a block\n```\n")
