"""fxpipe and torch's schedule files both ways: ``fxpipe export --to torch`` writes CSVs torch's ``_load_csv`` reads and
validates; ``fxpipe simulate --schedule-csv`` reads what torch's generators dump; ``fxpipe inspect --torchtitan``
gives split points that torch's ``pipeline()`` splitter turns into the plan's stages; and the refusals are one line."""

from __future__ import annotations

import dataclasses
import functools
import json
import types
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch

import fxpipe
from fxpipe.errors import PlanError
from tests._helpers import fxpipe_cli, ok, one_line_error, session_dir


@functools.cache
def gpt4() -> Path:
    """gpt-tiny in 4 stages, zb-h1 with 4 microbatches."""
    out = session_dir("export") / "plan"
    ok(fxpipe_cli("compile", "gpt-tiny", "--stages", 4, "--schedule", "zb-h1", "--microbatches", 4, "--out", out))
    return out


def _runtime(ranks: int, stages: int, m: int) -> Any:
    """torch's _PipelineScheduleRuntime on stand-in stages (the counts its constructor reads): it loads CSVs."""
    from fxpipe._compat import pipelining_schedules

    local = [types.SimpleNamespace(group_size=ranks, group_rank=0, num_stages=stages, stage_index=0,
                                   submod=torch.nn.Module(), stage_index_to_group_rank=None)]
    return pipelining_schedules()._PipelineScheduleRuntime(local, n_microbatches=m)


