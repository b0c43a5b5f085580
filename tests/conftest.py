"""Shared test helpers: compile a model and check it composes back to eager (outputs and gradients)."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

import fxpipe

# Plans in tests never depend on the machine: fxpipe compile keeps the fixed device model instead of calibrating
# this machine's compute (tests/calibration/test_compute.py turns it on where it tests it).
os.environ["FXPIPE_CALIBRATION"] = "off"


def assert_composes(
    model: torch.nn.Module,
    inputs: tuple[Any, ...],
    loss_fn: Any,
    target: torch.Tensor,
    stages: int,
    *,
    exact: bool = False,
    **options: Any,
) -> fxpipe.Pipeline:
    """Compile a copy of ``model``; its output, loss and every parameter's gradient equal eager's.

    The pipeline must own exactly the compiled model's parameters (same objects), so the
    gradients are compared by the model's own parameter names. ``exact`` asks for bit-for-bit.
    """
    ref = copy.deepcopy(model)
    mine = copy.deepcopy(model)
    torch.manual_seed(1234)
    ref_out = ref(*inputs)
    ref_loss = loss_fn(ref_out, target)
    ref_loss.backward()

    pipe = fxpipe.compile(mine, inputs, stages=stages, **options)
    assert len(pipe.stages) == stages
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in mine.parameters()}
    torch.manual_seed(1234)
    out = pipe(*inputs)
    loss = loss_fn(out, target)
    loss.backward()

    tol: dict[str, float] = {"rtol": 0.0, "atol": 0.0} if exact else {}
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(loss, ref_loss, **tol)
    ref_params = dict(ref.named_parameters())
    for name, param in mine.named_parameters():
        assert param.grad is not None, f"{name} got no gradient through the pipeline"
        torch.testing.assert_close(param.grad, ref_params[name].grad, msg=lambda m: f"{name}: {m}", **tol)
    ref_buffers = dict(ref.named_buffers())
    for name, buf in mine.named_buffers():
        torch.testing.assert_close(buf, ref_buffers[name], msg=lambda m: f"buffer {name}: {m}", **tol)
    _assert_round_trips(pipe, inputs, loss_fn, target, ref_out, dict(ref.named_parameters(remove_duplicate=False)), tol)
    return pipe


def _assert_round_trips(pipe: fxpipe.Pipeline, inputs: tuple[Any, ...], loss_fn: Any, target: torch.Tensor,
                        ref_out: Any, ref_params: dict[str, torch.nn.Parameter], tol: dict[str, float]) -> None:
    """The pipeline saved and loaded back (graphs as data) computes the same output and gradients."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        loaded = fxpipe.load(fxpipe.save(pipe, Path(d) / "plan"))
    torch.manual_seed(1234)
    out = loaded(*inputs)
    loss_fn(out, target).backward()
    torch.testing.assert_close(out, ref_out, msg=lambda m: f"loaded plan: {m}", **tol)
    for stage in loaded.stages:
        for name, param in stage.module.named_parameters():
            assert param.grad is not None, f"loaded plan: {name} got no gradient"
            torch.testing.assert_close(param.grad, ref_params[name].grad, msg=lambda m: f"loaded plan {name}: {m}", **tol)


@pytest.fixture
def composes():  # type: ignore[no-untyped-def]
    return assert_composes


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the current output")


@pytest.fixture
def golden(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """``golden("name.txt", text)``: compare with tests/golden/name.txt (or rewrite it with --update-golden)."""
    from pathlib import Path

    root = Path(__file__).parent / "golden"
    update = bool(request.config.getoption("--update-golden"))

    def check(name: str, text: str) -> None:
        path = root / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        assert path.exists(), f"no golden file {path}; run pytest --update-golden to create it"
        assert text == path.read_text(), f"{name} differs from its golden file; if the change is right, run --update-golden"

    return check
