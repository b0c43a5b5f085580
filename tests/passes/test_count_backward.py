"""count_backward: per-layer B and W FLOPs counted on real split graphs replace the estimates."""

from __future__ import annotations

import pytest

import fxpipe
from fxpipe import models
from fxpipe.passes.group_layers import layer_stats


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny", "vgg-tiny", "mlp-tiny"])
def test_layer_counts_add_up_to_each_stages_split_graphs(name: str) -> None:
    zoo = models.build(name)
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=3)
    counted = next(r for r in pipe.report() if r.title.startswith("count-backward"))
    assert set(counted.column("source")) == {"counted"}
    b, w = counted.column("B counted"), counted.column("W counted")
    bounds = list(pipe.plan.bounds)
    for k, g in enumerate(pipe.stage_graphs):  # type: ignore[arg-type]
        lo, hi = bounds[k], bounds[k + 1]
        assert sum(b[lo:hi]) + sum(w[lo:hi]) == g.flops_backward_input + g.flops_backward_weight, f"stage {k}"
        if k > 0:
            # A stage whose input needs a gradient splits exactly as its layers do. The first
            # stage has no input gradient, so the activation gradients inside it are W's work
            # (B is empty apart from what W needs), while per layer they are the next layer's B.
            assert sum(b[lo:hi]) == g.flops_backward_input, f"stage {k} B"
            assert sum(w[lo:hi]) == g.flops_backward_weight, f"stage {k} W"


def test_the_partitioner_plans_with_the_counted_costs() -> None:
    zoo = models.build("gpt-tiny")
    from fxpipe.api import build_steps
    from fxpipe.passes import run_steps
    from fxpipe.plan import CompileOptions

    gm, history = run_steps(build_steps(zoo.model, zoo.example_inputs, CompileOptions(stages=2)),
                            stop_after="count-backward", verify_each=True)
    counted = history.records[-1].reports[0]
    stats = layer_stats(gm)
    assert [s.flops_bwd_input for s in stats] == pytest.approx(counted.column("B counted"), abs=len(stats))
    assert [s.flops_bwd_weight for s in stats] == pytest.approx(counted.column("W counted"), abs=len(stats))
    # The attention block's input-gradient work is more than the forward-FLOPs estimate said.
    blocks = [i for i, s in enumerate(stats) if s.name.startswith("blocks.")]
    assert all(counted.column("B counted")[i] > counted.column("B est")[i] for i in blocks)


def test_identical_blocks_are_traced_once() -> None:
    zoo = models.build("gpt-small")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    counted = next(r for r in pipe.report() if r.title.startswith("count-backward"))
    assert counted.notes[0] == f"6 distinct layer graphs for {len(counted.rows)} layers"


def test_a_model_compiled_again_traces_none_of_its_layers_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.passes import count_backward as cb

    zoo = models.build("resnet-tiny")
    first = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    calls: list[int] = []
    real = cb.cached_split
    monkeypatch.setattr(cb, "cached_split", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = fxpipe.compile(zoo.model, zoo.example_inputs, stages=3)  # another stage count: the same layers
    table = [next(r for r in p.report() if r.title.startswith("count-backward")).rows for p in (first, again)]
    assert calls == [] and table[0] == table[1]
    other = models.build("resnet-tiny", batch_size=4)  # other shapes: counted anew
    fxpipe.compile(other.model, other.example_inputs, stages=2)
    assert calls


def test_leaf_modules_that_differ_only_in_configuration_have_different_signatures() -> None:
    import torch

    from fxpipe.graphs.stages import graph_signature

    def layer(stride: int) -> torch.fx.GraphModule:
        return torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=stride)))

    x = [torch.randn(1, 3, 8, 8)]
    assert graph_signature(layer(1), x) == graph_signature(layer(1), x)
    assert graph_signature(layer(1), x) != graph_signature(layer(2), x)  # same weight and input shapes


def test_profile_times_f_b_and_w_of_every_stage() -> None:
    zoo = models.build("mlp-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, profile=True, profile_runs=2)
    table = next(r for r in pipe.report() if r.title.startswith("split-backward"))
    assert all(t > 0 for t in table.column("F ms") + table.column("W ms"))
    assert table.column("B ms")[1] > 0  # the second stage's input needs a gradient
    # each stage's W over 4 microbatches against the 4 one by one, timed too (batched-w's cost): a fraction, at most 1
    assert all(0.0 < s.w_batched <= 1.0 for s in pipe.plan.stages)
    gpt = models.build("gpt-tiny")
    plan = fxpipe.compile(gpt.model, gpt.example_inputs, stages=2, profile=True, profile_runs=2).plan
    assert [s.w_batched for s in plan.stages] == [1.0, 1.0]  # traced views hold the microbatch's size: no batching
