"""backend="fxpipe" with Inductor-compiled stage graphs (options inductor=True), its eager fallback, bf16 with fp32
master weights, and the microbatch count it picks on one device.

Inductor's CPU compiles take seconds per graph, so each compiled configuration trains once, in a module-scoped
fixture, and the tests read what it recorded. Compiled cases are skipped without a C++ compiler.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch

import fxpipe
import fxpipe.backend as backend
from fxpipe import models
from fxpipe.runtime import codegen

# A string condition: evaluated as a test starts, so collecting this module does not import Inductor
needs_cxx = pytest.mark.skipif("codegen.cpp_compiler() is None", reason="needs a C++ compiler for Inductor's CPU code")


def _train(zoo: Any, options: dict[str, Any], steps: int = 3, autocast: torch.dtype | None = None) -> dict[str, Any]:
    """Train the zoo model compiled with ``options`` and an eager copy (under ``autocast`` if given) side by side with
    SGD-momentum; per step, both losses and both models' parameter gradients; the runner and the warnings (and
    fxpipe's logged warnings) at the end."""
    torch._dynamo.reset()
    model, ref = zoo.model, copy.deepcopy(zoo.model)
    compiled = torch.compile(model, backend="fxpipe", fullgraph=True, options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    steps_seen = []
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fxpipe").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = zoo.loss_fn(compiled(*zoo.example_inputs), zoo.example_target)
            with torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False):
                out_ref = ref(*zoo.example_inputs)  # the model under autocast, the loss outside, as the backend runs
            loss_ref = zoo.loss_fn(out_ref, zoo.example_target)
            loss.backward()
            loss_ref.backward()
            ref_params = dict(ref.named_parameters())
            steps_seen.append({"loss": (loss.detach(), loss_ref.detach()),
                               "grads": {n: (p.grad.clone(), ref_params[n].grad.clone())
                                         for n, p in model.named_parameters()}})
            opt.step(), opt_ref.step()
            opt.zero_grad(), opt_ref.zero_grad()
    logging.getLogger("fxpipe").removeHandler(handler)
    return {"steps": steps_seen, "runner": backend._LAST_RUNNER[0], "reports": fxpipe.last_report(),
            "warnings": [str(w.message) for w in caught] + logged, "model": model}


@pytest.fixture(scope="module")
def float64_run() -> dict[str, Any]:
    """mlp-tiny in float64, 2 stages, every stage's F, B and W compiled by Inductor, no microbatches option."""
    if codegen.cpp_compiler() is None:
        pytest.skip("needs a C++ compiler for Inductor's CPU code")
    return _train(models.build("mlp-tiny", batch_size=4, dtype=torch.float64), {"stages": 2, "inductor": True})


@needs_cxx
def test_inductor_compiled_stages_train_like_eager_in_float64(float64_run: dict[str, Any]) -> None:
    for k, step in enumerate(float64_run["steps"]):
        torch.testing.assert_close(*step["loss"], msg=lambda m: f"step {k} loss: {m}")
        assert step["grads"], "no parameter gradients were compared"
        for name, (grad, grad_ref) in step["grads"].items():
            torch.testing.assert_close(grad, grad_ref, msg=lambda m: f"step {k} {name}: {m}")
    runner = float64_run["runner"]
    # Each stage's F, B and W compiled once (one input signature each), none fell back to eager.
    assert runner.inductor is not None and runner.inductor.compiled == 3 * 2 and runner.inductor.failed == []
    assert all(isinstance(getattr(g, w), codegen.InductorGraph)
               for g in runner.graphs for w in ("forward", "backward_input", "backward_weight"))
    assert not [w for w in float64_run["warnings"] if "Inductor" in w]
    memory = next(t for t in float64_run["reports"] if t.title.startswith("backend memory"))
    assert any("compiled by Inductor" in n for n in memory.notes)
    # No microbatches option, one device: one microbatch (one test: xdist may tear a module fixture down between two)
    assert runner.m == 1
    assert memory.notes[0].startswith("1 microbatches (one device (cpu), no memory cap known)")


@needs_cxx
def test_bf16_with_inductor_keeps_fp32_master_weights_and_follows_eager_autocast() -> None:
    zoo = models.build("mlp-tiny", batch_size=4)
    run = _train(zoo, {"stages": 1, "inductor": True, "precision": "bf16"}, steps=2, autocast=torch.bfloat16)
    assert run["runner"].inductor.compiled == 3 and run["runner"].inductor.failed == []
    for k, step in enumerate(run["steps"]):
        # bf16 keeps 8 bits of mantissa: Inductor's fused kernels round in other places than eager's ops.
        torch.testing.assert_close(*step["loss"], atol=2e-2, rtol=2e-2, msg=lambda m: f"step {k} loss: {m}")
        for name, (grad, grad_ref) in step["grads"].items():
            assert grad.dtype == torch.float32, name
            torch.testing.assert_close(grad, grad_ref, atol=2e-2, rtol=5e-2, msg=lambda m: f"step {k} {name}: {m}")
    assert all(p.dtype == torch.float32 for p in run["model"].parameters())


