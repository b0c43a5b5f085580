"""The bridge from a compiled plan to the strategy search's LayerSpecs, on the zoo's vgg-tiny."""

from __future__ import annotations

import pytest

import fxpipe
from fxpipe.errors import OptionError
from fxpipe.models import build
from fxpipe.passes.strategy_specs import strategy_specs
from fxpipe.planning.strategies import build_graph, data_parallel, solve, splitbrain


@pytest.fixture(scope="module")
def vgg_tiny():  # type: ignore[no-untyped-def]
    zoo = build("vgg-tiny")
    plan = fxpipe.compile(zoo.model, zoo.example_inputs, stages=1, granularity="2").plan
    return zoo, plan


def test_vgg_tiny_kinds_and_bytes(vgg_tiny) -> None:  # type: ignore[no-untyped-def]
    zoo, plan = vgg_tiny
    specs, edges = strategy_specs(plan, zoo.model, zoo.example_inputs)
    assert specs[0].kind == "input" and specs[0].out_bytes == 2 * 3 * 32 * 32 * 4
    kinds = {s.name: (s.kind, s.spatial) for s in specs[1:]}
    assert kinds["features.0"] == kinds["features.3"] == kinds["features.6"] == ("matmul", True)
    assert kinds["features.1"] == kinds["features.2"] == ("elementwise", True)
    assert kinds["classifier.0"] == kinds["classifier.3"] == kinds["classifier.6"] == ("matmul", False)
    assert kinds["classifier.1"] == ("elementwise", False)
    assert edges == tuple((i, i + 1) for i in range(len(specs) - 1))
    by_name = {s.name: s for s in specs}
    assert by_name["features.0"].out_bytes == 2 * 8 * 32 * 32 * 4
    assert by_name["classifier.6"].out_bytes == 2 * 10 * 4
    assert by_name["classifier.0"].param_bytes == (512 * 256 + 256) * 4
    assert sum(s.param_bytes for s in specs) == sum(p.numel() * 4 for p in zoo.model.parameters())
    graph = build_graph(specs, edges, 4, bandwidth=1.5e9, latency=1e-4)
    sb = splitbrain(graph, specs, 2)
    chosen = dict(zip((s.name for s in specs), sb.names(graph)))
    assert chosen["features.0"] == "s4" and chosen["classifier.0"] == "s2c2" and chosen["classifier.3"] == "s2r2"
    assert chosen["classifier.1"] == chosen["classifier.2"] == "s2c2" and chosen["classifier.4"] == "s4"
    assert solve(graph).cost <= min(sb.cost, data_parallel(graph).cost) * (1 + 1e-9)


def test_a_layer_that_is_not_a_module_is_refused(vgg_tiny) -> None:  # type: ignore[no-untyped-def]
    zoo, _ = vgg_tiny
    plan = fxpipe.compile(zoo.model, zoo.example_inputs, stages=1, granularity="node").plan
    with pytest.raises(OptionError, match="granularity"):
        strategy_specs(plan, zoo.model, zoo.example_inputs)
