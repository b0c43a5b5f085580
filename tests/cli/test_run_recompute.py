"""``fxpipe run --recompute``: one 2-rank launch of gpt-tiny under 1F1B with every stage recomputing (the same
losses as one process, and each stage's measured peak held bytes equal to the memory model's and below what
it holds without recomputation), and the refusals before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxpipe.planning.cost import held_peaks
from fxpipe.plan_dir import read_plan
from fxpipe.schedules.auto import plan_schedule
from fxpipe.schedules.simulate import Costs
from tests._helpers import MLP_PLAN, cli_plan, fxpipe_cli, ok, one_line_error, plan_fixture, reference_losses

plan = plan_fixture("gpt-tiny", "--stages", "2", "--schedule", "zb-h1", "--microbatches", "4")  # test_run_cli's


def test_recompute_stage_same_losses_less_held_memory(plan: Path) -> None:
    doc = json.loads(ok(fxpipe_cli("run", plan, "--nproc", "2", "--steps", "2", "--schedule", "1f1b",
                                   "--recompute", "stage", "--json")).stdout)
    assert doc["schedule"] == "1f1b" and doc["recompute"] == [0, 1], doc["recompute_note"]
    assert doc["losses"] == pytest.approx(reference_losses(2), rel=1e-5)
    p = read_plan(plan)
    sched = plan_schedule(p, "1f1b", 4)
    acts = [(a.stage, a.kind.value) for r in sched.ranks for a in r]
    costs = Costs.from_plan(p)
    without = held_peaks(acts, costs.held_fb, costs.held_bw)
    with_ = held_peaks(acts, costs.recomputing([0, 1]).held_fb, costs.held_bw)
    assert doc["simulated_held_bytes_per_stage"] == [int(x) for x in with_]
    assert doc["peak_held_bytes_per_stage"] == doc["simulated_held_bytes_per_stage"]  # measured on the ranks
    assert all(got < before for got, before in zip(doc["peak_held_bytes_per_stage"], without)), (doc, without)


def test_recompute_is_checked_before_any_rank_starts(no_rank_starts: list[list[str]]) -> None:
    mlp = cli_plan(*MLP_PLAN)
    line = one_line_error(fxpipe_cli("run", mlp, "--recompute", "some"))
    assert "--recompute takes none, stage or auto (got 'some')" in line
    line = one_line_error(fxpipe_cli("run", mlp, "--schedule", "async-1f1b", "--recompute", "stage"))
    assert "async-1f1b is asynchronous" in line and "--recompute none" in line
