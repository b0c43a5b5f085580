"""A user's one-rank script (gloo, world size 1) run in a process of its own (forked from the tests' preloaded
forkserver): for refusals that need a process group."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests._helpers import run_forked

ROOT = Path(__file__).parents[2]


def run_one_rank(tmp_path: Path, body: str) -> str:
    """``body`` between ``init_process_group`` and ``destroy_process_group``; its stdout (it must exit 0)."""
    script = ("import torch, torch.distributed as dist\n"
              "from fxpipe.errors import OptionError\n"
              "from fxpipe.runtime import PipelineRuntime\n"
              f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'pg'}', rank=0, world_size=1)\n"
              "try:\n" + textwrap.indent(textwrap.dedent(body), "    ") +
              "finally:\n"
              "    dist.destroy_process_group()\n")
    proc = run_forked(["-c", script], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout
