"""split_stages: stages own their parameters and compose back to the model (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.passes.split_stages import verify_split
from tests._helpers import assert_composes, skip_tied as _skip_tied, token_ce as _ce

ZOO = ["mlp-tiny", "gpt-tiny", "resnet-tiny", "vgg-tiny"]


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_composes(name: str, stages: int) -> None:
    zoo = models.build(name)
    assert_composes(zoo.model, zoo.example_inputs, zoo.loss_fn, zoo.example_target, stages)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_composes_bit_for_bit_in_float64(name: str) -> None:
    # Running the same ATen ops in the same order in one process is deterministic on CPU.
    zoo = models.build(name, dtype=torch.float64)
    assert_composes(zoo.model, zoo.example_inputs, zoo.loss_fn, zoo.example_target, 3, exact=True)


@pytest.mark.parametrize("name", ["mlp-tiny", "resnet-tiny", "vgg-tiny"])
def test_fx_tracer_composes(name: str) -> None:
    zoo = models.build(name)
    assert_composes(zoo.model, zoo.example_inputs, zoo.loss_fn, zoo.example_target, 2, tracer="fx")


def test_skip_connection_across_stages_and_tied_weights() -> None:
    model, inputs, target = _skip_tied()
    pipe = assert_composes(model, inputs, _ce, target, 4, granularity="1", exact=True)
    first, last = pipe.stages[0], pipe.stages[-1]
    # The skip value h0 is an input of every stage after the first (it is forwarded by the root).
    assert any("embedding" in name for name in last.inputs)
    # Tied policy: every stage that reads the weight holds it, as one Parameter object.
    shared = pipe.shared_params
    assert list(shared) == ["head.weight"]
    assert shared["head.weight"] == [0, 3]
    assert first.module.get_parameter("head.weight") is last.module.get_parameter("head.weight")
    assert sum(1 for _ in pipe.parameters()) == sum(1 for _ in model.parameters())
    assert any("shared parameter head.weight" in n for r in pipe.report() for n in r.notes)


def test_stages_own_their_parameters_and_root_owns_none() -> None:
    zoo = models.build("gpt-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    for stage in pipe.stages:
        names = {n for n, _ in stage.module.named_parameters()}
        used = {str(n.target) for n in stage.module.graph.nodes if n.op == "get_attr"}
        assert used and used <= names | {b for b, _ in stage.module.named_buffers()}
    assert not list(pipe.named_parameters(recurse=False))


def test_every_call_node_lands_in_exactly_one_stage() -> None:
    zoo = models.build("resnet-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=3)
    trace = pipe.history.records[0]
    total_calls = sum(
        1 for s in pipe.stages for n in s.module.graph.nodes if n.op in ("call_function", "call_method", "call_module")
    )
    assert total_calls == trace.reports[0].column("compute nodes")[0]


def test_verify_split_reports_a_stage_that_lost_its_parameter() -> None:
    zoo = models.build("mlp-tiny")
    from fxpipe.api import build_steps
    from fxpipe.passes import run_steps
    from fxpipe.plan import CompileOptions

    root, _ = run_steps(build_steps(zoo.model, zoo.example_inputs, CompileOptions(stages=2)))
    assert verify_split(root) == []
    stage = root.stage_1
    name = next(n for n, _ in stage.named_parameters())
    owner_path, _, leaf = name.rpartition(".")
    delattr(stage.get_submodule(owner_path), leaf)
    assert any("does not own" in p for p in verify_split(root))
