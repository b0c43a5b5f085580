"""An asynchronous schedule keeps ``synchronous=False`` through a plan directory, and is never trained as a
synchronous one: ``PipelineRuntime.step`` points to ``train``, which streams without a flush."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import fxpipe
from fxpipe.cli.main import app
from fxpipe.schedules.auto import plan_schedule

ROOT = Path(__file__).parents[2]


def test_async_schedule_survives_reload_and_is_refused(tmp_path: Path) -> None:
    plan = tmp_path / "plan"
    result = CliRunner().invoke(app, ["compile", "mlp-tiny", "--stages", "2", "--schedule", "async-1f1b",
                                      "--out", str(plan)])
    assert result.exit_code == 0, result.output
    loaded = fxpipe.load(plan)
    assert loaded.plan.schedule is not None and loaded.plan.schedule.synchronous is False
    assert plan_schedule(loaded.plan, None, None).synchronous is False
    # fxpipe run: what it cannot do asynchronously is refused before any rank starts, one line, exit 2.
    for extra, message in ((["--weights", "predict"], "--weights predict extrapolates with SGD's momentum"),
                           (["--weights", "newest"], "--weights 'newest' is not a policy")):
        result = CliRunner().invoke(app, ["run", str(plan), "--nproc", "2", "--steps", "1", *extra])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    # PipelineRuntime in a user's script: rt.step has no step boundary to stop at and points to rt.train.
    one = tmp_path / "one"
    result = CliRunner().invoke(app, ["compile", "mlp-tiny", "--stages", "1", "--schedule", "async-1f1b",
                                      "--out", str(one)])
    assert result.exit_code == 0, result.output
    script = (
        "import datetime, torch, torch.distributed as dist\n"
        "from fxpipe.errors import OptionError\n"
        "from fxpipe.runtime import PipelineRuntime\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'pg'}', rank=0, world_size=1)\n"
        "try:\n"
        f"    rt = PipelineRuntime({str(one)!r}, loss_fn=lambda out, t: out.sum())\n"
        "    rt.step((torch.zeros(8, 16),), None)\n"
        "except OptionError as exc:\n"
        "    print('refused:', exc)\n"
        "finally:\n"
        "    dist.destroy_process_group()\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: async-1f1b is asynchronous: there is no step boundary" in proc.stdout
    assert "rt.train(batches)" in proc.stdout
