"""A user's one-rank script (gloo, world size 1) run in a fresh interpreter: for refusals that need a process group."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests._helpers import HANG_S

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
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout
