"""The boxed calling convention the runtime runs B and W with: the graph takes one list of its inputs, empties it,
and frees each input right after its last use (``fxpipe._compat.boxed``)."""

from __future__ import annotations

import weakref

import torch
import torch.fx

from fxpipe._compat import boxed

_seen: list[bool] = []


def _first_input_is_gone(x: torch.Tensor) -> torch.Tensor:
    _seen.append(_ref() is None)
    return x


_ref: weakref.ref = weakref.ref(torch.zeros(1))


def _graph() -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    doubled = g.call_function(torch.mul, (a, 2.0))  # a's last use
    checked = g.call_function(_first_input_is_gone, (doubled,))
    g.output((g.call_function(torch.add, (checked, b)),))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_each_input_is_freed_after_its_last_use_and_the_result_is_the_same() -> None:
    global _ref
    gm = _graph()
    box = boxed(gm)
    args = [torch.ones(4), torch.full((4,), 3.0)]
    _ref = weakref.ref(args[0])
    _seen.clear()
    out = box(args)
    assert args == []  # emptied: the caller holds no reference any more
    assert _seen == [True]  # ``a`` was freed before the graph went on
    torch.testing.assert_close(out[0], torch.full((4,), 5.0))
    kept = torch.ones(4)  # the unboxed graph keeps its inputs to the end
    _ref = weakref.ref(kept)
    _seen.clear()
    torch.testing.assert_close(gm(kept, torch.full((4,), 3.0))[0], out[0])
    assert _seen == [False]


def test_a_boxed_graph_shares_the_parameters() -> None:
    lin = torch.nn.Linear(3, 2)
    gm = torch.fx.symbolic_trace(lin)
    box = boxed(gm)
    assert box.weight is gm.weight and box.bias is gm.bias
    x = torch.randn(5, 3)
    torch.testing.assert_close(box([x.clone()]), gm(x))
