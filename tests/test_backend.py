"""torch.compile(model, backend="fxpipe"): outputs and gradients equal eager over optimizer steps; breaks are clear
errors."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models
from tests._helpers import HANG_S, count_boxing, hf_gpt2 as _gpt2


def _train_side_by_side(model: torch.nn.Module, inputs: tuple[Any, ...], target: torch.Tensor, loss_fn: Any,
                        options: dict[str, Any], steps: int = 3, ref_microbatches: int = 1, **tol: float) -> None:
    """Train ``model`` compiled and an eager copy with SGD-momentum; outputs, loss, grads and buffers stay equal.

    ``ref_microbatches``: the eager copy runs the batch in that many chunks (outputs concatenated),
    for models such as BatchNorm whose results depend on the batch they see.
    """
    torch._dynamo.reset()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fxpipe", fullgraph=True, options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)

    def eager(*args: Any) -> Any:
        if ref_microbatches == 1:
            return ref(*args)
        return torch.cat([ref(*part) for part in zip(*(a.tensor_split(ref_microbatches) for a in args))])

    for step in range(steps):
        out, out_ref = compiled(*inputs), eager(*inputs)
        torch.testing.assert_close(out[0] if isinstance(out, tuple) else getattr(out, "logits", out),
                                   out_ref[0] if isinstance(out_ref, tuple) else getattr(out_ref, "logits", out_ref),
                                   msg=lambda m: f"step {step} outputs: {m}", **tol)
        loss, loss_ref = loss_fn(out, target), loss_fn(out_ref, target)
        loss.backward()
        loss_ref.backward()
        torch.testing.assert_close(loss, loss_ref, msg=lambda m: f"step {step} loss: {m}", **tol)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"step {step} {name}: {m}", **tol)
        ref_buffers = dict(ref.named_buffers())
        for name, b in model.named_buffers():  # BatchNorm running statistics, num_batches_tracked
            torch.testing.assert_close(b, ref_buffers[name], msg=lambda m: f"step {step} buffer {name}: {m}", **tol)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dict(ref.named_parameters())[name], msg=lambda m: f"after training {name}: {m}",
                                   **tol)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny"])
def test_training_equals_eager(name: str, stages: int) -> None:
    zoo = models.build(name, batch_size=4)
    _train_side_by_side(zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn,
                        {"stages": stages, "microbatches": 2})
    tables = fxpipe.last_report()
    assert any(t.title.startswith("partition-stages") for t in tables)
    assert len(next(t for t in tables if t.title.startswith("split-backward")).rows) == stages


def test_batchnorm_resnet_trains_like_eager_run_microbatch_by_microbatch() -> None:
    # BatchNorm in train mode normalizes with the statistics of the batch it sees, and the pipeline
    # sees one microbatch at a time (each also updates the running statistics once), so it cannot
    # equal eager on the whole batch: the reference runs eager microbatch by microbatch.
    # Regression: the backend's own AOTAutograd trace used to run in Dynamo's fake mode (its
    # TracingContext), leaving source-less symbols and conv's shape guards in Dynamo's ShapeEnv,
    # and Dynamo then failed building its guards (IndexError in produce_guards_verbose).
    zoo = models.build("resnet-tiny", batch_size=4)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in zoo.model.modules())
    _train_side_by_side(zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn,
                        {"stages": 2, "microbatches": 2}, ref_microbatches=2)
    assert all(int(b) == 3 * 2 for name, b in zoo.model.named_buffers() if name.endswith("num_batches_tracked"))
    assert len(next(t for t in fxpipe.last_report() if t.title.startswith("split-backward")).rows) == 2


@pytest.mark.parametrize("stages", [2, 4])
def test_transformers_gpt2_training_equals_eager(stages: int) -> None:
    torch.manual_seed(0)
    idx, target = torch.randint(0, 96, (4, 16)), torch.randint(0, 96, (4, 16))

    def loss_fn(out: Any, t: torch.Tensor) -> torch.Tensor:
        logits = out[0] if isinstance(out, tuple) else out.logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten())

    _train_side_by_side(_gpt2(), (idx,), target, loss_fn, {"stages": stages, "microbatches": 2})


def test_gpipe_order_also_matches_and_the_memory_report_is_there() -> None:
    zoo = models.build("mlp-tiny", batch_size=4)
    _train_side_by_side(zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn,
                        {"stages": 2, "microbatches": 4, "schedule": "gpipe", "devices": ["cpu"]}, steps=2)
    memory = next(t for t in fxpipe.last_report() if t.title.startswith("backend memory"))
    assert memory.column("device") == ["cpu", "cpu"]
    assert all(x > 0 for x in memory.column("peak MiB"))


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:  # the graph break
            h = h * 2
        return self.fc(h)


def test_a_graph_break_is_one_clear_error() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(Branchy(), backend="fxpipe")
    with pytest.raises(Exception, match=r"needs the whole model in one graph, but Dynamo broke it at "
                                        r".*test_backend\.py:\d+ `if h\.sum\(\) > 0:") as info:
        compiled(torch.randn(2, 4))
    assert "fullgraph=True" in str(info.value)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"Data-dependent|data-dependent"):
        torch.compile(Branchy(), backend="fxpipe", fullgraph=True)(torch.randn(2, 4))


def test_options_are_checked_and_verbose_prints_the_tables_once(capsys: pytest.CaptureFixture[str]) -> None:
    torch._dynamo.reset()
    zoo = models.build("mlp-tiny", batch_size=4)
    with pytest.raises(Exception, match=r"unknown fxpipe backend option\(s\) \['stagez'\]"):
        torch.compile(zoo.model, backend="fxpipe", options={"stagez": 2})(*zoo.example_inputs)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(zoo.model), backend="fxpipe", options={"stages": 2, "verbose": True})
    compiled(*zoo.example_inputs)
    compiled(*zoo.example_inputs)
    err = capsys.readouterr().err
    assert err.count("partition-stages: chosen partition") == 1


def test_the_backend_works_without_importing_fxpipe() -> None:
    script = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        x = torch.randn(4, 8)
        out = torch.compile(m, backend="fxpipe", fullgraph=True, options={"stages": 2})(x)
        torch.testing.assert_close(out, m(x))
        assert "fxpipe" in torch._dynamo.list_backends()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_equals_eager_on_cuda() -> None:
    zoo = models.build("gpt-tiny", batch_size=4, device="cuda")
    _train_side_by_side(zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn,
                        {"stages": 2, "microbatches": 2})
    memory = next(t for t in fxpipe.last_report() if t.title.startswith("backend memory"))
    assert all(str(d).startswith("cuda") for d in memory.column("device"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cuda", "cpu"], ["cpu", "cuda:0"]])
@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny"])
def test_stages_placed_on_devices_train_like_eager_on_cuda(name: str, devices: list[str]) -> None:
    # The model stays on cuda:0 (Dynamo guards its parameters' device); a stage placed on the CPU
    # runs on copies there, refreshed after every optimizer step. gpt's tied wte/lm_head is read by
    # both stages, so with a CPU stage its gradient is summed across devices.
    zoo = models.build(name, batch_size=4, device="cuda")
    mixed = len({torch.device(d).type for d in devices}) > 1
    tol = {"rtol": 1e-4, "atol": 1e-5} if mixed else {}  # CPU and CUDA kernels round differently
    _train_side_by_side(zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn,
                        {"stages": 2, "microbatches": 2, "devices": devices}, **tol)
    memory = next(t for t in fxpipe.last_report() if t.title.startswith("backend memory"))
    assert [d.split(":")[0] for d in memory.column("device")] == [d.split(":")[0] for d in devices]
    assert all(p.device.type == "cuda" for p in zoo.model.parameters())


def test_a_second_instance_of_a_model_class_is_a_clear_error_not_the_first_ones_numbers() -> None:
    # Dynamo reuses compiled code across instances whose parameters have equal shapes; the pipeline
    # holds the first instance's parameters, so running it for the second would be silently wrong.
    torch._dynamo.reset()
    a, b = models.build("mlp-tiny", batch_size=4, seed=0), models.build("mlp-tiny", batch_size=4, seed=1)
    x = a.example_inputs[0]
    torch.testing.assert_close(torch.compile(a.model, backend="fxpipe", options={"stages": 2})(x), a.model(x))
    with pytest.raises(Exception, match=r"another MLP instance.*torch\._dynamo\.reset\(\)"):
        torch.compile(b.model, backend="fxpipe", options={"stages": 2})(x)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(b.model, backend="fxpipe", options={"stages": 2})(x), b.model(x))


def test_cuda_graphs_option_is_checked_and_off_the_gpu_the_step_runs_op_by_op() -> None:
    zoo = models.build("mlp-tiny", batch_size=4)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"options 'cuda_graphs' must be True or False"):
        torch.compile(zoo.model, backend="fxpipe", options={"stages": 2, "cuda_graphs": "yes"})(*zoo.example_inputs)
    torch._dynamo.reset()
    torch.compile(zoo.model, backend="fxpipe", options={"stages": 2, "cuda_graphs": True})(*zoo.example_inputs)
    from fxpipe.backend import _LAST_RUNNER

    assert _LAST_RUNNER[0].step_graphs is None  # CPU: no CUDA graphs, even when asked for
    memory = next(t for t in fxpipe.last_report() if t.title.startswith("backend memory"))
    assert any("op by op" in note for note in memory.notes)


def test_each_graph_is_boxed_once_not_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Boxing copies and recompiles a graph: a step's core boxing its B graphs again each step was most of the CPU
    # backend's time beyond eager's on small models (benchmarks/RESULTS.md, "Backend on the CPU").
    made = count_boxing(monkeypatch)
    zoo = models.build("gpt-tiny", batch_size=4)
    _train_side_by_side(zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn, {"stages": 2}, steps=3)
    assert len(made) == 2, made  # each stage's B graph, once over the 3 steps


def _graphs() -> Any:
    from fxpipe.backend import _LAST_RUNNER

    return _LAST_RUNNER[0].step_graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny", "resnet-tiny"])
def test_cuda_graphs_train_like_eager(name: str) -> None:
    # The default on one GPU: step 1 runs eagerly, step 2 captures F and B/W, steps 3-5 replay them: every step's
    # outputs, loss, gradients, BatchNorm buffers and the parameters after SGD-momentum equal eager's. In float64:
    # in float32, resnet-tiny (BatchNorm over 2-sample microbatches) turns cuDNN's nondeterministic rounding
    # (1e-7) into gradients 1e-3 to 8e-2 apart by step 4, between two eager runs as between eager and fxpipe
    # with or without graphs (benchmarks/gpu_repeatability.py: 1 to 5 of 10 seeds fail on an H200).
    zoo = models.build(name, batch_size=4, device="cuda", dtype=torch.float64)
    _train_side_by_side(zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn,
                        {"stages": 2, "microbatches": 2}, steps=5,
                        ref_microbatches=2 if name == "resnet-tiny" else 1)
    graphs = _graphs()
    assert graphs is not None and graphs.fwd is not None and graphs.bwd is not None
    memory = next(t for t in fxpipe.last_report() if t.title.startswith("backend memory"))
    assert any("CUDA graphs" in note for note in memory.notes)


class _HostConstant(torch.nn.Module):
    """A forward that copies a CPU constant to the GPU: a copy from pageable memory, which no capture allows."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * torch.arange(8.0, dtype=x.dtype).to(x.device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_op_no_capture_allows_runs_op_by_op(caplog: pytest.LogCaptureFixture) -> None:
    # Ran as a script on an H200: step 2's capture failed ("Cannot copy between CPU and CUDA tensors during CUDA
    # graph capture unless the CPU tensor is pinned"), and every step's gradients equalled eager's.
    torch.manual_seed(0)
    model = _HostConstant().double().cuda()
    x = torch.randn(4, 8, dtype=torch.float64, device="cuda")
    with caplog.at_level(logging.WARNING, logger="fxpipe"):
        # inductor off: the graphs as traced, whose CPU constant and copy to the GPU Inductor might fold away
        _train_side_by_side(model, (x,), torch.zeros(4, 8, dtype=torch.float64, device="cuda"),
                            torch.nn.functional.mse_loss, {"stages": 2, "microbatches": 2, "inductor": False}, steps=4)
    assert [r.getMessage() for r in caplog.records if "could not be captured as a CUDA graph" in r.getMessage()]
    assert _graphs() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_cannot_be_captured_runs_op_by_op(where: str, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    # A capture that fails part-way (as an op that syncs with the host fails it) leaves the step to run op by op,
    # with one warning: in the backward, after B has already taken its output gradient from the core, so the
    # core's state must be put back as it was before the capture.
    from fxpipe.backend import _BackendCore
    from fxpipe.schedules.ir import Kind

    real = _BackendCore.run
    seen = []

    def failing(self: Any, action: Any) -> None:
        if torch.cuda.is_current_stream_capturing() and (action.kind is Kind.F) == (where == "forward"):
            seen.append(action)
            if len(seen) == 2:
                raise RuntimeError("operation not permitted when stream is capturing")
        real(self, action)

    monkeypatch.setattr(_BackendCore, "run", failing)
    zoo = models.build("gpt-tiny", batch_size=4, device="cuda", dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="fxpipe"):
        _train_side_by_side(zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn,
                            {"stages": 2, "microbatches": 2}, steps=4)
    said = [r.getMessage() for r in caplog.records if "could not be captured as a CUDA graph" in r.getMessage()]
    assert len(said) == 1 and "(RuntimeError: operation not " in said[0], said
    assert len(seen) == 2 and _graphs() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_two_forwards_before_one_backward_and_moved_parameters() -> None:
    # Gradient accumulation over two calls: the second forward finds the graphs' saved tensors
    # waiting for the first one's backward and runs eagerly; both gradients still add up as eager's.
    # Then a parameter moved to new memory (p.data = ...) makes the graphs be captured again.
    torch._dynamo.reset()
    zoo = models.build("gpt-tiny", batch_size=4, device="cuda")
    ref = copy.deepcopy(zoo.model)
    compiled = torch.compile(zoo.model, backend="fxpipe", options={"stages": 2, "microbatches": 2})
    x, y = zoo.example_inputs[0], zoo.example_target
    x2 = torch.roll(x, 1, dims=0)
    captured = []
    for step in range(5):
        if step == 3:
            for p, q in zip(zoo.model.parameters(), ref.parameters()):
                p.data = p.data.clone() * 0.5
                q.data = q.data * 0.5
        loss = zoo.loss_fn(compiled(x), y) + zoo.loss_fn(compiled(x2), y)
        loss.backward()
        loss_ref = zoo.loss_fn(ref(x), y) + zoo.loss_fn(ref(x2), y)
        loss_ref.backward()
        torch.testing.assert_close(loss, loss_ref)
        for (name, p), q in zip(zoo.model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"step {step} {name}: {m}")
            p.grad, q.grad = None, None
        captured.append(_graphs().fwd)
    # step 0 eager, step 1 captured, step 2 replayed, step 3 captured again (moved parameters), step 4 replayed
    assert captured[0] is None and captured[1] is not None and captured[2] is captured[1]
    assert captured[3] is not None and captured[3] is not captured[2] and captured[4] is captured[3]
    # Inference (no grad: Dynamo compiles the model again for that grad mode) equals eager too.
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [
    {"inductor": True, "cuda_graphs": True}, {"inductor": True, "cuda_graphs": False},
    {"inductor": False, "cuda_graphs": True}, {"inductor": False, "cuda_graphs": False},
    {"microbatches": 4}], ids=["inductor-graphs", "inductor", "graphs", "op-by-op", "default-4-microbatches"])
