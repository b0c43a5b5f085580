"""balance_backward: activation derivatives move across a cut only when that lowers the bottleneck; gradients stay
exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe import models
from fxpipe.errors import OptionError
from tests._helpers import check_fbw_matches_eager


class Block(nn.Module):
    def __init__(self, n_in: int, n_out: int, act: type[nn.Module]) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Heavy(nn.Module):
    """A heavy first block ending in an activation, then light ones: stage 0 is the bottleneck."""

    def __init__(self, act: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(64, 1024, act), Block(1024, 16, act), Block(16, 16, act)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh, nn.Sigmoid])
def test_moving_the_derivative_lowers_the_bottleneck_and_keeps_gradients(act: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = Heavy(act)
    mbs = [((torch.randn(8, 64),), torch.randint(0, 4, (8,))) for _ in range(2)]
    pipe = check_fbw_matches_eager(model, mbs[0][0], _ce, mbs, 2, balance_backward=True, latency=0.0)
    table = next(r for r in pipe.report() if r.title.startswith("balance-backward"))
    assert table.column("decision") == ["moved to stage 1's B"]
    before, after = (float(x.split(" ms")[0]) for x in table.notes[0].split("before ")[1].split(", after "))
    assert after < before
    plain = fxpipe.compile(Heavy(act), mbs[0][0], stages=2, input_grads=True, latency=0.0)
    assert list(plain.plan.bounds) == list(pipe.plan.bounds)
    deriv = {nn.ReLU: "threshold_backward", nn.Tanh: "tanh_backward", nn.Sigmoid: "sigmoid_backward"}[act]

    def count(p: fxpipe.Pipeline, k: int) -> int:
        return sum(deriv in str(n.target) for n in p.stage_graphs[k].backward_input.graph.nodes)  # type: ignore[index,union-attr]

    assert count(pipe, 0) == count(plain, 0) - 1
    assert count(pipe, 1) == count(plain, 1) + 1


def test_gpt_has_nothing_to_move_and_says_so() -> None:
    zoo = models.build("gpt-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=3, balance_backward=True)
    table = next(r for r in pipe.report() if r.title.startswith("balance-backward"))
    assert table.rows == ()
    assert "no stage sends an activation" in table.notes[1]


def test_balance_needs_the_split_backward() -> None:
    zoo = models.build("mlp-tiny")
    with pytest.raises(OptionError, match="drop --no-split-backward"):
        fxpipe.compile(zoo.model, zoo.example_inputs, stages=2, balance_backward=True, split_backward=False)


class Middle(nn.Module):
    """At 3 stages stage 1 (the wide block) is the slowest and sends a ReLU's output: its derivative moves across
    cut 1, where stage 1 has a B of its own (its input takes a gradient) without input_grads."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(16, 16, nn.ReLU), Block(16, 1024, nn.ReLU), Block(1024, 16, nn.ReLU),
                                     Block(16, 16, nn.ReLU)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _derivatives(graphs: list) -> list[int]:  # type: ignore[type-arg]
    return [sum("threshold_backward" in str(n.target) for n in g.backward_input.graph.nodes) for g in graphs]


def _grads(pipe: fxpipe.Pipeline, mbs: list) -> dict[tuple[int, str], torch.Tensor]:  # type: ignore[type-arg]
    from fxpipe.runtime.reference import ReferenceExecutor

    ReferenceExecutor(pipe, _ce).run(mbs)
    return {(s.index, n): p.grad for s in pipe.stage_list() for n, p in s.module.named_parameters()}


