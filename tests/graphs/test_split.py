"""graphs.split: one stage's F, B and W from AOTAutograd's joint graph: the split by output_mask, aliasing outputs, the
fused fallback."""

from __future__ import annotations

import torch
import torch.nn as nn

import fxpipe
from fxpipe import models
from fxpipe.graphs.split import split_stage
from tests._helpers import DataDependent as _DataDependent


def test_convolution_backward_is_split_by_output_mask() -> None:
    zoo = models.build("resnet-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    last = pipe.stage_graphs[1]  # type: ignore[index]
    b_convs = [n for n in last.backward_input.graph.nodes if "convolution_backward" in str(n.target)]  # type: ignore[union-attr]
    w_convs = [n for n in last.backward_weight.graph.nodes if "convolution_backward" in str(n.target)]  # type: ignore[union-attr]
    assert b_convs and w_convs
    assert all(list(n.args[-1]) [1:] == [False, False] for n in b_convs)
    assert all(not list(n.args[-1])[0] for n in w_convs)
    assert "convolution_backward" in last.split_ops


def test_a_stage_that_cannot_be_split_falls_back_to_fused_and_says_why() -> None:
    graphs = split_stage(_DataDependent(), [torch.randn(2, 4, requires_grad=True)])
    assert graphs.fused and graphs.forward is None
    assert graphs.fused_reason == "DataDependentOutputException: aten._local_scalar_dense.default"


def test_flops_are_counted_only_with_a_counter() -> None:
    module = torch.fx.symbolic_trace(_Aliases())
    args = [torch.randn(2, 3, requires_grad=True), torch.randn(5, 4, requires_grad=True)]
    plain = split_stage(module, args)
    assert not plain.fused
    assert (plain.flops_forward, plain.flops_backward_input, plain.flops_backward_weight,
            plain.flops_fused_backward) == (0, 0, 0, 0)
    seen: list[str] = []
    counted = split_stage(module, args, count_flops=lambda gm: seen.append(type(gm).__name__) or 7)
    assert (counted.flops_forward, counted.flops_backward_input, counted.flops_backward_weight) == (7, 7, 7)
    assert counted.flops_fused_backward == 7 and len(seen) == 4  # F, B, W and the backward before the split


class _Aliases(nn.Module):
    """A stage cut between nodes: outputs that are views of its input and of its other output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.fc(y)
        return x.transpose(0, 1), h.view(-1), h


def test_outputs_that_alias_an_input_or_another_output_keep_their_gradients() -> None:
    """AOTAutograd gives such outputs no tangent; the split must not drop their gradients (it
    did: interleaved-1f1b's node-level cuts made transpose/view/flatten-only stages, and every
    stage before one trained on a partial gradient)."""
    torch.manual_seed(0)
    module = torch.fx.symbolic_trace(_Aliases())
    x, y = torch.randn(2, 3), torch.randn(5, 4)
    g = split_stage(module, [x.clone().requires_grad_(), y.clone().requires_grad_()])
    assert not g.fused and g.grad_inputs == (0, 1) and g.grad_outputs == (0, 1, 2)
    assert not any(n.target is torch.ops.aten.clone.default for n in g.forward.graph.nodes)  # type: ignore[union-attr]
    dys = [torch.randn(3, 2), torch.randn(20), torch.randn(5, 4)]
    result = g.forward(x, y)  # type: ignore[misc]
    saved = list(result[g.num_outputs:])
    b = g.backward_input(*(saved[i] if kind == "saved" else dys[i] for kind, i in g.b_slots))  # type: ignore[misc]
    w = g.backward_weight(*b[len(g.grad_inputs):],  # type: ignore[misc]
                          *(saved[i] if kind == "saved" else dys[i] for kind, i in g.w_slots))
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    want = torch.autograd.grad(module(xr, yr), [xr, yr, *(module.get_parameter(n) for n in g.param_names)], dys)
    for got, ref in zip([*b[: len(g.grad_inputs)], *w], want, strict=True):
        torch.testing.assert_close(got, ref)


class _Attention(nn.Module):
    """Causal self-attention of 2 heads; ``value_dim`` other than the query's makes the CPU take the math path."""

    def __init__(self, value_dim: int = 8) -> None:
        super().__init__()
        self.qk, self.v = nn.Linear(16, 32), nn.Linear(16, 2 * value_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qk(x).chunk(2, -1))
        v = self.v(x).unflatten(-1, (2, -1)).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


def _attention_ops(graphs: object) -> set[str]:
    return {str(n.target) for gm in (graphs.forward, graphs.backward_input, graphs.backward_weight)  # type: ignore[attr-defined]
            for n in gm.graph.nodes
            if n.op == "call_function" and ("attention" in str(n.target) or "softmax" in str(n.target))}


def test_attention_on_meta_holds_what_the_cpu_holds() -> None:
    """A model planned on meta is costed as a device runs it: attention takes the CPU's fused kernel, which keeps no
    T x T weights for backward, where the CPU would take it (meta's own dispatch always takes the math path); where
    the CPU takes the math path (value and query head sizes differ), meta does too."""
    for value_dim, kernel in ((8, "aten._scaled_dot_product_flash_attention_for_cpu.default"),
                              (4, "aten._safe_softmax.default")):
        split = {}
        for device in ("cpu", "meta"):
            torch.manual_seed(0)
            module = _Attention(value_dim).to(device)
            split[device] = split_stage(module, [torch.randn(3, 24, 16, device=device, requires_grad=True)])
        cpu, meta = split["cpu"], split["meta"]
        assert kernel in _attention_ops(cpu) and _attention_ops(meta) == _attention_ops(cpu)
        assert (meta.bytes_f_to_b, meta.bytes_b_to_w) == (cpu.bytes_f_to_b, cpu.bytes_b_to_w)
