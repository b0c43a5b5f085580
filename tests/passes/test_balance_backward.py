"""balance_backward: activation derivatives move across a cut only when that lowers the bottleneck; gradients stay exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe import models
from fxpipe.errors import OptionError
from tests.passes.test_split_backward import check_fbw_matches_eager


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
