"""``fxpipe run`` of a plan with a per-layer strategy: the ranks rebuild the zoo model, trace it, take each node's
recorded configuration and train on DTensor; the losses are one process's on the whole batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fxpipe import models
from fxpipe.cli.rank import synthetic_batch
from tests.cli.test_cli import fxpipe_cli, ok, one_line_error


def _one_process_losses(name: str, batch: int, steps: int, lr: float) -> list[float]:
    zoo = models.build(name, dtype=torch.float64, batch_size=batch, seed=0)
    (x,), target = synthetic_batch(zoo, 1)
    opt = torch.optim.SGD(zoo.model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = zoo.loss_fn(zoo.model(x), target)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(("name", "ranks", "strategy"), [("vgg-tiny", 2, "auto"), ("resnet-tiny", 4, "splitbrain")])
def test_a_strategy_plan_trains_like_one_process(tmp_path: Path, name: str, ranks: int, strategy: str) -> None:
    plan = tmp_path / "plan"
    ok(fxpipe_cli("compile", name, "--stages", "1", "--dp", str(ranks), "--strategy", strategy, "--dtype", "float64",
                  "--batch-size", str(2 * ranks), "--out", plan))
    doc = json.loads(ok(fxpipe_cli("run", plan, "--steps", "3", "--lr", "0.05", "--json")).stdout)
    assert doc["ranks"] == ranks and doc["schedule"].startswith(f"strategy {strategy} (")
    torch.testing.assert_close(doc["losses"], _one_process_losses(name, 2 * ranks, 3, 0.05), rtol=1e-9, atol=1e-12)
    assert doc["losses"][-1] < doc["losses"][0]


def test_pipeline_options_are_refused_for_a_strategy_plan(tmp_path: Path) -> None:
    plan = tmp_path / "plan"
    ok(fxpipe_cli("compile", "vgg-tiny", "--stages", "1", "--dp", "2", "--strategy", "dp", "--out", plan))
    line = one_line_error(fxpipe_cli("run", plan, "--steps", "2", "--microbatches", "2"))
    assert "--microbatches is for pipeline plans; a per-layer strategy runs the whole batch as one step" in line


def test_a_record_that_does_not_fit_the_trace_is_refused(tmp_path: Path) -> None:
    plan = tmp_path / "plan"
    ok(fxpipe_cli("compile", "vgg-tiny", "--stages", "1", "--dp", "2", "--strategy", "dp", "--out", plan))
    doc = json.loads((plan / "plan.json").read_text())
    doc["plan"]["strategy"]["nodes"][3][0] = "not_a_node"
    (plan / "plan.json").write_text(json.dumps(doc))
    line = one_line_error(fxpipe_cli("run", plan, "--steps", "1"))
    assert "the plan's strategy does not fit this model's trace (node" in line, line
