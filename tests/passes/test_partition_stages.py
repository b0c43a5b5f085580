"""partition_stages on real graphs: cut bytes include skip connections, caps and stage counts are checked."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn

from fxpipe import models
from fxpipe.errors import PlanError
from fxpipe.meta import get_meta
from fxpipe.passes import CompileOptions, build_steps, run_steps
from fxpipe.passes._graph import compute_nodes
from fxpipe.passes.group_layers import layer_stats
from fxpipe.passes.partition_stages import _cut_bytes, partition_stages, stage_cuts, verify_stages
from fxpipe.passes.stage_dp import stage_time


def _grouped(model: nn.Module, inputs: tuple[torch.Tensor, ...], granularity: str = "auto") -> torch.fx.GraphModule:
    opts = CompileOptions(granularity=granularity, stop_after="group-layers")
    gm, _ = run_steps(build_steps(model, inputs, opts), verify_each=True, stop_after="group-layers")
    return gm


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.d(self.c(self.b(h)) + h)  # h skips over b and c


def test_cut_bytes_count_skip_connections() -> None:
    x = torch.randn(2, 8)
    gm = _grouped(Skip(), (x,), granularity="1")
    assert [s.name for s in layer_stats(gm)] == ["a", "b", "c", "d"]
    act = 2 * 8 * 4
    # After a: h. After b: b's output and h. After c: only the sum, because the add is in the
    # model's own forward and so joins the layer before it (c).
    assert _cut_bytes(gm, 4) == [act, 2 * act, act]


def test_stage_cuts_name_the_crossing_values() -> None:
    x = torch.randn(2, 8)
    gm = partition_stages(_grouped(Skip(), (x,), granularity="1"), num_stages=4).gm
    cuts = stage_cuts(gm)
    assert [len(c.values) for c in cuts] == [1, 2, 1]
    assert verify_stages(gm) == []


def test_partition_is_optimal_on_a_real_graph() -> None:
    """Brute force over every cut of the gpt-tiny layers with the same cost model."""
    zoo = models.build("gpt-tiny")
    gm = _grouped(zoo.model, zoo.example_inputs)
    costs = [s.time for s in layer_stats(gm)]
    cuts = _cut_bytes(gm, len(costs))
    out = partition_stages(gm, num_stages=3, bandwidth=1e8, latency=1e-4)
    plan = out.gm.meta["fxpipe_stage_plan"]
    best = math.inf
    for inner in itertools.combinations(range(1, len(costs)), 2):
        bounds = (0, *inner, len(costs))
        worst = max(stage_time(costs, cuts, bounds[k], bounds[k + 1], bandwidth=1e8, latency=1e-4) for k in range(3))
        best = min(best, worst)
    assert math.isclose(plan.bottleneck, best)
    assert plan.ratio >= 1.0
    stages = [get_meta(n).stage_idx for n in compute_nodes(out.gm.graph)]
    assert stages == sorted(stages) and set(stages) == {0, 1, 2}
    assert "= " in out.reports[0].notes[0] and "lower bound" in out.reports[0].notes[0]


def test_too_many_stages() -> None:
    zoo = models.build("mlp-tiny")
    gm = _grouped(zoo.model, zoo.example_inputs)
    layers = len(layer_stats(gm))
    with pytest.raises(PlanError, match=rf"cannot make 50 stages from {layers} layers .*lower --stages"):
        partition_stages(gm, num_stages=50)


def test_memory_cap_no_plan_meets_names_the_smallest_that_works() -> None:
    zoo = models.build("gpt-tiny")
    gm = _grouped(zoo.model, zoo.example_inputs)
    with pytest.raises(PlanError, match=r"the smallest cap that works is .* \((\d+) bytes\)") as info:
        partition_stages(gm, num_stages=2, memory_per_stage=1024)
    smallest = float(str(info.value).split("(")[-1].split(" bytes")[0])
    plan = partition_stages(gm, num_stages=2, memory_per_stage=smallest).gm.meta["fxpipe_stage_plan"]
    assert max(plan.stage_memory) <= smallest
