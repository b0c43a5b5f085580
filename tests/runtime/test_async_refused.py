"""An asynchronous schedule keeps ``synchronous=False`` through a plan directory, and is never trained as a
synchronous one: ``PipelineRuntime.step`` points to ``train``, which streams without a flush."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

import fxpipe
from fxpipe import models
from fxpipe.cli.main import app
from fxpipe.schedules.auto import plan_schedule
from tests.runtime._one_rank import run_one_rank


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
                           (["--weights", "newest"], "'newest' is not one of 'stale', 'stash', 'predict'")):
        result = CliRunner().invoke(app, ["run", str(plan), "--nproc", "2", "--steps", "1", *extra])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    # PipelineRuntime in a user's script: rt.step has no step boundary to stop at and points to rt.train.
    one = tmp_path / "one"
    result = CliRunner().invoke(app, ["compile", "mlp-tiny", "--stages", "1", "--schedule", "async-1f1b",
                                      "--out", str(one)])
    assert result.exit_code == 0, result.output
    stdout = run_one_rank(tmp_path, f"""
        try:
            rt = PipelineRuntime({str(one)!r}, loss_fn=lambda out, t: out.sum())
            rt.step((torch.zeros(8, 16),), None)
        except OptionError as exc:
            print('refused:', exc)
        """)
    assert "refused: async-1f1b is asynchronous: there is no step boundary" in stdout
    assert "rt.train(batches)" in stdout


def test_a_schedule_named_at_run_time_keeps_the_plan_s_microbatches(tmp_path: Path) -> None:
    """``fxpipe run PLAN --schedule S`` without ``--microbatches`` runs the plan's own count (compile --microbatches,
    or its recorded schedule's), so the batch is the one the plan was compiled for; with neither, the default."""
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, microbatches=6)
    assert plan_schedule(pipe.plan, "zb-h2", None).num_microbatches == 6
    assert plan_schedule(pipe.plan, "zb-h2", 3).num_microbatches == 3
    recorded = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, schedule="1f1b", microbatches=5)
    assert plan_schedule(recorded.plan, "zb-h1", None).num_microbatches == 5
    plain = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    assert plan_schedule(plain.plan, "zb-h2", None).num_microbatches == 4  # 2 per stage
