"""``fxpipe compile MODEL --stages 1 --dp D --strategy auto|dp|splitbrain [--group K]``: the per-layer table, the
totals, the StrategyRecord in plan.json (loaded back equal), and the one-line refusals (the pipelined form,
``--stages P``, is compiled and run in tests/cli/test_run_strategy.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import fxpipe
from fxpipe.errors import PlanFileError
from fxpipe.plan import CompileOptions, Link, Mesh, Plan, Provenance, StageCost, StrategyRecord
from fxpipe.plan_dir import read_plan
from tests._helpers import fxpipe_cli, ok, one_line_error


def _compile(tmp_path: Path, *args: str) -> tuple[str, Path]:
    out = tmp_path / "plan"
    result = ok(fxpipe_cli("compile", *args, "--out", out, "--plain"))
    return result.stdout, out


def _record(out: Path) -> StrategyRecord:
    doc = json.loads((out / "plan.json").read_text())
    assert "strategy" in doc["plan"]
    plan = read_plan(out)
    assert plan.strategy is not None
    assert Plan.from_json(plan.to_json()) == plan
    assert fxpipe.load(out).plan == plan
    return plan.strategy


def test_auto_prints_the_table_and_records_the_choice(tmp_path: Path) -> None:
    text, out = _compile(tmp_path, "vgg-tiny", "--stages", "1", "--dp", "2", "--strategy", "auto")
    assert "strategy auto (elimination" in text
    assert "totals per step and rank: auto against dp and SplitBrain on 2 ranks" in text  # as fxpipe strategy prints
    assert "data-parallel" in text and "splitbrain-2" in text and "auto (search) (chosen)" in text
    for node in ("features_0", "classifier_0", "classifier_6"):
        assert node in text
    record = _record(out)
    assert (record.name, record.ranks, record.group) == ("auto", 2, 2)
    assert record.method.startswith("elimination")
    assert all("h" not in config for _, config in record.nodes)  # no height splits on the runtime's path
    assert record.cost > 0


def test_splitbrain_shards_the_classifier_in_groups(tmp_path: Path) -> None:
    text, out = _compile(tmp_path, "vgg-tiny", "--stages", "1", "--dp", "4", "--strategy", "splitbrain",
                         "--group", "2", "--batch-size", "8")
    assert "splitbrain-2 (chosen)" in text
    record = _record(out)
    assert (record.name, record.ranks, record.group, record.method) == ("splitbrain", 4, 2, "splitbrain-2")
    by = record.configs
    assert by["features_0"] == "s4" and by["classifier_0"] == "s2c2" and by["classifier_3"] == "s2r2"
    # the inspect command prints the tables again from plan.json
    again = ok(fxpipe_cli("inspect", out, "--plain")).stdout
    assert "strategy splitbrain (splitbrain-2) on 4 ranks, batch 8" in again
    assert "strategy splitbrain (splitbrain-2) on 4 ranks: 19 nodes, 5 split beyond the batch" in again


def test_dp_chooses_the_batch_split_everywhere(tmp_path: Path) -> None:
    _, out = _compile(tmp_path, "vgg-tiny", "--stages", "1", "--dp", "2", "--strategy", "dp")
    record = _record(out)
    assert record.method == "data-parallel"
    assert {config for _, config in record.nodes} == {"s2"}


def test_stages_default_to_one_with_a_strategy_and_json_holds_the_record() -> None:
    result = ok(fxpipe_cli("compile", "vgg-tiny", "--dp", "2", "--strategy", "dp", "--json"))
    doc = json.loads(result.stdout)
    assert doc["strategy"]["name"] == "dp" and doc["strategy"]["ranks"] == 2
    assert any(r["title"].startswith("strategy dp (data-parallel) on 2 ranks") for r in doc["reports"])


def test_without_strategy_nothing_changes(tmp_path: Path) -> None:
    _, out = _compile(tmp_path, "vgg-tiny", "--stages", "1", "--dp", "2")
    doc = json.loads((out / "plan.json").read_text())
    assert "strategy" not in doc["plan"]
    assert not any(r["title"].startswith("strategy") for r in doc["reports"])
    assert read_plan(out).strategy is None


def test_resnet_auto(tmp_path: Path) -> None:
    text, out = _compile(tmp_path, "resnet-tiny", "--stages", "1", "--dp", "2", "--strategy", "auto")
    assert "strategy auto (elimination" in text
    record = _record(out)
    assert len(record.nodes) > 10


@pytest.mark.parametrize(("args", "words"), [
    (("--stages", "auto", "--dp", "2", "--strategy", "auto"), "not auto"),
    (("--stages", "2", "--dp", "3", "--strategy", "auto"), "power of two"),
    (("--stages", "2", "--dp", "2", "--strategy", "auto", "--schedule", "async-1f1b"),
     "async-1f1b is asynchronous, and a per-layer strategy trains synchronously"),
    (("--stages", "2", "--dp", "2", "--strategy", "auto", "--schedule", "interleaved-1f1b"),
     "each on its own rank group: use a schedule with one stage per rank"),
    (("--stages", "2", "--dp", "2", "--strategy", "dp", "--batch-size", "8", "--granularity", "node"),
     "is no module of the strategy trace, so its cut cannot be placed there; compile with --granularity auto"),
    (("--stages", "1", "--dp", "3", "--strategy", "auto"), "power of two"),
    (("--stages", "1", "--dp", "1", "--strategy", "dp"), "power of two"),
    (("--stages", "1", "--dp", "4", "--strategy", "splitbrain", "--group", "3"), "--group 3 must divide --dp 4"),
    (("--stages", "1", "--dp", "4", "--group", "2"), "--strategy splitbrain"),
])
def test_refusals_are_one_line(args: tuple[str, ...], words: str) -> None:
    line = one_line_error(fxpipe_cli("compile", "vgg-tiny", *args))
    assert words in line


def test_a_corrupt_record_is_one_plan_file_error(tmp_path: Path) -> None:
    _, out = _compile(tmp_path, "vgg-tiny", "--stages", "1", "--dp", "2", "--strategy", "dp")
    plan_file = out / "plan.json"
    good = json.loads(plan_file.read_text())
    for change, words in [({"group": 3}, "group 3"), ({"ranks": 3}, "ranks 3"), ({"name": "zz"}, "name 'zz'"),
                          ({"nodes": [["x", "q9"]]}, "configuration 'q9'"), ({"nodes": "x"}, "should be"),
                          ({"cost": "fast"}, "should be float"), ({"extra": 1}, "unknown field")]:
        doc = json.loads(json.dumps(good))
        doc["plan"]["strategy"].update(change)
        plan_file.write_text(json.dumps(doc))
        with pytest.raises(PlanFileError, match="strategy") as info:
            read_plan(out)
        assert words in str(info.value) and "\n" not in str(info.value)
    plan_file.write_text(json.dumps(good))
    assert read_plan(out).strategy is not None


def test_plans_without_a_record_encode_as_before() -> None:
    record = StrategyRecord("dp", 2, 2, "data-parallel", 1.0, (("x", "s2"),))
    assert record.problems() == []
    assert StrategyRecord("dp", 2, 2, "data-parallel", 1.0, (("x", "s2c2"),)).problems()
    plan = Plan(Provenance(None, "export", "2.13.0", "0.1.0"), CompileOptions(stages=1, dp=2), (), (),
                (StageCost(0, 0, 1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0),), Link(1e9, 1e-4),
                Mesh.from_rank_of_stage((0,), 2), 3.0, 3.0)
    assert "strategy" not in plan.to_json()
    with_record = dataclasses.replace(plan, strategy=record)
    assert with_record.to_json()["strategy"]["nodes"] == [["x", "s2"]]
    assert Plan.from_json(with_record.to_json()) == with_record
