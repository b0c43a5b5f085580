"""fxpipe.plan: the Plan round-trips through JSON exactly, refuses what it did not write, and DEFAULTS is the one place
defaults live."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from fxpipe.errors import PlanFileError
from fxpipe.plan import (
    DEFAULTS,
    PLAN_VERSION,
    BackwardMove,
    BuildRecipe,
    CompileOptions,
    LayerCost,
    Link,
    Mesh,
    Plan,
    Provenance,
    ScheduleRecord,
    StageCost,
    TensorSpec,
)

floats = st.floats(allow_nan=False, allow_infinity=False)  # plan.json holds finite numbers (the loader refuses others)
sizes = st.floats(min_value=0, allow_nan=False, allow_infinity=False)
names = st.text(max_size=12)
counts = st.integers(min_value=0, max_value=2**40)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    num_stages = draw(st.integers(1, 5))
    layers = tuple(LayerCost(i, draw(names), draw(sizes), draw(sizes), draw(sizes), draw(counts), draw(counts),
                             draw(counts), tuple(draw(st.lists(names, max_size=3))))
                   for i in range(draw(st.integers(num_stages, 8))))
    stages = tuple(StageCost(k, k, k + 1, *(draw(sizes) for _ in range(9))) for k in range(num_stages))
    options = CompileOptions(stages=num_stages, tracer=draw(st.sampled_from(["export", "fx"])),
                             memory_per_stage=draw(st.none() | sizes),
                             microbatches=draw(st.none() | st.integers(1, 64)),
                             schedule=draw(st.none() | st.sampled_from(["1f1b", "zb-h1", "async-1f1b", "auto"])),
                             bandwidth=draw(floats), latency=draw(sizes), profile=draw(st.booleans()),
                             cores=draw(st.none() | st.integers(1, 256)))
    schedule = draw(st.none() | st.builds(ScheduleRecord, names, names, st.integers(1, 64), names, st.booleans(),
                                          st.none() | st.sampled_from(["stale", "stash", "predict"]), sizes, sizes,
                                          st.booleans()))
    return Plan(
        provenance=Provenance(draw(st.none() | names), "export", "2.13.0", "0.1.0",
                              draw(st.none() | st.builds(BuildRecipe, st.sampled_from(["float32", "float64"]),
                                                         st.none() | st.integers(1, 512), st.integers(0, 9))),
                              draw(st.booleans()), draw(st.none() | st.integers(1, 16))),
        options=options,
        inputs=tuple(TensorSpec(draw(names), tuple(draw(st.lists(st.integers(0, 256), max_size=4))), "float32")
                     for _ in range(draw(st.integers(0, 3)))),
        layers=layers, stages=stages, link=Link(draw(floats), draw(sizes)),
        mesh=Mesh.from_rank_of_stage(tuple(range(num_stages))), bottleneck_s=draw(sizes), lower_bound_s=draw(sizes),
        schedule=schedule,
        backward_moves=tuple(BackwardMove(k, draw(names), draw(sizes))
                             for k in range(num_stages - 1) if draw(st.booleans())))


@settings(max_examples=60, deadline=None)
@given(plans())
def test_plan_round_trips_through_json_exactly(plan: Plan) -> None:
    text = json.dumps(plan.to_json())
    again = Plan.from_json(json.loads(text))
    assert again == plan
    assert json.dumps(again.to_json()) == text  # and writes the same bytes again


def test_a_plan_of_another_version_or_with_a_wrong_field_is_refused_naming_the_field() -> None:
    plan = Plan(Provenance(None, "export", "2.13.0", "0.1.0"), CompileOptions(), (), (),
                (StageCost(0, 0, 1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0),), Link(1e9, 1e-4),
                Mesh.from_rank_of_stage((0,)), 3.0, 3.0)
    doc = plan.to_json()
    with pytest.raises(PlanFileError, match=rf"plan version 99, this fxpipe reads {PLAN_VERSION}"):
        Plan.from_json({**doc, "version": 99})
    bad = json.loads(json.dumps(doc))
    bad["stages"][0]["f"] = "fast"
    with pytest.raises(PlanFileError, match=r"the plan\.stages\[0\]\.f should be float, found str"):
        Plan.from_json(bad)
    bad = json.loads(json.dumps(doc))
    bad["link"]["speed"] = 1
    with pytest.raises(PlanFileError, match=r"the plan\.link has unknown field\(s\) \['speed'\]"):
        Plan.from_json(bad)
    bad = json.loads(json.dumps(doc))
    del bad["mesh"]
    with pytest.raises(PlanFileError, match="lacks 'mesh'"):
        Plan.from_json(bad)
    bad = json.loads(json.dumps(doc))
    bad["options"]["stages"] = True  # a bool is not a count
    with pytest.raises(PlanFileError, match=r"options\.stages should be int"):
        Plan.from_json(bad)


def _tiny_plan(**options: object) -> Plan:
    return Plan(Provenance(None, "export", "2.13.0", "0.1.0"), CompileOptions(**options), (), (),  # type: ignore[arg-type]
                (StageCost(0, 0, 1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0),), Link(1e9, 1e-4),
                Mesh.from_rank_of_stage((0,)), 3.0, 3.0)


def test_cores_is_absent_from_plans_that_model_no_time_sharing_so_older_plans_load() -> None:
    doc = _tiny_plan().to_json()
    assert "cores" not in doc["options"]  # written exactly as before --cores existed
    assert Plan.from_json(json.loads(json.dumps(doc))).options.cores is None
    shared = _tiny_plan(cores=2).to_json()
    assert shared["options"]["cores"] == 2 and Plan.from_json(shared).options.cores == 2


@pytest.mark.parametrize(("value", "words"), [
    (0, r"the plan\.options\.cores must be at least 1 \(cores: 0\)"),
    (-3, r"options\.cores must be at least 1 \(cores: -3\)"),
    (2.5, r"options\.cores should be int, found float"),
    ("2", r"options\.cores should be int, found str"),
    (True, r"options\.cores should be int, found bool"),
])
def test_a_bad_cores_in_plan_json_is_one_plan_file_error(value: object, words: str) -> None:
    doc = _tiny_plan(cores=2).to_json()
    doc["options"]["cores"] = value
    with pytest.raises(PlanFileError, match=words) as info:
        Plan.from_json(json.loads(json.dumps(doc)))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("value", "words"), [
    (-1.0, r"provenance\.profile_mem_bw must be a positive number of bytes per second \(found -1\.0\)"),
    (0.0, r"provenance\.profile_mem_bw must be a positive"),
    ("fast", r"provenance\.profile_mem_bw should be"),
])
def test_a_bad_profiled_memory_bandwidth_is_one_plan_file_error(value: object, words: str) -> None:
    doc = _tiny_plan().to_json()
    assert doc["provenance"]["profile_mem_bw"] is None  # an estimated plan measured none
    doc["provenance"]["profile_mem_bw"] = value
    with pytest.raises(PlanFileError, match=words) as info:
        Plan.from_json(json.loads(json.dumps(doc)))
    assert "\n" not in str(info.value)
    doc["provenance"]["profile_mem_bw"] = 1.5e10
    assert Plan.from_json(json.loads(json.dumps(doc))).provenance.profile_mem_bw == 1.5e10


def test_the_mesh_says_which_ranks_hold_each_stage() -> None:
    mesh = Mesh.from_rank_of_stage((0, 1, 0, 1))  # interleaved: two stages per rank
    assert mesh.dims == ("pp", "dp") and mesh.shape == (2, 1) and mesh.world_size == 2
    assert mesh.stage_ranks == ((0,), (1,), (0,), (1,)) and mesh.rank_of_stage == (0, 1, 0, 1)


def test_compile_options_take_their_defaults_from_DEFAULTS_when_made(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CompileOptions().stages == DEFAULTS.stages
    monkeypatch.setattr(DEFAULTS, "stages", 7)
    monkeypatch.setattr(DEFAULTS, "bandwidth", 3e9)
    opts = CompileOptions()
    assert (opts.stages, opts.bandwidth, opts.num_microbatches) == (7, 3e9, DEFAULTS.microbatches_per_stage * 7)
    assert opts.schedule_name == DEFAULTS.schedule
    assert dataclasses.replace(opts, microbatches=3).num_microbatches == 3
    assert math.isclose(CompileOptions(latency=0.5).latency, 0.5)
