"""A rank that runs a plan as compiled loads its stages' F, B and W from the plan (``stage_K.fbw.json``) instead of
tracing them: the same losses and gradients as traced ones, no AOTAutograd imported, and every other run (an old
plan, bf16) traces as before.

One process, one gloo rank (``one_rank``: every stage on it); the fresh-process import check is a subprocess.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.cli.rank_common import synthetic_batch
from fxpipe.pipeline import Pipeline
from fxpipe.schedules.generators import one_rank

M = 4  # microbatches
STEPS = 3
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _plan(name: str, tmp: str, **options: Any) -> Path:
    zoo = models.build(name)
    pipe = fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages=2, **options)
    return fxpipe.save(pipe, Path(tmp) / f"{name}-{'-'.join(options) or 'plain'}")


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("plans"))


def _train(name: str, pipe: Pipeline, **options: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of STEPS steps on the zoo's seeded batch, and every parameter's gradient after the last."""
    from fxpipe.runtime import PipelineRuntime

    zoo = models.build(name)
    rt = PipelineRuntime(pipe, one_rank(2, M), zoo.loss_fn, example_inputs=zoo.example_inputs, **options)
    inputs, target = synthetic_batch(zoo, M)
    losses = [float(rt.step(inputs, target)) for _ in range(STEPS)]
    return losses, {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}


def _traced(path: Path) -> Pipeline:
    """The plan loaded as one without F/B/W files is: every rank traces them."""
    pipe = fxpipe.load(path)
    for stage in pipe.stage_list():
        stage.stored_graphs = None
    return pipe


def _no_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("traced F/B/W although the plan carries them")

    monkeypatch.setattr(Pipeline, "build_backward", refuse)


def _assert_same(a: tuple[list[float], dict[str, torch.Tensor]], b: tuple[list[float], dict[str, torch.Tensor]]
                 ) -> None:
    torch.testing.assert_close(a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", ["gpt-tiny", "mlp-tiny"])
def test_loaded_graphs_train_as_traced_ones(world1: None, plans: str, name: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = _plan(name, plans)
    assert sorted(p.name for p in path.glob("*.fbw.json")) == ["stage_0.fbw.json", "stage_1.fbw.json"]
    traced = _train(name, _traced(path))
    _no_tracing(monkeypatch)
    _assert_same(_train(name, fxpipe.load(path)), traced)


def test_balance_backward_moves_are_made_once(world1: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored graphs hold the plan's --balance-backward move; a rank that traces makes it again: the same
    derivatives in each stage's B, and the same training, either way."""
    from fxpipe.runtime import PipelineRuntime
    from tests.passes.test_balance_backward import Middle, _ce, _derivatives

    torch.manual_seed(0)
    example = (torch.randn(8, 16),)
    compiled = fxpipe.compile(Middle(), example, stages=3, balance_backward=True, latency=0.0)
    assert compiled.plan.backward_moves
    path = fxpipe.save(compiled, tmp_path / "plan")
    batch = (torch.randn(8 * M, 16),), torch.randint(0, 4, (8 * M,))

    def train(pipe: Pipeline) -> tuple[tuple[list[float], dict[str, torch.Tensor]], list[int]]:
        rt = PipelineRuntime(pipe, one_rank(3, M), _ce)
        losses = [float(rt.step(*batch)) for _ in range(STEPS)]
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        return (losses, grads), _derivatives(rt.graphs)

    traced, traced_derivatives = train(_traced(path))
    _no_tracing(monkeypatch)
    loaded, loaded_derivatives = train(fxpipe.load(path))
    assert loaded_derivatives == traced_derivatives == _derivatives(compiled.stage_graphs)
    _assert_same(loaded, traced)


def test_an_old_plan_without_the_files_loads_and_traces(world1: None, plans: str, tmp_path: Path) -> None:
    import shutil

    old = Path(shutil.copytree(_plan("mlp-tiny", plans), tmp_path / "old"))
    doc = json.loads((old / "plan.json").read_text())
    for stage in doc["stages"]:
        name = stage.pop("fbw")["file"]
        (old / name).unlink()
        doc["files"].remove(name)
        del doc["sha256"][name]
    (old / "plan.json").write_text(json.dumps(doc))
    pipe = fxpipe.load(old)
    assert all(stage.stored_graphs is None for stage in pipe.stage_list())
    _assert_same(_train("mlp-tiny", pipe), _train("mlp-tiny", fxpipe.load(_plan("mlp-tiny", plans))))


def test_another_precision_traces(world1: None, plans: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 needs graphs traced under autocast: the plan's fp32 ones are not used, and nothing says so as an error."""
    calls = []
    build = Pipeline.build_backward

    def counted(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("autocast"))
        return build(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "build_backward", counted)
    losses, _ = _train("mlp-tiny", fxpipe.load(_plan("mlp-tiny", plans)), precision="bf16")
    assert calls == [("cpu", torch.bfloat16)] and all(map(torch.isfinite, map(torch.tensor, losses)))


def test_a_rank_given_a_loaded_plan_imports_no_aot_autograd(plans: str, tmp_path: Path) -> None:
    """A fresh Python (as torchrun starts a rank) loads the plan, builds its runtime and steps once."""
    path = _plan("gpt-tiny", plans)
    script = textwrap.dedent(f"""
        import sys
        import torch.distributed as dist
        import fxpipe
        from fxpipe import models
        from fxpipe.cli.rank_common import synthetic_batch
        from fxpipe.runtime import PipelineRuntime
        from fxpipe.schedules.generators import one_rank
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'pg'}", rank=0, world_size=1)
        zoo = models.build("gpt-tiny")
        rt = PipelineRuntime(fxpipe.load({str(path)!r}), one_rank(2, {M}), zoo.loss_fn,
                             example_inputs=zoo.example_inputs)
        rt.step(*synthetic_batch(zoo, {M}))
        print("aot_autograd imported:", "torch._functorch.aot_autograd" in sys.modules)
        dist.destroy_process_group()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "aot_autograd imported: False" in proc.stdout
