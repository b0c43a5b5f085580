"""trace: torch.export front door, torch.fx fallback, and one clear error for untraceable models."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from fxpipe import models
from fxpipe.errors import TraceError
from fxpipe.meta import get_meta
from fxpipe.passes.trace import trace


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent: the line the error must name
            return h * 2
        return h


BRANCH_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "if h.sum() > 0" in line)


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_data_dependent_branch_names_the_users_line(tracer: str) -> None:
    with pytest.raises(TraceError) as info:
        trace(Branchy(), (torch.randn(2, 4),), tracer=tracer)
    message = str(info.value)
    assert "data-dependent control flow" in message
    assert f"{Path(__file__).name}:{BRANCH_LINE}" in message
    assert "torch.cond" in message
    assert "\n" not in message


def test_error_names_a_user_file_line(tmp_path: Path) -> None:
    src = tmp_path / "user_model.py"
    src.write_text(textwrap.dedent("""
        import torch
        class M(torch.nn.Module):
            def forward(self, x):
                if x.max() > 1:
                    return x
                return -x
    """))
    namespace: dict[str, object] = {}
    exec(compile(src.read_text(), str(src), "exec"), namespace)
    with pytest.raises(TraceError, match=r"user_model\.py:5 `if x\.max\(\) > 1:`"):
        trace(namespace["M"](), (torch.randn(3),))  # type: ignore[operator]


def test_export_graph_has_parameters_as_get_attr_shared_with_the_model() -> None:
    zoo = models.build("gpt-tiny")
    gm = trace(zoo.model, zoo.example_inputs).gm
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    params = dict(zoo.model.named_parameters(remove_duplicate=False))
    assert targets <= set(params) | {n for n, _ in zoo.model.named_buffers()}
    assert gm.get_parameter("blocks.0.attn.c_attn.weight") is params["blocks.0.attn.c_attn.weight"]
    assert not any(n.op == "call_module" for n in gm.graph.nodes)  # the guard function is gone
    torch.testing.assert_close(gm(*zoo.example_inputs)[0], zoo.model(*zoo.example_inputs), rtol=0, atol=0)


def test_trace_writes_no_fxpipe_meta_and_leaves_model_untouched() -> None:
    zoo = models.build("mlp-tiny")
    before = {n: p.detach().clone() for n, p in zoo.model.named_parameters()}
    result = trace(zoo.model, zoo.example_inputs)
    assert result.changed
    assert all("fxpipe" not in n.meta for n in result.gm.graph.nodes)
    assert all(get_meta(n).layer_idx == -1 for n in result.gm.graph.nodes)
    for name, p in zoo.model.named_parameters():
        assert torch.equal(p, before[name])


def test_unknown_tracer_is_a_clear_error() -> None:
    with pytest.raises(TraceError, match="unknown tracer 'jit'"):
        trace(nn.Linear(2, 2), (torch.randn(1, 2),), tracer="jit")


def test_meta_model_traces_without_allocating() -> None:
    zoo = models.build("gpt-tiny", device="meta")
    gm = trace(zoo.model, zoo.example_inputs).gm
    assert all(p.is_meta for p in gm.parameters())


class _NoGradGate(nn.Module):
    """A gate computed under no_grad from a parameter: eager gives its parameter no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 4)
        self.body = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            g = self.gate(x).sigmoid()
        return self.body(x) * g


def test_a_no_grad_region_is_inlined_and_its_outputs_get_no_gradient() -> None:
    from fxpipe._compat import higher_order_op

    torch.manual_seed(0)
    model, x = _NoGradGate(), torch.randn(3, 4)
    result = trace(model, (x,))
    gm = result.gm
    assert not [n for n in gm.graph.nodes if higher_order_op(n.target)]  # export wrapped it; trace inlined it
    assert any("no-grad region(s) inlined" in note for note in result.reports[0].notes)
    out = gm(x)
    (out[0] if isinstance(out, (tuple, list)) else out).sum().backward()  # the graph's flat outputs
    got = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for name, p in model.named_parameters():
        if p.grad is None:
            assert got[name] is None, name  # the gate's parameters: no gradient, as in eager
        else:
            torch.testing.assert_close(got[name], p.grad)
    assert model.gate.weight.grad is None and model.body.weight.grad is not None


def test_a_model_whose_config_asks_for_a_cache_traces_with_it_off() -> None:
    class Config:
        use_cache = True

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = Config()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            out = self.fc(x)
            return (out, object()) if self.config.use_cache else out  # a cache object neither tracer can carry

    model = Cached()
    result = trace(model, (torch.randn(2, 4),))
    assert model.config.use_cache is True  # put back
    assert any("use_cache off" in note for note in result.reports[0].notes)
