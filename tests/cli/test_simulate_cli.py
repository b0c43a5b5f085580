"""``fxpipe simulate`` and ``fxpipe compile --schedule``: closed forms through the CLI, files, plans, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxpipe.schedules.ir import Schedule
from tests._helpers import fxpipe_cli, ok, one_line_error


@pytest.mark.parametrize("schedule, span", [("1f1b", 33), ("zb-h1", 27), ("zb-h2", 24)])
def test_uniform_costs_give_the_closed_forms(schedule: str, span: float) -> None:
    result = ok(fxpipe_cli("simulate", "--uniform-costs", "1,1,1", "--stages", "4", "--schedule", schedule,
                           "--microbatches", "8", "--json"))
    doc = json.loads(result.stdout)
    assert doc["schema"] == "fxpipe.simulate/v1" and doc["time_unit"] == "unit"
    assert doc["max_stage_span"] == span
    assert doc["makespan"] >= doc["max_stage_span"]
    assert Schedule.from_csv(doc["schedule_csv"]).num_microbatches == 8


def test_simulate_a_plan_directory_writes_trace_and_svg(tmp_path: Path) -> None:
    plan = tmp_path / "plan"
    ok(fxpipe_cli("compile", "gpt-tiny", "--stages", "2", "--out", plan, "--schedule", "zb-h1", "--microbatches", "4"))
    doc = json.loads((plan / "plan.json").read_text())
    recorded = doc["plan"]["schedule"]
    assert recorded["name"] == "zb-h1" and recorded["microbatches"] == 4
    assert Schedule.from_csv(recorded["csv"]).num_stages == 2
    assert any(r["title"] == "simulate: per rank" for r in doc["reports"])
    trace, svg = tmp_path / "t.json", tmp_path / "t.svg"
    result = ok(fxpipe_cli("simulate", plan, "--schedule", "zb-h1", "--microbatches", "4", "--trace", trace,
                           "--svg", svg, "--plain"))
    assert "simulate: per rank" in result.stdout and "rank 1 |" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X" and e.get("cat") in ("F", "B", "W")) == 2 * 4 * 3
    assert svg.read_text().startswith("<!-- fxpipe schedule -->\n<svg")
    ok(fxpipe_cli("simulate", plan, "--trace", trace, "--svg", svg, "--json"))  # fxpipe's own files: replaced
    # Never over a file fxpipe did not write, nor through a link (one line each, before any work; files unchanged).
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "link.json").symlink_to(tmp_path / "notes.txt")
    for flag, path, why in (("--trace", tmp_path / "notes.txt", "exists and fxpipe did not write it"),
                            ("--svg", tmp_path / "notes.txt", "exists and fxpipe did not write it"),
                            ("--trace", tmp_path / "link.json", "is a symbolic link")):
        assert why in one_line_error(fxpipe_cli("simulate", plan, flag, path))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # The same plan and schedule simulate to the makespan compile recorded.
    again = json.loads(ok(fxpipe_cli("simulate", plan, "--schedule", "zb-h1", "--microbatches", "4", "--json")).stdout)
    assert again["makespan"] == pytest.approx(recorded["makespan_s"])
    # --recompute stage: each B also takes F's time, and each stage holds only its inputs from F to B (under 1F1B,
    # whose peaks are F to B; zb-h1's deferred Ws hold what W reads, which recomputation leaves as it is).
    args = ("simulate", plan, "--schedule", "1f1b", "--microbatches", "4", "--json")
    more, less = (json.loads(ok(fxpipe_cli(*args, "--recompute", how)).stdout) for how in ("none", "stage"))
    assert less["makespan"] > more["makespan"]
    assert all(r["peak_memory"] < r0["peak_memory"] for r, r0 in zip(less["per_rank"], more["per_rank"]))
    table = next(r for r in less["reports"] if r["title"] == "simulate: recompute")
    assert [row[1] for row in table["rows"]] == [True, True]
    assert "stages 0, 1 keep only their inputs" in table["notes"][0]


def test_compile_with_auto_records_its_choice(tmp_path: Path) -> None:
    result = ok(fxpipe_cli("compile", "mlp-tiny", "--stages", "2", "--schedule", "auto", "--json"))
    doc = json.loads(result.stdout)
    titles = [r["title"] for r in doc["reports"]]
    assert any(t.startswith("schedule auto") for t in titles)
    chosen = [row for r in doc["reports"] if r["title"].startswith("schedule auto") for row in r["rows"]
              if row[-1] == "<== chosen"]
    assert len(chosen) == 1


@pytest.mark.parametrize("args, match", [
    (["simulate", "--uniform-costs", "1,1", "--stages", "2"], "--uniform-costs takes 3 non-negative numbers"),
    (["simulate", "--uniform-costs", "1,1,1"], "--uniform-costs needs --stages"),
    (["simulate"], "give a plan directory or a model"),
    (["simulate", "--uniform-costs", "1,1,1", "--stages", "2", "--schedule", "nope"],
     "'nope' is not one of 'gpipe', '1f1b'"),  # the choices listed (--schedule is a Literal of the registry's)
    (["simulate", "--uniform-costs", "1,1,1", "--stages", "3", "--schedule", "interleaved-1f1b"],
     "stage count must be a multiple of 2"),
    (["simulate", "--uniform-costs", "1,1,1", "--stages", "2", "--recompute", "stage"],
     "--recompute stage needs a plan's stage input bytes"),
    (["simulate", "--uniform-costs", "1,1,1", "--stages", "2", "--schedule", "async-1f1b", "--w-lane"],
     "--w-lane models a synchronous schedule's W's; async-1f1b updates the weights after each W"),
])
def test_bad_simulate_input_is_one_line(args: list[str], match: str) -> None:
    assert match in one_line_error(fxpipe_cli(*args))


def test_simulate_with_dp_shows_the_all_reduce() -> None:
    """The hand-computed case of tests/schedules/test_simulate_dp.py through the CLI: 1f1b, 2 stages x 2 replicas."""
    args = ("simulate", "--uniform-costs", "1,1,1", "--stages", "2", "--schedule", "1f1b", "--microbatches", "2",
            "--dp", "2", "--allreduce", "1.5")
    doc = json.loads(ok(fxpipe_cli(*args, "--json")).stdout)
    assert (doc["dp"], doc["makespan"], doc["compute_makespan"]) == (2, 10.5, 9.0)
    assert (doc["hidden_fraction"], doc["step_hidden_fraction"]) == (0.0, 0.5)
    assert [(e["rank"], e["stage"], e["start"], e["end"]) for e in doc["allreduce"]] == [(0, 0, 9.0, 10.5),
                                                                                         (1, 1, 7.0, 8.5)]
    table = next(r for r in doc["reports"] if r["title"] == "simulate: data parallel")
    assert [row[:5] for row in table["rows"]] == [[0, "0,1", "0", 1, 1.5], [1, "2,3", "1", 1, 1.5]]
    text = ok(fxpipe_cli(*args, "--plain")).stdout
    assert "simulate: data parallel" in text and "rank 1 ar |" in text and "A all-reduce" in text
    # Without --dp (and no plan mesh) nothing of it shows.
    assert "all-reduce" not in ok(fxpipe_cli(*args[:-4], "--plain")).stdout


def test_w_on_a_second_lane_shortens_layerpipe_where_each_w_outlasts_the_action_beside_it() -> None:
    """W = 3 against F = B = 1: beside the next F or B, a W on the second lane lets it end sooner (46 -> 43 units at
    4 stages, 8 microbatches); with W = 1 there is nothing to gain (the same 27 units as one lane for zb-h1)."""
    def makespan(costs: str, schedule: str, *lane: str) -> float:
        return json.loads(ok(fxpipe_cli("simulate", "--uniform-costs", costs, "--stages", "4", "--schedule", schedule,
                                        "--microbatches", "8", "--json", *lane)).stdout)["makespan"]

    assert (makespan("1,1,3", "layerpipe"), makespan("1,1,3", "layerpipe", "--w-lane")) == (46, 43)
    assert makespan("1,1,1", "zb-h1", "--w-lane") == makespan("1,1,1", "zb-h1") == 27
