"""DEFAULTS is the one place a default lives: change it there and every entry point follows."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import fxpipe
from fxpipe import models
from fxpipe.cli.main import app
from fxpipe.plan import DEFAULTS
from fxpipe.schedules.auto import plan_schedule


@pytest.fixture
def three_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DEFAULTS, "stages", 3)
    monkeypatch.setattr(DEFAULTS, "microbatches_per_stage", 3)
    monkeypatch.setattr(DEFAULTS, "schedule", "zb-h1")
    monkeypatch.setattr(DEFAULTS, "latency", 2e-3)


def test_the_python_api_follows_DEFAULTS(three_stages: None) -> None:
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs)
    assert pipe.num_stages == 3 and pipe.plan.link.latency == 2e-3
    sched = plan_schedule(pipe.plan, None, None)  # nothing recorded: the default schedule and count
    assert (sched.name, sched.num_microbatches) == ("zb-h1", 9)


def test_the_cli_follows_DEFAULTS(three_stages: None, tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    result = runner.invoke(app, ["compile", "mlp-tiny", "--out", str(tmp_path / "plan"), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())["plan"]
    assert len(plan["stages"]) == 3 and plan["link"]["latency"] == 2e-3
    result = runner.invoke(app, ["simulate", "mlp-tiny", "--json"])  # a model target: compiled at the default
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["stages"], doc["schedule"], doc["microbatches"]) == (3, "zb-h1", 9)


def test_the_backend_follows_DEFAULTS(three_stages: None) -> None:
    torch._dynamo.reset()
    zoo = models.build("mlp-tiny")
    compiled = torch.compile(zoo.model, backend="fxpipe")
    x = zoo.example_inputs[0].repeat(9, 1)  # divisible by the default 9 microbatches
    compiled(x)
    pipe = fxpipe.backend._LAST[-1]
    assert pipe.num_stages == 3
    torch._dynamo.reset()
