"""A rank of a loaded plan splits only its own stages: the others' interfaces come from plan.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fxpipe
from fxpipe.errors import PlanFileError
from fxpipe.graphs.convention import StageInterface
from fxpipe.runtime.executor import _example_inputs
from fxpipe.runtime.lower import check_programs, lower
from fxpipe.schedules.generators import generate
from fxpipe.schedules.simulate import Costs
from tests._helpers import zoo_pipe as _pipe


@pytest.mark.parametrize(("name", "schedule", "stages", "ranks"), [
    ("skip-tied", "1f1b", 4, 4), ("gpt-tiny", "interleaved-1f1b", 4, 2), ("resnet-tiny", "zb-h2", 2, 2)])
def test_each_rank_lowers_as_if_it_had_split_every_stage(name: str, schedule: str, stages: int, ranks: int,
                                                         tmp_path: Path) -> None:
    pipe = _pipe(name, stages)
    fxpipe.save(pipe, tmp_path / "plan")
    sched = generate(schedule, stages, 2 * ranks, Costs.from_plan(pipe.plan))
    programs = []
    for r in range(ranks):
        mine = {s for s, q in enumerate(sched.rank_of_stage) if q == r}
        loaded = fxpipe.load(tmp_path / "plan")
        assert [st.interface for st in loaded.stage_list()] == [StageInterface.of(g) for g in pipe.stage_graphs]
        graphs = loaded.build_backward(_example_inputs(loaded), only=mine)
        # Its own stages are split; of the others it built the interface and traced nothing.
        assert [not g.remote for g in graphs] == [s in mine for s in range(stages)]
        assert all(g.forward is None and g.backward_weight is None for g in graphs if g.remote)
        assert all(loaded.stage_list()[s].graphs is None for s in range(stages) if s not in mine)
        program = lower(loaded, sched, r, graphs)
        full = lower(pipe, sched, r)
        assert [(op.action, op.sends, op.recvs) for op in program.ops] == \
               [(op.action, op.sends, op.recvs) for op in full.ops]
        programs.append(program)
    check_programs(programs)


def test_a_plan_whose_interface_disagrees_with_its_stage_is_refused(tmp_path: Path) -> None:
    fxpipe.save(_pipe("mlp-tiny", 2), tmp_path / "plan")
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    doc["stages"][1]["interface"]["grad_inputs"] = []  # stage 1 says it sends no gradient back to stage 0
    (tmp_path / "plan" / "plan.json").write_text(json.dumps(doc))
    loaded = fxpipe.load(tmp_path / "plan")
    loaded.build_backward(_example_inputs(loaded), only={0})  # rank 0 trusts the record: it cannot check stage 1
    with pytest.raises(PlanFileError, match=r"stage 1 splits into a backward with gradients for inputs \[0\].*"
                                            r"records \[\] .*re-run fxpipe compile"):
        fxpipe.load(tmp_path / "plan").build_backward(_example_inputs(loaded), only={1})  # rank 1 checks its own


@pytest.mark.parametrize(("damage", "why"), [
    (lambda i: i.update(grad_inputs=[-1]), "non-negative integers"),
    (lambda i: i.update(extra=1), "exactly grad_inputs, grad_outputs and fused_reason"),
    (lambda i: i.update(fused_reason=3), "fused_reason must be a string or null"),
])
def test_a_malformed_interface_is_refused_at_load(tmp_path: Path, damage, why: str) -> None:  # type: ignore[no-untyped-def]
    fxpipe.save(_pipe("mlp-tiny", 2), tmp_path / "plan")
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    damage(doc["stages"][0]["interface"])
    (tmp_path / "plan" / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PlanFileError, match=f"stage 0 has a malformed interface .*{why}.*re-run fxpipe compile"):
        fxpipe.load(tmp_path / "plan")


def test_a_plan_without_interfaces_splits_every_stage(tmp_path: Path) -> None:
    fxpipe.save(_pipe("mlp-tiny", 2), tmp_path / "plan")
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    for s in doc["stages"]:
        del s["interface"]  # as plans written before the record
    (tmp_path / "plan" / "plan.json").write_text(json.dumps(doc))
    loaded = fxpipe.load(tmp_path / "plan")
    graphs = loaded.build_backward(_example_inputs(loaded), only={0})
    assert not any(g.remote for g in graphs) and loaded.stage_graphs is not None


def test_a_second_placement_splits_only_the_stages_still_without_graphs(tmp_path: Path) -> None:
    fxpipe.save(_pipe("gpt-tiny", 4), tmp_path / "plan")
    loaded = fxpipe.load(tmp_path / "plan")
    first = loaded.build_backward(_example_inputs(loaded), only={0, 3})  # e.g. zb-v's rank 0
    second = loaded.build_backward(_example_inputs(loaded), only={1})  # then 1f1b's rank 1
    assert second[0] is first[0] and second[3] is first[3]  # kept, not split again
    assert [g.remote for g in second] == [False, False, True, False]
    assert [st.graphs is not None for st in loaded.stage_list()] == [True, True, False, True]
