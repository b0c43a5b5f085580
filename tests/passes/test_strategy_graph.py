"""strategy_graph: one LayerSpec per fx node of a real model, data edges (residual blocks included), and the
model left as it was."""

from __future__ import annotations

import copy

import pytest
import torch

from fxpipe.errors import OptionError
from fxpipe.models import gpt, resnet, vgg
from fxpipe.passes.strategy_graph import strategy_graph
from fxpipe.planning.strategies import build_graph, eliminate


def test_vgg_is_a_chain_of_typed_layers() -> None:
    model = vgg.make_model("tiny")
    g = strategy_graph(model, (torch.randn(4, 3, 32, 32),))
    kinds = {s.name: s.kind for s in g.specs}
    assert kinds["x"] == "input" and kinds["loss"] == "loss"
    assert kinds["features_0"] == "matmul" and kinds["classifier_0"] == "matmul"
    assert kinds["features_1"] == "elementwise"
    assert g.edges == tuple((i, i + 1) for i in range(len(g.specs) - 1))
    fc = next(s for s in g.specs if s.name == "classifier_0")
    assert fc.param_bytes == sum(p.numel() * 4 for p in model.classifier[0].parameters())
    assert fc.bias_bytes == model.classifier[0].bias.numel() * 4


def test_resnet_keeps_its_residual_edges_and_reduces_to_one_layer() -> None:
    model = resnet.make_model("tiny")
    before = copy.deepcopy(dict(model.named_buffers()))
    g = strategy_graph(model, (torch.randn(4, 3, 32, 32),))
    assert len(g.edges) > len(g.specs) - 1  # the shortcuts
    bn = next(s for s in g.specs if s.name == "bn1")
    assert bn.stat_bytes == 2 * model.bn1.num_features * 4
    for name, b in model.named_buffers():  # the trace's run moved no BatchNorm statistics
        torch.testing.assert_close(b, before[name])
    assert model.training
    graph = build_graph(g.specs, g.edges, 2, bandwidth=1e9, latency=1e-4)
    assert len(eliminate(graph).remaining) == 1


def test_profiled_costs_are_measured() -> None:
    g = strategy_graph(vgg.make_model("tiny"), (torch.randn(4, 3, 32, 32),), profile_runs=2)
    assert all(s.seconds > 0 for s in g.specs if s.kind in ("matmul", "elementwise"))


def test_a_model_fx_cannot_trace_is_one_error() -> None:
    with pytest.raises(OptionError, match="symbolic_trace"):
        strategy_graph(gpt.make_model("tiny"), (torch.zeros(2, 8, dtype=torch.long),))


def test_calibrated_rates_cost_each_kind_at_its_own() -> None:
    """compute=: a Linear at the GEMM rate, a convolution at the conv rate plus its per-call time (fixed_seconds,
    not divided by the split), other layers at the measured bandwidth."""
    from fxpipe.plan import ComputeRates

    rates = ComputeRates(gemm_flops=1e9, conv_flops=1e8, mem_bw=1e15, op_fwd=1.0, op_bwd=1.0, threads=1,
                         conv_fwd=2e-5, conv_bwd=3e-5)
    model = vgg.make_model("tiny")
    x = torch.randn(4, 3, 32, 32)
    fixed = {s.name: s for s in strategy_graph(model, (x,)).specs}
    g = strategy_graph(model, (x,), compute=rates)
    specs = {s.name: s for s in g.specs}
    conv, fc = specs["features_0"], specs["classifier_0"]
    flops = {n: fixed[n].seconds * 1e11 / 3 for n in ("features_0", "classifier_0")}  # defaults: 3 x FLOPs / 1e11
    assert conv.seconds == pytest.approx(3 * flops["features_0"] / 1e8) and conv.fixed_seconds == pytest.approx(5e-5)
    assert fc.seconds == pytest.approx(3 * flops["classifier_0"] / 1e9) and fc.fixed_seconds == 0.0
    relu = specs["features_1"]
    assert relu.seconds == pytest.approx(fixed["features_1"].seconds * 1e10 / 1e15)  # bytes at the measured bandwidth
