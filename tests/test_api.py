"""Tests for the public Python API: fxpipe.compile, the Pipeline it returns, its reports and its errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx

import fxpipe
from fxpipe import models
from fxpipe.passes import DEFAULT_PASSES
from fxpipe.report import Report


@pytest.fixture(scope="module")
def gpt() -> tuple[models.ZooModel, fxpipe.Pipeline]:
    zoo = models.build("gpt-tiny")
    return zoo, fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)


@pytest.fixture(scope="module")
def mlp3() -> tuple[models.ZooModel, fxpipe.Pipeline]:
    zoo = models.build("mlp-tiny")
    return zoo, fxpipe.compile(zoo.model, zoo.example_inputs, stages=3)


@pytest.fixture(scope="module")
def mlp_fx() -> tuple[models.ZooModel, fxpipe.Pipeline]:
    zoo = models.build("mlp-tiny")
    return zoo, fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, tracer="fx")


@pytest.mark.parametrize("fixture, k", [("gpt", 2), ("mlp3", 3)])
def test_compile_returns_a_pipeline_of_k_graph_module_stages(request: pytest.FixtureRequest, fixture: str,
                                                             k: int) -> None:
    _, pipe = request.getfixturevalue(fixture)
    assert isinstance(pipe, fxpipe.Pipeline)
    assert isinstance(pipe, torch.nn.Module)
    assert len(pipe.stages) == k == pipe.num_stages
    for idx, stage in enumerate(pipe.stages):
        assert isinstance(stage, fxpipe.Stage)
        assert stage.index == idx
        assert isinstance(stage.module, torch.fx.GraphModule)
        # Every stage does some work: no empty stage.
        assert any(n.op in ("call_function", "call_module", "call_method") for n in stage.module.graph.nodes)


@pytest.mark.parametrize("fixture", ["gpt", "mlp3", "mlp_fx"])
def test_pipeline_parameters_are_exactly_the_models_by_identity(request: pytest.FixtureRequest, fixture: str) -> None:
    zoo, pipe = request.getfixturevalue(fixture)
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in zoo.model.parameters()}
    # Counted with duplicates removed: the tied gpt weight is one Parameter, held by two stages.
    assert sum(p.numel() for p in pipe.parameters()) == sum(p.numel() for p in zoo.model.parameters())


def test_tied_parameter_is_one_object_in_both_gpt_stages(gpt: tuple[models.ZooModel, fxpipe.Pipeline]) -> None:
    zoo, pipe = gpt
    assert pipe.shared_params == {"lm_head.weight": [0, 1]}
    first = pipe.stages[0].module.get_parameter("lm_head.weight")
    last = pipe.stages[1].module.get_parameter("lm_head.weight")
    assert first is last is zoo.model.lm_head.weight


def test_the_simulator_sums_the_tied_weight_only_across_ranks(gpt: tuple[models.ZooModel, fxpipe.Pipeline]) -> None:
    """``fxpipe run`` tells the simulator which weights its ranks sum at the step's end (``Costs.tied``): gpt-tiny's
    tied LM head, with its bytes, when its two stages are on two ranks; nothing when one rank holds both."""
    from fxpipe.cli.rank import tied_costs

    zoo, pipe = gpt
    weight = zoo.model.lm_head.weight
    assert tied_costs(pipe, (0, 1)) == (((0, 1), float(weight.numel() * 4)),)
    assert tied_costs(pipe, (0, 0)) == ()


@pytest.mark.parametrize("fixture", ["gpt", "mlp3", "mlp_fx"])
def test_pipeline_output_equals_the_models(request: pytest.FixtureRequest, fixture: str) -> None:
    zoo, pipe = request.getfixturevalue(fixture)
    with torch.no_grad():
        torch.testing.assert_close(pipe(*zoo.example_inputs), zoo.model(*zoo.example_inputs))


def test_report_is_one_titled_table_per_pass_then_the_timings(gpt: tuple[models.ZooModel, fxpipe.Pipeline]) -> None:
    _, pipe = gpt
    reports = pipe.report()
    assert isinstance(reports, list)
    assert all(isinstance(r, Report) for r in reports)
    titles = [r.title for r in reports]
    for name in DEFAULT_PASSES:
        assert any(t == name or t.startswith(f"{name}:") for t in titles), f"no table for pass {name}: {titles}"
    assert titles[-1] == "passes"
    assert reports[-1].column("pass") == list(DEFAULT_PASSES)
    for report in reports:
        assert report.columns, report.title
        assert all(len(row) == len(report.columns) for row in report.rows), report.title


def test_history_has_one_timed_record_per_pass(gpt: tuple[models.ZooModel, fxpipe.Pipeline]) -> None:
    _, pipe = gpt
    assert pipe.history is not None
    records = pipe.history.records
    assert [r.name for r in records] == list(DEFAULT_PASSES)
    for rec in records:
        assert rec.seconds >= 0
        assert rec.num_nodes > 0
        assert rec.verified  # compile() verifies after every pass unless told not to
        assert rec.printed is None


def test_print_after_keeps_the_printed_graph() -> None:
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, print_after=("group-layers",))
    printed = {r.name: r.printed for r in pipe.history.records}
    assert printed["group-layers"] is not None and "def forward" in printed["group-layers"]
    assert all(text is None for name, text in printed.items() if name != "group-layers")


def test_compile_does_not_change_the_model() -> None:
    zoo = models.build("mlp-tiny")
    before = copy.deepcopy(zoo.model.state_dict())
    fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    after = zoo.model.state_dict()
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)


def test_unknown_option_raises_option_error() -> None:
    zoo = models.build("mlp-tiny")
    with pytest.raises(fxpipe.OptionError, match=r"unknown compile option\(s\) \['bogus'\]"):
        fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, bogus=1)


def test_stop_after_an_early_pass_raises_option_error() -> None:
    zoo = models.build("mlp-tiny")
    with pytest.raises(fxpipe.OptionError, match="run_steps"):
        fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, stop_after="trace")


def test_zero_stages_raises_plan_error() -> None:
    zoo = models.build("mlp-tiny")
    with pytest.raises(fxpipe.PlanError):
        fxpipe.compile(zoo.model, zoo.example_inputs, stages=0)


def test_zero_stages_error_names_the_stage_count() -> None:
    zoo = models.build("mlp-tiny")
    with pytest.raises(fxpipe.PlanError, match=r"stages must be at least 1 \(stages: 0\)"):
        fxpipe.compile(zoo.model, zoo.example_inputs, stages=0)


def test_more_stages_than_layers_raises_plan_error() -> None:
    zoo = models.build("mlp-tiny")
    with pytest.raises(fxpipe.PlanError, match=r"cannot make 50 stages from \d+ layers"):
        fxpipe.compile(zoo.model, zoo.example_inputs, stages=50)


def test_errors_refine_builtins() -> None:
    assert issubclass(fxpipe.OptionError, ValueError) and issubclass(fxpipe.OptionError, fxpipe.FxpipeError)
    assert issubclass(fxpipe.PlanError, ValueError) and issubclass(fxpipe.PlanError, fxpipe.FxpipeError)
    assert issubclass(fxpipe.PlanFileError, ValueError) and issubclass(fxpipe.PlanFileError, fxpipe.FxpipeError)
    assert issubclass(fxpipe.TraceError, RuntimeError) and issubclass(fxpipe.TraceError, fxpipe.FxpipeError)


@pytest.mark.parametrize("fixture", ["gpt", "mlp_fx"])
def test_wrong_number_of_inputs_raises_option_error(request: pytest.FixtureRequest, fixture: str) -> None:
    zoo, pipe = request.getfixturevalue(fixture)
    (x,) = zoo.example_inputs
    with pytest.raises(fxpipe.OptionError):
        pipe()
    with pytest.raises(fxpipe.OptionError):
        pipe(x, x)


def test_wrong_number_of_inputs_message_names_the_inputs(mlp_fx: tuple[models.ZooModel, fxpipe.Pipeline]) -> None:
    zoo, pipe = mlp_fx
    (x,) = zoo.example_inputs
    with pytest.raises(fxpipe.OptionError, match=r"takes 1 inputs \(\w+\), got 2"):
        pipe(x, x)


def test_keyword_inputs_to_a_positional_pipeline_raise_option_error(
    mlp_fx: tuple[models.ZooModel, fxpipe.Pipeline],
) -> None:
    zoo, pipe = mlp_fx
    with pytest.raises(fxpipe.OptionError, match="positional inputs only"):
        pipe(input=zoo.example_inputs[0])


def test_unknown_public_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fxpipe.nope  # noqa: B018
