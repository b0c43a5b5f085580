"""partition_stages on real graphs: cut bytes include skip connections, caps and stage counts are checked."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn

from fxpipe import models
from fxpipe.api import build_steps
from fxpipe.errors import OptionError, PlanError
from fxpipe.graphs.fx import compute_nodes
from fxpipe.meta import get_meta
from fxpipe.passes import PassResult, run_steps
from fxpipe.passes.group_layers import layer_stats
from fxpipe.passes.partition_stages import StageSearch, _cut_bytes, partition_stages, stage_cuts, verify_stages
from fxpipe.plan import CompileOptions, Link
from fxpipe.planning.stage_dp import stage_time


def _grouped(model: nn.Module, inputs: tuple[torch.Tensor, ...], granularity: str = "auto") -> torch.fx.GraphModule:
    opts = CompileOptions(granularity=granularity)
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
    out = partition_stages(gm, num_stages=3, link=Link(1e8, 1e-4))
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


# --- memory in flight per schedule (fxpipe.planning.cost) ----------------------------------------


def _memory_note(out: PassResult) -> str:
    return out.reports[0].notes[1]


def test_the_schedule_sets_the_activations_each_stage_plans_for() -> None:
    zoo = models.build("gpt-tiny")
    gm = _grouped(zoo.model, zoo.example_inputs)
    default = partition_stages(gm, num_stages=2, microbatches=4)
    assert _memory_note(default).endswith("activations of [2, 1] microbatches in flight (1F1B)")
    act = [c["saved_bytes"] for c in default.gm.meta["fxpipe_stage_costs"]]
    base = default.gm.meta["fxpipe_stage_plan"]
    for schedule, flights in [("1f1b", [2, 1]), ("gpipe", [4, 4]), ("zb-h1", [2, 2]), ("zb-h2", [3, 3]),
                              ("layerpipe", [2, 1])]:
        out = partition_stages(gm, num_stages=2, microbatches=4, schedule=schedule)
        plan = out.gm.meta["fxpipe_stage_plan"]
        assert plan.bounds == base.bounds  # no cap: memory does not move the cuts
        assert f"activations of {flights} microbatches in flight" in _memory_note(out), schedule
        for k in range(2):
            extra = plan.stage_memory[k] - base.stage_memory[k]
            assert extra == pytest.approx((flights[k] - [2, 1][k]) * act[k]), schedule
    assert "(ZB-H1: F->B and B->W together)" in _memory_note(
        partition_stages(gm, num_stages=2, microbatches=4, schedule="zb-h1"))
    # async-1f1b: 1F1B's microbatches in flight, each also keeping the weight version its F read (stash)
    out = partition_stages(gm, num_stages=2, microbatches=4, schedule="async-1f1b")
    plan, stats = out.gm.meta["fxpipe_stage_plan"], out.gm.meta["fxpipe_layer_stats"]
    assert "[2, 1] microbatches in flight (async-1f1b: each with its F's weight version (stash))" in _memory_note(out)
    for k in range(2):
        params = sum(s.param_bytes for s in stats[plan.bounds[k]:plan.bounds[k + 1]])
        assert params > 0
        assert plan.stage_memory[k] - base.stage_memory[k] == pytest.approx([2, 1][k] * params)


def test_a_cap_one_f_one_b_meets_can_be_too_small_for_gpipe() -> None:
    zoo = models.build("gpt-tiny")
    gm = _grouped(zoo.model, zoo.example_inputs)
    with pytest.raises(PlanError, match=r"the smallest cap that works is .* \((\d+) bytes\)") as info:
        partition_stages(gm, num_stages=2, microbatches=8, memory_per_stage=1024)
    cap = float(str(info.value).split("(")[-1].split(" bytes")[0])
    partition_stages(gm, num_stages=2, microbatches=8, memory_per_stage=cap)
    with pytest.raises(PlanError, match="no 2-stage plan fits"):
        partition_stages(gm, num_stages=2, microbatches=8, memory_per_stage=cap, schedule="gpipe")


def test_auto_plans_for_the_most_any_candidate_holds() -> None:
    zoo = models.build("gpt-tiny")
    gm = _grouped(zoo.model, zoo.example_inputs)
    # auto searches 2, 4 and 8 microbatches; GPipe at 8 holds all 8 on every stage.
    note = _memory_note(partition_stages(gm, num_stages=2, schedule="auto"))
    assert "activations of [8, 8] microbatches in flight (auto: the most any of its candidates" in note
    assert "at 2, 4, 8 microbatches" in note
    given = _memory_note(partition_stages(gm, num_stages=2, microbatches=3, schedule="auto"))
    assert "[3, 3] microbatches in flight" in given and "at 3 microbatches" in given


def test_unknown_schedule_and_counts_the_schedule_cannot_take() -> None:
    zoo = models.build("gpt-tiny")
    gm = _grouped(zoo.model, zoo.example_inputs)
    with pytest.raises(OptionError, match=r"unknown schedule 'zb-h3' \(known: gpipe, .*, auto\); pick one"):
        partition_stages(gm, num_stages=2, schedule="zb-h3")
    with pytest.raises(OptionError, match=r"multiple of 2 \(stages: 3\)"):
        partition_stages(gm, num_stages=3, schedule="interleaved-1f1b")
    out = partition_stages(gm, num_stages=4, schedule="interleaved-1f1b")  # 2 ranks, 4 microbatches
    assert "activations of [4, 3, 2, 1] microbatches in flight (interleaved-1f1b)" in _memory_note(out)


def _rows(result: PassResult, title: str) -> list[dict]:
    report = next(r for r in result.reports if r.title.startswith(title))
    return [dict(zip(report.columns, row)) for row in report.rows]


@pytest.fixture(scope="module")
def mlp_deep() -> torch.fx.GraphModule:
    zoo = models.build("mlp-deep")  # 16 equal linear layers: compute dominates at the default link
    return _grouped(zoo.model, zoo.example_inputs)


def test_plan_auto_on_fewer_cores_than_devices_picks_by_time_shared_speed(mlp_deep: torch.fx.GraphModule) -> None:
    from fxpipe.planning.plan_search import time_sharing

    free = _rows(partition_stages(mlp_deep, num_stages="plan", search=StageSearch(devices=4)), "plan auto")
    assert next(r for r in free if r[""] == "chosen")["devices"] == 4  # a core per rank: 4 ranks are fastest
    out = partition_stages(mlp_deep, num_stages="plan", search=StageSearch(devices=4, cores=2))
    rows = _rows(out, "plan auto")
    chosen = [r for r in rows if r[""] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["devices"] <= 2
    # Never slower in simulation than any candidate it considered, every one time-shared alike.
    assert all(chosen[0]["speedup"] >= r["speedup"] for r in rows)
    assert all(r["compute x"] == time_sharing(r["devices"], 2) for r in rows)
    assert any(r["devices"] > 2 for r in rows)  # 4-rank candidates were considered, and lost
    # A candidate on at most 2 ranks does not time-share: the same simulated step as with a core per rank.
    unshared = {(r["stages"], r["dp"], r["schedule"], r["microbatches"]): r["simulated step ms"] for r in free}
    key = (chosen[0]["stages"], chosen[0]["dp"], chosen[0]["schedule"], chosen[0]["microbatches"])
    if key in unshared:
        assert chosen[0]["simulated step ms"] == unshared[key]
    assert out.gm.meta["fxpipe_plan_choice"]["stages"] * out.gm.meta["fxpipe_plan_choice"]["dp"] <= 2
    report = next(r for r in out.reports if r.title.startswith("plan auto"))
    assert any(n.startswith("time-sharing modelled (--cores 2)") for n in report.notes)


def test_the_screen_keeps_the_time_shared_pick_simulating_everything_makes(
        mlp_deep: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    pass_module = importlib.import_module("fxpipe.passes.partition_stages")
    picks = []
    for everything in (False, True):
        if everything:
            monkeypatch.setattr(pass_module, "SIMULATED_CANDIDATES", 10**6)
        out = partition_stages(mlp_deep, num_stages="plan", search=StageSearch(devices=4, cores=2))
        rows = _rows(out, "plan auto")
        row = next(r for r in rows if r[""] == "chosen")
        picks.append((row["stages"], row["dp"], row["schedule"], row["microbatches"], len(rows)))
    assert picks[0][:4] == picks[1][:4] and picks[1][4] > picks[0][4]


def test_stages_auto_on_fewer_cores_than_devices_picks_by_time_shared_speed(mlp_deep: torch.fx.GraphModule) -> None:
    title = "partition-stages: stage count"
    free = _rows(partition_stages(mlp_deep, num_stages="auto", search=StageSearch(max_stages=4)), title)
    assert next(r for r in free if r[""] == "chosen")["stages"] == 4
    rows = _rows(partition_stages(mlp_deep, num_stages="auto", search=StageSearch(max_stages=4, cores=2)), title)
    chosen = [r for r in rows if r[""] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["stages"] <= 2
    assert all(chosen[0]["speedup"] >= r["speedup"] for r in rows)
    assert [r["compute x"] for r in rows] == [1.0, 1.0, 1.5, 2.0]
    by = {r["stages"]: r for r in free}
    for r in rows:  # up to 2 ranks nothing changes; beyond, every step is slower
        assert (r["simulated step ms"] == by[r["stages"]]["simulated step ms"]) if r["stages"] <= 2 else (
            r["simulated step ms"] > by[r["stages"]]["simulated step ms"])
    # dp replicas time-share too: 2 stages x 2 replicas on 2 cores compute twice as slowly.
    shared = _rows(partition_stages(mlp_deep, num_stages="auto", search=StageSearch(max_stages=2, dp=2, cores=2)),
                   title)
    assert [r["compute x"] for r in shared] == [1.0, 2.0]


def test_cores_below_one_are_refused(mlp_deep: torch.fx.GraphModule) -> None:
    with pytest.raises(OptionError, match=r"--cores must be at least 1 \(cores: 0\)"):
        partition_stages(mlp_deep, num_stages="plan", search=StageSearch(devices=4, cores=0))


def test_the_planners_sum_a_weight_tied_across_stages_after_their_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT's LM head reads the token embedding's weight: cut apart, its two stages' ranks all-reduce its gradient
    after their compute (``Costs.tied``), which the planners' simulations now charge, as ``fxpipe run``'s does."""
    import importlib

    ps = importlib.import_module("fxpipe.passes.partition_stages")  # the package re-exports the function's name

    zoo = models.build("gpt-tiny")
    gm = _grouped(zoo.model, zoo.example_inputs)
    stats = layer_stats(gm)
    shared = ps._shared_params(gm, stats)
    head = zoo.model.lm_head.weight
    assert shared == {"lm_head.weight": float(head.numel() * head.element_size())}
    last = len(stats)
    assert ps._tied(stats, [(0, last)], shared) == ()  # one stage holds both: nothing to sum
    assert ps._tied(stats, [(0, 2), (2, last)], shared) == (((0, 1), shared["lm_head.weight"]),)
    assert ps._tied(stats, [(0, 1), (1, 2), (2, last)], shared) == (((0, 2), shared["lm_head.weight"]),)
    slow = Link(1e6, 1e-3)  # a slow link: the tied all-reduce shows in every multi-stage count
    three = StageSearch(max_stages=3)
    tied = _rows(partition_stages(gm, num_stages="auto", link=slow, search=three), "partition-stages: stage count")
    monkeypatch.setattr(ps, "_shared_params", lambda gm, stats: {})
    untied = _rows(partition_stages(gm, num_stages="auto", link=slow, search=three), "partition-stages: stage count")
    column = next(k for k in tied[0] if k.startswith("simulated"))
    for a, b in zip(tied, untied):
        if a["stages"] == 1:
            assert a[column] == b[column]
        else:  # at least the all-reduce's two ring steps' latency (2 ranks: 2 x 1 ms)
            assert a[column] >= b[column] + 2.0 - 1e-3  # the table rounds to 1 us
