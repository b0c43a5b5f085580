"""group_layers: the default granularity finds the repeating blocks; overrides work; errors are clear."""

from __future__ import annotations

import pytest

from fxpipe import models
from fxpipe.errors import OptionError
from fxpipe.passes.annotate_costs import annotate_costs
from fxpipe.passes.group_layers import group_layers, layer_stats, verify_layers
from fxpipe.passes.trace import trace


def _layers(name: str, granularity: str = "auto") -> list[str]:
    zoo = models.build(name)
    gm = annotate_costs(trace(zoo.model, zoo.example_inputs).gm, zoo.example_inputs).gm
    out = group_layers(gm, granularity=granularity).gm
    assert verify_layers(out) == []
    return [s.name for s in layer_stats(out)]


def test_gpt_layers_are_its_blocks() -> None:
    assert _layers("gpt-tiny") == ["wte", "wpe", "drop", "blocks.0", "blocks.1", "ln_f", "lm_head"]


def test_resnet_layers_are_its_bottlenecks() -> None:
    names = _layers("resnet-tiny")
    assert [n for n in names if n.startswith("layer")] == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    assert names[-1] == "fc"


def test_depth_and_node_granularity() -> None:
    assert _layers("resnet-tiny", "1")[3:7] == ["layer1", "layer2", "layer3", "layer4"]
    zoo = models.build("mlp-tiny")
    gm = trace(zoo.model, zoo.example_inputs).gm
    nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    assert len(_layers("mlp-tiny", "node")) == nodes


def test_layer_costs_add_up() -> None:
    zoo = models.build("gpt-tiny")
    gm = annotate_costs(trace(zoo.model, zoo.example_inputs).gm, zoo.example_inputs).gm
    result = group_layers(gm)
    stats = layer_stats(result.gm)
    report = result.reports[0]
    assert report.column("name") == [s.name for s in stats]
    blocks = [s for s in stats if s.name.startswith("blocks.")]
    assert len({s.flops_fwd for s in blocks}) == 1  # identical blocks cost the same
    assert sum(s.num_nodes for s in stats) == sum(1 for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("bad, match", [("banana", "unknown --granularity 'banana'"), ("0", "at least 1")])
def test_bad_granularity(bad: str, match: str) -> None:
    zoo = models.build("mlp-tiny")
    gm = trace(zoo.model, zoo.example_inputs).gm
    with pytest.raises(OptionError, match=match):
        group_layers(gm, granularity=bad)