def test_export_writes_csvs_torch_loads_and_validates(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    doc = json.loads(ok(fxpipe_cli("export", gpt4(), "--to", "torch", "--out", out, "--json")).stdout)
    assert doc["schedule"] == "zb-h1" and doc["rank_of_stage"] == [0, 1, 2, 3] and doc["microbatches"] == 4
    assert doc["tied_across_ranks"] == {"lm_head.weight": [0, 3]}
    plan = fxpipe.load(gpt4())
    assert [s["parameters"] for s in doc["per_stage"]] == [[n for n, _ in s.module.named_parameters()]
                                                            for s in plan.stage_list()]
    rows = (out / "schedule.csv").read_text().splitlines()
    assert rows[0].split(",")[:6] == ["0F0", "0F1", "0F2", "0F3", "0I0", "0W0"]
    compute = _runtime(4, 4, 4)
    compute._load_csv(str(out / "schedule.csv"), format="compute_only")  # runs torch's _validate_schedule
    comms = _runtime(4, 4, 4)
    comms._load_csv(str(out / "schedule_comms.csv"), format="compute_comms")
    assert compute.stage_index_to_group_rank == {0: 0, 1: 1, 2: 2, 3: 3}
    assert {r: list(map(str, a)) for r, a in compute.pipeline_order_with_comms.items()} == \
        {r: list(map(str, a)) for r, a in comms.pipeline_order_with_comms.items()}
    # the export directory is a plan for the runtime and for fxpipe alike
    assert fxpipe.export_torch(out).compute_csv == (out / "schedule.csv").read_bytes().decode()


@pytest.mark.parametrize("name,fmt", [("ZBVZeroBubble", "compute_comms"), ("ZBVZeroBubble", "compute_only"),
                                      ("Interleaved1F1B", "compute_only"), ("DualPipeV", "compute_comms"),
                                      ("LoopedBFS", "compute_comms")])
def test_simulate_reads_torchs_own_dumps(tmp_path: Path, name: str, fmt: str) -> None:
    from fxpipe.schedules.simulate import Costs, simulate
    from fxpipe.schedules.torch_csv import read_torch_csv, torch_generated

    path = tmp_path / f"{name}.csv"
    torch_generated(name, 2, 4)._dump_csv(str(path), format=fmt)  # torch's own order, written by torch
    doc = json.loads(ok(fxpipe_cli("simulate", "--schedule-csv", path, "--uniform-costs", "1,1,1", "--json")).stdout)
    order = read_torch_csv(path.read_text()).compute_only()
    assert doc["stages"] == order.num_stages and doc["microbatches"] == 4 and doc["ranks"] == 2
    assert doc["makespan"] == simulate(order, Costs.uniform(order.num_stages, 1, 1, 1)).makespan
    beside = next(r for r in doc["reports"] if "beside" in r["title"])
    assert beside["rows"][0][0] == f"csv:{path.name}"


def test_simulate_csv_on_a_plan_and_its_refusals(tmp_path: Path) -> None:
    from fxpipe.schedules.torch_csv import torch_generated_csv

    path = tmp_path / "g.csv"
    path.write_text(torch_generated_csv("GPipe", 4, 8))
    doc = json.loads(ok(fxpipe_cli("simulate", gpt4(), "--schedule-csv", path, "--json")).stdout)
    beside = next(r for r in doc["reports"] if "beside" in r["title"])
    assert [r[0] for r in beside["rows"]] == ["csv:g.csv", "gpipe", "1f1b", "zb-h1", "zb-h2"]
    assert beside["rows"][0][2] == beside["rows"][1][2]  # torch's GPipe order is fxpipe's gpipe: the same makespan
    path.write_text(torch_generated_csv("1F1B", 4, 8))  # torch 2.13's IR of its own 1F1B skips stage 3's F0
    bad = fxpipe_cli("simulate", "--schedule-csv", path, "--uniform-costs", "1,1,1")  # the grid follows, as for any
    assert bad.exit_code == 2 and "microbatch 8 never runs F on stage 0" in bad.stderr.splitlines()[0]  # invalid one
    path.write_text("0F0,0X0\n")
    assert "row 0, column 1: '0X0' is not a torch action" in one_line_error(
        fxpipe_cli("simulate", "--schedule-csv", path, "--uniform-costs", "1,1,1"))
    path.write_text(torch_generated_csv("ZBVZeroBubble", 2, 4))
    assert "drop --schedule" in one_line_error(fxpipe_cli("simulate", gpt4(), "--schedule-csv", path, "--schedule",
                                                                           "1f1b"))
    path.write_text(torch_generated_csv("ZBVZeroBubble", 4, 8))
    assert "schedules 8 stages, the plan has 4" in one_line_error(fxpipe_cli("simulate", gpt4(), "--schedule-csv",
                                                                                              path))
    path.write_text("0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0\n")  # no SEND_B/RECV_B for stage 1's backward
    assert "never runs" in one_line_error(fxpipe_cli("simulate", "--schedule-csv", path, "--uniform-costs", "1,1,1"))


def test_torchtitan_split_points_make_the_plans_stages_with_torchs_splitter() -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    from fxpipe import models

    text = ok(fxpipe_cli("inspect", gpt4(), "--torchtitan")).stdout
    par = tomllib.loads(text)["parallelism"]
    assert par["pipeline_parallel_degree"] == 4 and par["pipeline_parallel_schedule"] == "_PipelineScheduleRuntime"
    assert par["pipeline_parallel_schedule_csv"].endswith("schedule.csv")
    assert par["pipeline_parallel_split_points"] == [p[0] for p in par["module_fqns_per_model_part"][1:]]
    zoo = models.build("gpt-tiny")  # the model the plan was compiled from: same seed, same weights
    split = pipeline(zoo.model, mb_args=zoo.example_inputs,
                     split_spec={p: SplitPoint.BEGINNING for p in par["pipeline_parallel_split_points"]})
    canon = {n: id(p) for n, p in zoo.model.named_parameters(remove_duplicate=False)}  # tied: one id, two names
    plan = fxpipe.load(gpt4())
    assert split.num_stages == plan.num_stages
    for k, stage in enumerate(plan.stage_list()):
        theirs = {canon[n] for n, _ in split.get_stage_module(k).named_parameters(remove_duplicate=False)}
        assert theirs == {canon[n] for n, _ in stage.module.named_parameters()}, k


def test_refusals_are_one_line(tmp_path: Path) -> None:
    plan = tmp_path / "async"
    ok(fxpipe_cli("compile", "mlp-tiny", "--stages", 2, "--schedule", "async-1f1b", "--out", plan))
    assert "is asynchronous" in one_line_error(
        fxpipe_cli("export", plan, "--to", "torch", "--out", tmp_path / "x"))
    node = tmp_path / "node"
    ok(fxpipe_cli("compile", "mlp-tiny", "--stages", 2, "--granularity", "node", "--out", node))
    assert "torchtitan splits at modules" in one_line_error(fxpipe_cli("inspect", node, "--torchtitan"))
    assert "'jax' is not one of 'torch'" in one_line_error(fxpipe_cli("export", node, "--to", "jax", "--out",
                                                                      tmp_path / "y"))
    pipe = fxpipe.load(node)
    from fxpipe.plan import StrategyRecord

    pipe.plan = dataclasses.replace(pipe.plan, strategy=StrategyRecord("dp", 2, 2, "data-parallel", 0.0, ()))
    with pytest.raises(PlanError, match="per-layer strategy"):
        fxpipe.export_torch(pipe)


def test_a_cut_inside_a_module_is_named() -> None:
    from fxpipe.runtime.torch_export import stage_modules_by_name

    plan = fxpipe.load(gpt4()).plan
    layers = list(plan.layers)
    layers[3] = dataclasses.replace(layers[3], name="blocks.0#2")  # stage 3 would begin inside blocks.0's calls
    layers[2] = dataclasses.replace(layers[2], name="blocks.0")
    with pytest.raises(PlanError, match="falls inside module blocks.0"):
        stage_modules_by_name(dataclasses.replace(plan, layers=tuple(layers)))


def test_a_pipeline_exports_with_its_plan(tmp_path: Path) -> None:
    """``fxpipe.export_torch(pipeline, out=DIR)`` writes the plan too, so ``torch_schedule(DIR, ...)`` finds it."""
    pipe = fxpipe.load(gpt4())
    first = fxpipe.export_torch(pipe, out=tmp_path / "exp")
    again = fxpipe.export_torch(tmp_path / "exp")
    assert again.compute_csv == first.compute_csv and again.manifest() == first.manifest()
    saved = fxpipe.load(tmp_path / "exp" / "plan").stage_list()[0].module
    assert [n for n, _ in saved.named_parameters()] == [n for n, _ in pipe.stage_list()[0].module.named_parameters()]
