"""Pipeline.to_device: a loaded plan moved whole to another device (fxpipe run --device cuda moves it to the rank's
GPU)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.fx

import fxpipe
from fxpipe import models
from fxpipe.errors import OptionError
from fxpipe.graphs.fx import get_path


def _devices_in(gm: torch.fx.GraphModule) -> list[torch.device]:
    """Every torch.device literal in the graph's node arguments."""
    found: list[torch.device] = []
    for node in gm.graph.nodes:
        torch.fx.node.map_aggregate((node.args, node.kwargs),
                                    lambda a: found.append(a) if isinstance(a, torch.device) else None)
    return found


def _tensors_of(gm: torch.fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """Parameters, buffers and every tensor a get_attr node reads."""
    out = [(n, t) for n, t in (*gm.named_parameters(), *gm.named_buffers())]
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(get_path(gm, str(node.target)), torch.Tensor):
            out.append((str(node.target), get_path(gm, str(node.target))))
    return out


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    zoo = models.build("gpt-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    return fxpipe.save(pipe, tmp_path_factory.mktemp("to_device") / "plan")


def test_a_loaded_plan_moves_whole_with_its_constants_literals_and_tied_weights(gpt_plan: Path) -> None:
    pipe = fxpipe.load(gpt_plan)
    zoo = models.build("gpt-tiny")
    pipe.build_backward(zoo.example_inputs)  # F, B and W built before the move are moved too
    stages = pipe.stage_list()
    # A plain tensor attribute read by a get_attr node (a constant Module.to leaves where it is).
    first = stages[0].module
    object.__setattr__(first, "_scale", torch.ones(3))
    with first.graph.inserting_before(next(iter(n for n in first.graph.nodes if n.op == "output"))), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fx warns of a get_attr of a plain tensor: that is the point
        first.graph.get_attr("_scale")
    first.recompile()
    assert "_scale" not in dict(first.named_buffers())
    assert pipe.shared_params, "gpt-tiny ties wte and lm_head across its stages"
    tied = {name: {id(s.module.get_parameter(name)) for k, s in enumerate(stages) if k in holders}
            for name, holders in pipe.shared_params.items()}
    assert all(len(ids) == 1 for ids in tied.values())
    modules = [gm for s in stages for gm in (s.module, s.graphs.forward, s.graphs.backward_input,
                                             s.graphs.backward_weight) if gm is not None]
    assert torch.device("cpu") in [d for gm in modules for d in _devices_in(gm)], \
        "gpt-tiny's stages trace factory ops with device=cpu"

    assert pipe.to_device("meta") is pipe

    for gm in modules:
        for name, t in _tensors_of(gm):
            assert t.device.type == "meta", f"{name} stayed on {t.device}"
        assert all(d == torch.device("meta") for d in _devices_in(gm)), _devices_in(gm)
        assert "device = device(type='cpu')" not in gm.code  # recompiled
    for name, holders in pipe.shared_params.items():
        held = [s.module.get_parameter(name) for k, s in enumerate(stages) if k in holders]
        assert all(p is held[0] for p in held) and isinstance(held[0], torch.nn.Parameter), name
        assert held[0].requires_grad
    # The F graphs read the stage modules' parameters, the same objects after the move as before it.
    for s in stages:
        own = {id(p) for p in s.module.parameters()}
        assert {id(p) for p in s.graphs.forward.parameters()} <= own  # type: ignore[union-attr]
    assert isinstance(get_path(first, "_scale"), torch.Tensor) and "_scale" not in dict(first.named_buffers())


def test_a_pipeline_on_several_devices_is_refused(gpt_plan: Path) -> None:
    pipe = fxpipe.load(gpt_plan)
    pipe.stages[1].to("meta")
    with pytest.raises(OptionError, match=r"^the pipeline's tensors are on cpu, meta; to_device moves a pipeline "
                                          r"that is on one device"):
        pipe.to_device("cpu")
