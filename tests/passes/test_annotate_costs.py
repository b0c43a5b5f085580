"""annotate_costs: shapes, bytes and FLOPs on fake tensors; the per-node FLOPs add up to the model's."""

from __future__ import annotations

import pytest
import torch

from fxpipe import models
from fxpipe._compat import flop_counter_mode
from fxpipe.graphs.fx import compute_nodes
from fxpipe.meta import get_meta
from fxpipe.passes.annotate_costs import annotate_costs, verify_costs
from fxpipe.passes.trace import trace


@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny", "resnet-tiny", "vgg-tiny"])
def test_node_flops_sum_to_the_whole_model(name: str) -> None:
    zoo = models.build(name)
    gm = annotate_costs(trace(zoo.model, zoo.example_inputs).gm, zoo.example_inputs).gm
    with flop_counter_mode() as counter:
        zoo.model(*zoo.example_inputs)
    total = sum(get_meta(n).flops_fwd for n in compute_nodes(gm.graph))
    assert total == counter.get_total_flops() > 0
    assert verify_costs(gm) == []


def test_shapes_bytes_and_estimates_on_a_linear() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    x = torch.randn(4, 8)
    gm = annotate_costs(trace(model, (x,)).gm, (x,)).gm
    linear = next(n for n in compute_nodes(gm.graph) if "linear" in n.name)
    meta = get_meta(linear)
    assert meta.shape == ((4, 16),)
    assert meta.dtype == "float32"
    assert meta.out_bytes == 4 * 16 * 4
    assert meta.param_bytes == (8 * 16 + 16) * 4
    assert meta.flops_fwd == 2 * 4 * 8 * 16
    # The input is data (no gradient), so the linear has no input-gradient work; its weight does.
    assert meta.flops_bwd_input == 0
    assert meta.flops_bwd_weight == meta.flops_fwd
    relu = next(n for n in compute_nodes(gm.graph) if "relu" in n.name)
    assert get_meta(relu).saved_bytes == 4 * 16 * 4  # on the gradient path: kept for backward


def test_cpu_attention_is_counted() -> None:
    zoo = models.build("gpt-tiny")
    gm = annotate_costs(trace(zoo.model, zoo.example_inputs).gm, zoo.example_inputs).gm
    sdpa = [n for n in compute_nodes(gm.graph) if "scaled_dot_product" in n.name]
    assert sdpa and all(get_meta(n).flops_fwd > 0 for n in sdpa)


def test_meta_model_costs_without_allocating() -> None:
    real = models.build("gpt-tiny")
    fake = models.build("gpt-tiny", device="meta")
    gm_real = annotate_costs(trace(real.model, real.example_inputs).gm, real.example_inputs).gm
    gm_meta = annotate_costs(trace(fake.model, fake.example_inputs).gm, fake.example_inputs).gm
    # On meta, attention traces to its math form (a few more nodes) but the same FLOPs.
    total_real = sum(get_meta(n).flops_fwd for n in compute_nodes(gm_real.graph))
    assert total_real == sum(get_meta(n).flops_fwd for n in compute_nodes(gm_meta.graph)) > 0
    assert all(p.is_meta for p in gm_meta.parameters())


def test_input_graph_is_not_mutated() -> None:
    zoo = models.build("mlp-tiny")
    gm = trace(zoo.model, zoo.example_inputs).gm
    out = annotate_costs(gm, zoo.example_inputs).gm
    assert out is not gm
    assert all("fxpipe" not in n.meta for n in gm.graph.nodes)
    assert out.get_parameter("fc0.weight") is gm.get_parameter("fc0.weight")