def test_every_compiled_path_trains_like_eager_in_float64_on_cuda(options: dict[str, Any]) -> None:
    # Three SGD-momentum steps: step 1 eager (Inductor compiles each graph at its first call), step 2 captured,
    # step 3 replayed. With no microbatches option one GPU runs one microbatch (the memory model fits it).
    zoo = models.build("gpt-tiny", batch_size=4, device="cuda", dtype=torch.float64)
    _train_side_by_side(zoo.model, zoo.example_inputs, zoo.example_target, zoo.loss_fn, {"stages": 2, **options})
    from fxpipe.backend import _LAST_RUNNER

    runner = _LAST_RUNNER[0]
    assert runner.m == options.get("microbatches", 1)
    if options.get("inductor", True):  # the default on CUDA
        assert runner.inductor is not None and runner.inductor.failed == [] and runner.inductor.compiled == 3 * 2
    else:
        assert runner.inductor is None
    graphs = runner.step_graphs
    captured = graphs is not None and graphs.fwd is not None and graphs.bwd is not None
    assert captured == options.get("cuda_graphs", True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_with_inductor_and_cuda_graphs_follows_eager_autocast_on_cuda() -> None:
    # The backend's defaults on a GPU (Inductor, CUDA graphs, one microbatch) with precision bf16, against eager's
    # forward under torch.autocast (the loss outside it, as the backend's caller computes it): bf16 keeps 8 bits of
    # mantissa, and Inductor's fused kernels round in other places than eager's ops. Master weights stay fp32.
    torch._dynamo.reset()
    zoo = models.build("gpt-tiny", batch_size=4, device="cuda")
    model, ref = zoo.model, copy.deepcopy(zoo.model)
    compiled = torch.compile(model, backend="fxpipe", fullgraph=True, options={"stages": 2, "precision": "bf16"})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        out = compiled(*zoo.example_inputs)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out_ref = ref(*zoo.example_inputs)
        assert out.dtype == out_ref.dtype == torch.bfloat16
        loss, loss_ref = zoo.loss_fn(out, zoo.example_target), zoo.loss_fn(out_ref, zoo.example_target)
        loss.backward()
        loss_ref.backward()
        torch.testing.assert_close(loss.float(), loss_ref.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"step {step} loss: {m}")
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert p.dtype == p.grad.dtype == torch.float32, name
            torch.testing.assert_close(p.grad, ref_params[name].grad, atol=2e-2, rtol=5e-2,
                                       msg=lambda m: f"step {step} {name}: {m}")
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    from fxpipe.backend import _LAST_RUNNER

    runner = _LAST_RUNNER[0]
    assert runner.inductor is not None and runner.inductor.failed == [] and runner.step_graphs.bwd is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_a_second_backward_is_a_clear_error() -> None:
    torch._dynamo.reset()
    zoo = models.build("mlp-tiny", batch_size=4, device="cuda")
    compiled = torch.compile(zoo.model, backend="fxpipe", options={"stages": 2, "microbatches": 2, "cuda_graphs": True})
    for _ in range(3):
        loss = zoo.loss_fn(compiled(*zoo.example_inputs), zoo.example_target)
        loss.backward(retain_graph=True)
    with pytest.raises(Exception, match="backward ran twice"):
        loss.backward()


def test_bf16_precision_trains_like_eager_autocast() -> None:
    """options precision='bf16': the stages' graphs are traced under autocast, so outputs, loss and every fp32
    parameter's gradient equal eager run under ``torch.autocast`` microbatch by microbatch (each microbatch its own
    region, as the backend runs them), within bf16's 2^-8 (tests/runtime/test_optim.py derives it)."""
    torch._dynamo.reset()
    zoo = models.build("mlp-tiny")
    model, ref = zoo.model, copy.deepcopy(zoo.model)
    x = torch.randn(8, *zoo.example_inputs[0].shape[1:])
    target = torch.randint(0, 10, (8,))
    compiled = torch.compile(model, backend="fxpipe", fullgraph=True,
                             options={"stages": 2, "microbatches": 2, "precision": "bf16"})
    out = compiled(x)
    parts = []
    for part in x.tensor_split(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            parts.append(ref(part))
    out_ref = torch.cat(parts)
    assert out.dtype == out_ref.dtype == torch.bfloat16
    torch.nn.functional.cross_entropy(out.float(), target).backward()
    torch.nn.functional.cross_entropy(out_ref.float(), target).backward()
    torch.testing.assert_close(out, out_ref, rtol=2.0**-8, atol=0)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=2.0**-8, atol=1e-6, msg=lambda m: f"{name}: {m}")
    with pytest.raises(Exception, match="options 'precision' must be one of fp32, bf16, fp16"):
        torch._dynamo.reset()
        torch.compile(copy.deepcopy(ref), backend="fxpipe", options={"precision": "fp8"})(x)
