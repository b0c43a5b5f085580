"""W_acc adds each microbatch's weight gradients into the accumulators, GEMMs included, exactly like W then +=."""

from __future__ import annotations

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.graphs.accumulate import accumulating_weight_graph, grads_are_fresh


def _w_args(g: object, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    vals = [n.meta["val"] for n in g.forward.graph.nodes if n.op == "placeholder"]  # type: ignore[attr-defined]
    args = [torch.randn(v.shape, dtype=v.dtype, generator=gen) if v.is_floating_point()
            else torch.zeros(v.shape, dtype=v.dtype)
            for v in vals]
    res = g.forward(*args)  # type: ignore[attr-defined]
    saved = list(res[g.num_outputs:])  # type: ignore[attr-defined]
    grads = [torch.randn(res[j].shape, dtype=res[j].dtype, generator=gen) for j in g.grad_outputs]  # type: ignore[attr-defined]
    b = g.backward_input(*(saved[k] if kind == "saved" else grads[k] for kind, k in g.b_slots))  # type: ignore[attr-defined]
    return (*b[len(g.grad_inputs):], *(saved[k] if kind == "saved" else grads[k] for kind, k in g.w_slots))  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny", "resnet-tiny"])
def test_w_acc_equals_w_then_add(name: str) -> None:
    zoo = models.build(name, dtype=torch.float64)
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    total_fused = 0
    for g in pipe.stage_graphs:
        with torch.no_grad():  # as executors run the graphs
            total_fused += _check_stage(g)
    if name != "resnet-tiny":  # Linear layers: their weight gradients are GEMMs
        assert total_fused > 0
    # resnet's convolution weight gradients are not GEMMs: they take the add_ path (checked above).


def _check_stage(g: object) -> int:
    """W_acc adds into the buffers, W_set writes over them; returns how many GEMMs were fused."""
    n = len(g.param_names)  # type: ignore[attr-defined]
    w_acc, fused = accumulating_weight_graph(g.backward_weight, n)  # type: ignore[attr-defined]
    first, second = _w_args(g, 1), _w_args(g, 2)
    expected = [a + b for a, b in zip(g.backward_weight(*first), g.backward_weight(*second))]
    accs = [t.clone() for t in g.backward_weight(*first)]
    assert w_acc(*second, *accs) == ()
    for e, a in zip(expected, accs):
        torch.testing.assert_close(a, e)
    assert len(grads_are_fresh(g.backward_weight, n)) == n
    # W_set writes the second microbatch's gradients over the buffers, whatever they held.
    w_set, _ = accumulating_weight_graph(g.backward_weight, n, overwrite=True)
    assert w_set(*second, *accs) == ()
    for e, a in zip(g.backward_weight(*second), accs):
        torch.testing.assert_close(a, e)
    return fused


def test_fresh_detects_a_gradient_that_is_an_input() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    mm = graph.call_function(torch.ops.aten.mm.default, (x, y))
    view = graph.call_function(torch.ops.aten.view.default, (y, [-1]))
    graph.output((mm, view, mm))
    w = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert grads_are_fresh(w, 3) == [True, False, False]