def test_a_plan_directory_keeps_its_moves(tmp_path: Path) -> None:
    """The plan records the moves and its stages' B times after them; a loaded plan makes the same moves, on
    every stage or on one rank's (with the neighbours a move changes), and trains like the compiled pipeline."""
    from fxpipe.errors import PlanFileError

    torch.manual_seed(0)
    example = (torch.randn(8, 16),)
    mbs = [((torch.randn(8, 16),), torch.randint(0, 4, (8,))) for _ in range(2)]
    pipe = fxpipe.compile(Middle(), example, stages=3, balance_backward=True, latency=0.0)
    (move,) = pipe.plan.backward_moves
    assert (move.cut, move.value) == (1, "relu_2") and move.seconds > 0
    plain = fxpipe.compile(Middle(), example, stages=3, latency=0.0)
    assert plain.plan.backward_moves == () and plain.plan.bounds == pipe.plan.bounds
    assert pipe.plan.stages[1].b == pytest.approx(plain.plan.stages[1].b - move.seconds, rel=1e-9)
    assert pipe.plan.stages[2].b == pytest.approx(plain.plan.stages[2].b + move.seconds, rel=1e-9)
    compiled = _derivatives(pipe.stage_graphs)  # type: ignore[arg-type]
    assert compiled[1] == _derivatives(plain.stage_graphs)[1] - 1  # type: ignore[arg-type]
    fxpipe.save(pipe, tmp_path / "plan")

    loaded = fxpipe.load(tmp_path / "plan")
    assert loaded.plan.backward_moves == pipe.plan.backward_moves
    assert _derivatives(loaded.build_backward(example)) == compiled
    reference = _grads(pipe, mbs)
    for key, grad in _grads(loaded, mbs).items():
        torch.testing.assert_close(grad, reference[key], msg=lambda m: f"{key}: {m}")

    rank = fxpipe.load(tmp_path / "plan")  # the last stage's rank: it splits stage 1 too, the move's other side
    graphs = rank.build_backward(example, only={2})
    assert _derivatives(graphs[1:]) == compiled[1:] and graphs[0].remote
    assert [s.graphs is not None for s in rank.stage_list()] == [False, True, True]
    first = fxpipe.load(tmp_path / "plan")  # stage 0's: no moved cut touches it, nothing else is split
    assert [g.remote for g in first.build_backward(example, only={0})] == [False, True, True]

    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    doc["plan"]["backward_moves"][0]["value"] = "relu_1"  # not what stage 1 sends
    (tmp_path / "plan" / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PlanFileError, match="moves the derivative of 'relu_1' across cut 1, which the stages do not"):
        fxpipe.load(tmp_path / "plan").build_backward(example)
    doc["plan"]["backward_moves"][0].update(value="relu_2", cut=2)  # past the last cut
    (tmp_path / "plan" / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PlanFileError, match="backward_moves has a move across cut 2"):
        fxpipe.load(tmp_path / "plan")


def test_a_planned_move_the_split_graphs_cannot_make_is_taken_back_out_of_the_plan() -> None:
    """The DP plans Middle's move across cut 1 (stage 1 to 2); with stage 1's backward fused (no B of its own to
    start with the derivative) the pass keeps it where it was, and the plan's times are those of no move."""
    import dataclasses

    from fxpipe.api import CompileOptions, PassControl, run_compile
    from fxpipe.passes.balance_backward import balance_backward

    torch.manual_seed(0)
    example = (torch.randn(8, 16),)
    options = CompileOptions(stages=3, balance_backward=True, latency=0.0)
    split = PassControl(stop_after="split-backward")
    root = run_compile(Middle(), example, options, control=split).root
    assert root is not None
    planned = root.meta["fxpipe_stage_plan"]
    ((cut, value, seconds),) = planned.moves
    assert (planned.bounds.index(cut) - 1, value) == (1, "relu_2")
    graphs = list(root.meta["fxpipe_stage_graphs"])
    graphs[1] = dataclasses.replace(graphs[1], fused_reason="a test: not split")
    root.meta["fxpipe_stage_graphs"] = graphs
    result = balance_backward(root)
    (table,) = result.reports
    assert table.rows == ((1, "relu_2", "", round(seconds * 1e3, 5),
                           "kept: planned, but the split graphs cannot move it (B does not start with it)"),)
    plan = result.gm.meta["fxpipe_stage_plan"]
    assert plan.moves == () and result.gm.meta["fxpipe_backward_moves"] == []
    plain = run_compile(Middle(), example, CompileOptions(stages=3, latency=0.0), control=split).root
    assert plain is not None and plan.bounds == plain.meta["fxpipe_stage_plan"].bounds
    for got, want in zip(plan.stage_times, plain.meta["fxpipe_stage_plan"].stage_times, strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert result.gm.meta["fxpipe_stage_graphs"][2] is graphs[2]  # stage 2's graphs untouched


def test_the_fx_tracers_graphs_plan_the_same_move() -> None:
    """``--tracer fx`` graphs hold torch's modules and functions, not aten ops: the partitioner finds the same
    movable activation there (named as that tracer names it) and plans the same move."""
    torch.manual_seed(0)
    example = (torch.randn(8, 16),)
    moves = {tracer: fxpipe.compile(Middle(), example, stages=3, balance_backward=True, latency=0.0,
                                    tracer=tracer).plan.backward_moves for tracer in ("export", "fx")}
    assert [(m.cut, m.value) for m in moves["export"]] == [(1, "relu_2")]
    assert [(m.cut, m.value) for m in moves["fx"]] == [(1, "blocks_2_act")]
    assert moves["fx"][0].seconds == moves["export"][0].seconds