def test_a_graph_inductor_refuses_runs_eagerly_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxpipe._compat

    def refuse(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("injected: this graph cannot be compiled")

    monkeypatch.setattr(fxpipe._compat, "inductor_compile", refuse)
    run = _train(models.build("mlp-tiny", batch_size=4, dtype=torch.float64), {"stages": 2, "inductor": True})
    for k, step in enumerate(run["steps"]):
        torch.testing.assert_close(*step["loss"], msg=lambda m: f"step {k} loss: {m}")
        for name, (grad, grad_ref) in step["grads"].items():
            torch.testing.assert_close(grad, grad_ref, msg=lambda m: f"step {k} {name}: {m}")
    said = [w for w in run["warnings"] if "Inductor could not compile" in w]
    assert len(said) == 1 and "RuntimeError: injected: this graph cannot be compiled" in said[0], run["warnings"]
    assert len(run["runner"].inductor.failed) == 3 * 2 and run["runner"].inductor.compiled == 0


def test_inductor_option_is_checked_and_off_the_gpu_it_is_off_by_default() -> None:
    zoo = models.build("mlp-tiny", batch_size=4)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"options 'inductor' must be True or False \(inductor: 'yes'\)"):
        torch.compile(copy.deepcopy(zoo.model), backend="fxpipe", options={"inductor": "yes"})(*zoo.example_inputs)
    torch._dynamo.reset()
    torch.compile(copy.deepcopy(zoo.model), backend="fxpipe", options={"stages": 2})(*zoo.example_inputs)
    assert backend._LAST_RUNNER[0].inductor is None


def test_a_memory_cap_raises_the_default_microbatch_count(monkeypatch: pytest.MonkeyPatch) -> None:
    zoo = models.build("mlp-tiny", batch_size=8, dtype=torch.float64)
    torch._dynamo.reset()
    torch.compile(copy.deepcopy(zoo.model), backend="fxpipe", options={"stages": 2})(*zoo.example_inputs)
    pipe = fxpipe.backend._LAST[0]  # built for the whole batch as one microbatch (no cap on the CPU)
    need = {m: backend._step_bytes(pipe, m, True) for m in (1, 2, 4, 8)}
    assert need[1] > need[2] > need[4] > need[8], need  # what B keeps for W shrinks with the microbatch
    cpu = torch.device("cpu")
    for cap, expected in ((need[1], 1), (need[1] - 1, 2), (need[4], 4), (need[8] - 1, 8)):
        monkeypatch.setattr(backend, "_free_memory", lambda device, cap=cap: cap)
        m, why = backend._default_microbatches(pipe, cpu, 8, True)
        assert m == expected, (cap, need, why)
    assert why == f"one device; no count fits in {(need[8] - 1) / 2**20:,.0f} MiB free on cpu, 8 needs the least"
    # Through the backend: a cap between what 1 and 2 microbatches need gives 2, and training still equals eager.
    monkeypatch.setattr(backend, "_free_memory", lambda device: need[1] - 1)
    run = _train(models.build("mlp-tiny", batch_size=8, dtype=torch.float64), {"stages": 2}, steps=2)
    assert run["runner"].m == 2
    for step in run["steps"]:
        torch.testing.assert_close(*step["loss"])
        for grad, grad_ref in step["grads"].values():
            torch.testing.assert_close(grad, grad_ref)


def test_the_gpu_benchmark_runs_on_the_cpu_at_smoke_sizes() -> None:
    """benchmarks/backend_gpu.py --device cpu --smoke, one model, precision and two methods: the code the GPU script
    runs (the GPU session runs it at full size; every method and both precisions were run here by hand)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "backend_gpu.py"
    spec = importlib.util.spec_from_file_location("backend_gpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    pytest.importorskip("transformers")
    rows = bench.main(["--device", "cpu", "--smoke", "--models", "hf-llama", "--precisions", "fp32",
                       "--methods", "eager", "fxpipe", "--iters", "2"])
    assert [r["method"] for r in rows] == ["eager", "fxpipe"]
    assert rows[1]["setup"] == "2x1"  # no options on one device: 2 stages, 1 microbatch
    assert rows[0]["first_loss"] == pytest.approx(rows[1]["first_loss"], rel=1e-5)
    assert all(r["median_ms"] > 0 for r in rows)
    assert "| hf-llama | fp32 | 4x16 | fxpipe | 2x1 |" in bench.table(rows)


class _CastsToFloat(torch.nn.Module):
    """A layer that casts its input to fp32 (as Llama's RMSNorm does), which torch.export records as a dtype check."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).to(torch.float32)
        return self.b(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_bf16_through_a_cast_to_float32_follows_eager_autocast() -> None:
    # Under autocast the input of .to(float32) arrives in bf16 (from the autocast matmul), as in eager: export's
    # check that it is fp32 (aten._assert_tensor_metadata) must not fail the trace. Found on Llama on an H200.
    torch.manual_seed(0)
    model = _CastsToFloat()
    x, target = torch.randn(4, 8), torch.randn(4, 8)

    class Zoo:
        example_inputs, example_target = (x,), target
        loss_fn = staticmethod(lambda out, t: torch.nn.functional.mse_loss(out.float(), t))

    Zoo.model = model
    run = _train(Zoo, {"stages": 2, "precision": "bf16"}, steps=2, autocast=torch.bfloat16)
    for k, step in enumerate(run["steps"]):
        torch.testing.assert_close(*step["loss"], atol=2e-2, rtol=2e-2, msg=lambda m: f"step {k} loss: {m}")
        for name, (grad, grad_ref) in step["grads"].items():
            assert grad.dtype == torch.float32, name
            torch.testing.assert_close(grad, grad_ref, atol=2e-2, rtol=5e-2, msg=lambda m: f"step {k} {name}: {m}")
