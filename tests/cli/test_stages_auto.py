"""``fxpipe compile MODEL --stages auto [--objective ...] [--devices N]``: every count partitioned and simulated,
the objective's pick written as the plan (and recorded), the merging table (Akintoye), and the one-line refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import fxpipe
from fxpipe import models
from fxpipe.plan_dir import read_plan
from fxpipe.planning.stage_count import Objective, StageCount, choose_count
from tests._helpers import assert_composes, fxpipe_cli, ok, one_line_error


def _table(doc: dict) -> tuple[dict, list[dict]]:
    report = next(r for r in doc["reports"] if r["title"] == "partition-stages: stage count (--stages auto)")
    rows = [dict(zip(report["columns"], row)) for row in report["rows"]]
    return report, rows


def test_auto_picks_the_fastest_count_it_simulated_and_writes_that_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    doc = json.loads(ok(fxpipe_cli("compile", "mlp-deep", "--stages", "auto", "--devices", "6", "--json",
                                   "--out", out)).stdout)
    report, rows = _table(doc)
    assert [r["stages"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the budget: --devices 6 at --dp 1
    chosen = [r for r in rows if r[""] == "chosen"]
    assert len(chosen) == 1
    # Never slower in simulation than any count it considered (speedup = throughput at each count's microbatches).
    assert all(chosen[0]["speedup"] >= r["speedup"] for r in rows)
    assert chosen[0]["stages"] > 1  # mlp-deep's 16 equal layers pipeline well at the default link
    merged = next(r for r in doc["reports"] if r["title"] == "partition-stages: merging (Akintoye et al.)")
    assert len(merged["rows"]) >= 16 - 6 and merged["rows"][0][-1].startswith("forced")  # 16 layers on 6 devices
    plan = read_plan(out)
    assert len(plan.stages) == chosen[0]["stages"]
    assert plan.options.stages == chosen[0]["stages"] and plan.options.stage_objective == "fastest"
    assert plan.options.max_stages == 6
    cuts = [s.first_layer for s in plan.stages[1:]]
    assert " ".join(map(str, cuts)) == chosen[0]["cuts"]  # the plan is the partition the table judged
    assert fxpipe.load(out).plan == plan


@pytest.mark.parametrize(("objective", "rule"), [
    ("efficiency:0.6", lambda rows: max((r for r in rows if r["efficiency"] >= 0.6), key=lambda r: r["speedup"])),
    ("speedup:2", lambda rows: min((r for r in rows if r["speedup"] >= 2), key=lambda r: r["stages"])),
])
def test_the_other_objectives_pick_by_their_rule(objective: str, rule) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(ok(fxpipe_cli("compile", "mlp-deep", "--stages", "auto", "--objective", objective,
                                   "--devices", "6", "--json")).stdout)
    _, rows = _table(doc)
    assert [r for r in rows if r[""] == "chosen"] == [rule(rows)]


def test_an_auto_plan_trains_like_eager() -> None:
    zoo = models.build("mlp-deep")
    probe = fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages="auto", max_stages=3)
    assert probe.num_stages == 3 and probe.plan.options.stage_objective == "fastest"
    assert_composes(zoo.model, zoo.example_inputs, zoo.loss_fn, zoo.example_target, probe.num_stages,
                    stage_objective="fastest", max_stages=3)


def test_ties_go_to_fewer_stages() -> None:
    rows = [StageCount(p, (0, 4), (1.0,), (), 2 * p, 2.0 * p, None, 1.0) for p in (1, 2, 3)]  # speedup 1 each
    assert choose_count(rows, Objective("fastest")).stages == 1


@pytest.mark.parametrize(("args", "words"), [
    (("--stages", "auto", "--objective", "slowest"), "unknown stage-count objective 'slowest'"),
    (("--stages", "auto", "--objective", "speedup"), "needs its target"),
    (("--objective", "fastest"), "give them with --stages auto"),
    (("--devices", "4"), "give them with --stages auto"),
    (("--stages", "auto", "--devices", "1", "--dp", "2"), "--devices 1 cannot hold one stage of --dp 2"),
    (("--stages", "two"), "--stages takes a number of stages or auto"),
    (("--stages", "0"), "--stages must be at least 1 or auto"),
    (("--stages", "auto", "--dp", "2", "--strategy", "dp"), "it takes --stages 1, not auto"),
    (("--stages", "auto", "--memory-per-stage", "1KiB"), "no stage count up to 8 fits --memory-per-stage"),
    (("--stages", "auto", "--cores", "0"), "--cores must be at least 1 (got 0)"),
    (("--stages", "auto", "--cores", "two"), "--cores takes a number of cores or auto (got 'two')"),
    (("--stages", "2", "--cores", "2"), "give it with --plan auto or --stages auto"),
])
def test_refusals_are_one_line(args: tuple[str, ...], words: str) -> None:
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", *args))
    assert words in line, line


def test_plan_auto_picks_the_fastest_simulated_candidate_and_its_plan_runs(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    doc = json.loads(ok(fxpipe_cli("compile", "gpt-tiny", "--plan", "auto", "--devices", "2", "--json",
                                   "--out", out)).stdout)
    report = next(r for r in doc["reports"] if r["title"] == "plan auto: candidates, fastest simulated first")
    rows = [dict(zip(report["columns"], row)) for row in report["rows"]]
    chosen = [r for r in rows if r[""] == "chosen"]
    assert len(chosen) == 1 and all(chosen[0]["speedup"] >= r["speedup"] for r in rows)
    assert {(r["stages"], r["dp"]) for r in rows} <= {(1, 1), (1, 2), (2, 1)}
    assert chosen[0]["stages"] * chosen[0]["dp"] == 2  # gpt-tiny pays for a second device (dp 2, or 2 stages)
    assert chosen[0]["memory MiB"] == min(r["memory MiB"] for r in rows if r["speedup"] == chosen[0]["speedup"])
    plan = read_plan(out)
    assert (len(plan.stages), plan.mesh.dp) == (chosen[0]["stages"], chosen[0]["dp"])
    assert plan.schedule is not None and plan.schedule.name == chosen[0]["schedule"]
    assert plan.schedule.microbatches == chosen[0]["microbatches"] == plan.options.microbatches
    assert plan.options.plan_search and plan.options.devices == 2
    result = json.loads(ok(fxpipe_cli("run", out, "--steps", "2", "--json")).stdout)
    assert result["ranks"] == 2 and result["schedule"] == chosen[0]["schedule"]
    assert all(loss == loss for loss in result["losses"])  # it trained: finite losses on both steps


def test_the_screen_keeps_the_candidate_simulating_everything_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    pass_module = importlib.import_module("fxpipe.passes.partition_stages")  # the package re-exports the function

    picks = []
    for everything in (False, True):
        if everything:
            monkeypatch.setattr(pass_module, "SIMULATED_CANDIDATES", 10**6)
        doc = json.loads(ok(fxpipe_cli("compile", "gpt-tiny", "--plan", "auto", "--devices", "3", "--json",
                                       "--stop-after", "partition-stages")).stdout)
        report = next(r for r in doc["reports"] if r["title"].startswith("plan auto"))
        row = next(dict(zip(report["columns"], r)) for r in report["rows"] if r[-1] == "chosen")
        picks.append((row["stages"], row["dp"], row["schedule"], row["microbatches"], len(report["rows"])))
    assert picks[0][:4] == picks[1][:4]
    assert picks[1][4] > picks[0][4]  # simulating everything did simulate more


@pytest.mark.parametrize(("args", "words"), [
    (("--plan", "auto"), "--plan auto needs --devices N"),
    (("--plan", "auto", "--devices", "4", "--stages", "2"), "--plan auto chooses --stages itself"),
    (("--plan", "auto", "--devices", "4", "--schedule", "1f1b", "--dp", "2"), "chooses --schedule, --dp itself"),
    (("--plan", "auto", "--devices", "4", "--memory-per-stage", "1KiB"),
      "no plan on 4 devices fits --memory-per-stage"),
    (("--plan", "auto", "--devices", "4", "--cores", "0"), "--cores must be at least 1 (got 0)"),
])
def test_plan_auto_refusals_are_one_line(args: tuple[str, ...], words: str) -> None:
    line = one_line_error(fxpipe_cli("compile", "mlp-tiny", *args))
    assert words in line, line


def test_plan_auto_with_cores_records_them_and_says_time_sharing_was_modelled(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    doc = json.loads(ok(fxpipe_cli("compile", "mlp-tiny", "--plan", "auto", "--devices", "4", "--cores", "2",
                                   "--json", "--out", out)).stdout)
    report = next(r for r in doc["reports"] if r["title"] == "plan auto: candidates, fastest simulated first")
    assert "compute x" in report["columns"]
    assert any(n.startswith("time-sharing modelled (--cores 2)") for n in report["notes"])
    assert "hint" not in doc
    plan = read_plan(out)
    assert plan.options.cores == 2 and plan.mesh.world_size <= 4
    assert fxpipe.load(out).plan == plan


def _auto_plan(**options: object) -> fxpipe.Pipeline:
    zoo = models.build("mlp-small")
    return fxpipe.compile(zoo.model, zoo.example_inputs, plan_search=True, devices=2, **options)


def _with_fractions(pipe: fxpipe.Pipeline, fraction: float) -> fxpipe.Pipeline:
    import dataclasses

    pipe.plan = dataclasses.replace(pipe.plan, stages=tuple(dataclasses.replace(st, w_batched=fraction)
                                                            for st in pipe.plan.stages))
    return pipe


@pytest.mark.parametrize("fraction", [0.05, 0.999])
def test_plan_auto_takes_batched_w_where_its_simulation_is_faster(tmp_path: Path, fraction: float) -> None:
    """--plan auto searches before any stage is traced; once split-backward knows a stage's Ws run faster batched
    (StageCost.w_batched: the fixed-model compile of the tests has none, so it is set here), the chosen plan is
    simulated under batched-w too and the faster one is recorded, with both in a table."""
    from fxpipe.api import batch_plan_ws
    from fxpipe.schedules.generators import generate
    from fxpipe.schedules.simulate import Costs, simulate

    pipe = _with_fractions(_auto_plan(bandwidth=1e13, latency=0.0), fraction)  # compute, not the link, sets the step
    before = pipe.plan.schedule
    assert before is not None and not before.batch_w
    costs = Costs.from_plan(pipe.plan)
    batched = simulate(generate("batched-w", pipe.num_stages, before.microbatches, costs), costs).makespan
    chosen = batch_plan_ws(pipe)
    assert chosen == (batched < before.makespan_s)
    after = pipe.plan.schedule
    assert after is not None
    if chosen:
        assert (after.name, after.batch_w, after.microbatches) == ("batched-w", True, before.microbatches)
        assert pipe.plan.options.schedule == "batched-w" and after.makespan_s < before.makespan_s
    else:
        assert after == before and pipe.plan.options.schedule == before.name
    table = next(r for r in pipe.extra_reports if r.title == "plan auto: batched W, once the stages are split")
    rows = {row[0]: row for row in table.rows}
    assert rows["batched-w"][2] == round(batched * 1e3, 3) and rows[before.name][2] == round(before.makespan_s * 1e3, 3)
    assert [row[0] for row in table.rows if row[3] == "chosen"] == [after.name]
    # Ws at 5% of their time win when compute sets the step; at 99.9%, the simulation says which
    assert chosen or fraction > 0.5
    from fxpipe.plan_dir import save_pipeline

    save_pipeline(pipe, tmp_path / "plan")
    again = read_plan(tmp_path / "plan")
    assert again.schedule is not None and (again.schedule.name, again.schedule.batch_w) == (after.name, after.batch_w)


def test_plan_auto_keeps_its_schedule_under_a_memory_cap_or_without_batched_ws() -> None:
    from fxpipe.api import batch_plan_ws

    plain = _auto_plan()  # the fixed model: no stage's Ws are known to batch faster
    assert all(st.w_batched == 1.0 for st in plain.plan.stages) and not batch_plan_ws(plain)
    capped = _with_fractions(_auto_plan(memory_per_stage=2**30), 0.05)
    record = capped.plan.schedule
    assert not batch_plan_ws(capped) and capped.plan.schedule == record
