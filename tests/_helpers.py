"""What the test modules share, in one place: the CLI run in this process, a compiled model checked against eager,
the small models several tests build, ranks of a worker script launched over gloo, and what is expensive to make
(compiled plans, the shared multi-rank launches) made once per session.

Test modules import these from here, never from one another: pytest imports a test file under its own name
(``test_cli``; there is no ``__init__.py``), so importing it again as ``tests.cli.test_cli`` made a second copy,
with caches of its own (a launch cached there ran twice). This module is imported under one name only.
"""

from __future__ import annotations

import atexit
import copy
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from click.testing import Result

import fxpipe

ROOT = Path(__file__).parents[1]
# How long a test waits for a process it started before calling it hung: a guard that keeps a hang from stalling the
# suite, never a speed check, so far above what any run takes on a loaded machine (a Python that imports torch took
# over a minute at load 14 on 2 cores). A bound a test checks is one its output states, not a wall-clock reading.
HANG_S = 600


def session_dir(prefix: str) -> Path:
    """A fresh temporary directory, removed when the test session's process exits."""
    out = Path(tempfile.mkdtemp(prefix=f"fxpipe-test-{prefix}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return out


def skip_without(module: str) -> None:
    """Skip the calling test module when ``module`` is not installed, without importing it: ``pytest.importorskip``
    would, in every pytest-xdist worker (each collects every module), seconds of CPU for scikit-learn."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module}", allow_module_level=True)


# -- the command line, in this process -----------------------------------------------------------------------------

def fxpipe_cli(*args: str | os.PathLike[str] | int | float) -> Result:
    """Run ``fxpipe ARGS`` in this process; stdout and stderr are kept apart."""
    from typer.testing import CliRunner

    from fxpipe.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def ok(result: Result) -> Result:
    """The command succeeded: exit 0 and no exception."""
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.exception is None, repr(result.exception)
    return result


def one_line_error(result: Result) -> str:
    """The command failed the way the CLI promises: exit 2, one ``error:`` line on stderr, no traceback."""
    assert result.exit_code == 2, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{result.stderr}"
    assert lines[0].startswith("error: ")
    return lines[0]


@functools.cache
def cli_plan(*compile_args: str) -> Path:
    """``fxpipe compile COMPILE_ARGS --out DIR``'s plan directory, compiled once per session. Tests read it (a test
    that changes a plan copies it first)."""
    out = session_dir("plan") / "plan"
    ok(fxpipe_cli("compile", *compile_args, "--out", out))
    return out


def plan_fixture(*compile_args: str) -> Any:
    """A module's ``plan`` fixture: :func:`cli_plan` of ``compile_args`` (``plan = plan_fixture("mlp-tiny", ...)``)."""
    @pytest.fixture(scope="module", name="plan")
    def _plan() -> Path:
        return cli_plan(*compile_args)

    return _plan


# The plan most CLI tests run: mlp-tiny in 2 stages under zb-h1 with 4 microbatches.
MLP_PLAN = ("mlp-tiny", "--stages", "2", "--schedule", "zb-h1", "--microbatches", "4")


@pytest.fixture
def no_rank_starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """``fxpipe run`` must refuse before it starts torchrun: starting it fails the test (the command lines it was
    asked to start are listed, and checked empty at the end)."""
    from fxpipe.cli import ranks

    started: list[list[str]] = []

    def refuse(cmd: list[str], *args: Any, **kwargs: Any) -> Any:
        started.append(cmd)
        raise AssertionError(f"fxpipe run started its ranks: {cmd}")

    monkeypatch.setattr(ranks, "run_ranks", refuse)
    yield started
    assert started == [], started


def reference_losses(steps: int, m: int = 4, lr: float = 0.01, model: str = "gpt-tiny") -> list[float]:
    """One process on fxpipe run's synthetic batch of m microbatches: the mean loss per step, plain SGD."""
    from fxpipe import models
    from fxpipe.cli.rank_common import synthetic_batch

    zoo = models.build(model)
    ref = copy.deepcopy(zoo.model)
    inputs, target = synthetic_batch(zoo, m)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    xs, ts = inputs[0].tensor_split(m), target.tensor_split(m)
    losses = []
    for _ in range(steps):
        loss = sum(zoo.loss_fn(ref(xs[i]), ts[i]) for i in range(m)) / m
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


DP_STEPS = 3


@functools.cache
def dp_plan() -> Path:
    """mlp-small in 2 stages, compiled with --dp 2 (so fxpipe run starts 2 x 2 ranks unless told otherwise)."""
    return cli_plan("mlp-small", "--stages", "2", "--dp", "2")


@functools.cache
def four_rank_run() -> tuple[dict[str, object], list[dict[str, object]]]:
    """One launch on this node of :func:`dp_plan`'s 2 x 2 ranks, DP_STEPS steps of synthetic data, with its trace's
    events (tests/cli/test_run_dp.py checks it; test_multinode.py's 2 x 2 across two nodes must equal it)."""
    trace = session_dir("dp") / "measured.json"
    doc = json.loads(ok(fxpipe_cli("run", dp_plan(), "--steps", DP_STEPS, "--json", "--trace", trace)).stdout)
    return doc, json.loads(trace.read_text())["traceEvents"]


# -- a compiled model composes back to eager -----------------------------------------------------------------------

def assert_composes(model: torch.nn.Module, inputs: tuple[Any, ...], loss_fn: Any, target: torch.Tensor, stages: int,
                    *, exact: bool = False, **options: Any) -> fxpipe.Pipeline:
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
    with tempfile.TemporaryDirectory() as d:
        loaded = fxpipe.load(fxpipe.save(pipe, Path(d) / "plan"))
    torch.manual_seed(1234)
    out = loaded(*inputs)
    loss_fn(out, target).backward()
    torch.testing.assert_close(out, ref_out, msg=lambda m: f"loaded plan: {m}", **tol)
    for stage in loaded.stages:
        for name, param in stage.module.named_parameters():
            assert param.grad is not None, f"loaded plan: {name} got no gradient"
            torch.testing.assert_close(param.grad, ref_params[name].grad, msg=lambda m: f"loaded plan {name}: "
                                                                                        f"{m}", **tol)


def check_fbw_matches_eager(model: nn.Module, example: tuple[Any, ...], loss_fn: Any,
                            mbs: list[tuple[tuple[Any, ...], Any]], stages: int, *, seed: int = 0,
                            order: Any = None, **options: Any) -> fxpipe.Pipeline:
    """F, B, W per microbatch through the reference executor == eager autograd on the mean loss."""
    from fxpipe.runtime.reference import ReferenceExecutor

    ref = copy.deepcopy(model)
    mine = copy.deepcopy(model)
    inputs_ref = [tuple(x.clone().requires_grad_(x.is_floating_point()) for x in mb[0]) for mb in mbs]
    torch.manual_seed(seed)
    losses_ref = [loss_fn(ref(*x), mb[1]) for x, mb in zip(inputs_ref, mbs)]
    (sum(losses_ref) / len(mbs)).backward()

    pipe = fxpipe.compile(mine, example, stages=stages, input_grads=True, **options)
    assert pipe.stage_graphs is not None
    assert not [g.fused_reason for g in pipe.stage_graphs if g.fused]
    ex = ReferenceExecutor(pipe, loss_fn)
    torch.manual_seed(seed)
    losses = ex.run(mbs, order=order)

    torch.testing.assert_close(torch.stack(losses), torch.stack(losses_ref).detach())
    ref_params = dict(ref.named_parameters())
    for name, p in mine.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"{name}: {m}")
    for m, x in enumerate(inputs_ref):
        for name, xi in zip(pipe.input_names, x):
            if xi.is_floating_point():
                torch.testing.assert_close(ex.input_grads[m][name], xi.grad, msg=lambda msg: f"input {name}: {msg}")
    return pipe


# -- models the tests build ----------------------------------------------------------------------------------------

class SkipTied(nn.Module):
    """A skip connection that crosses two stage boundaries, and an embedding tied to the head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h0 = self.emb(idx)
        h = h0
        for block in self.blocks:
            h = block(h)
        return self.head(h + h0)  # h0 is made on the first stage and read on the last


def skip_tied() -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """:class:`SkipTied` from seed 0 with a batch of 3 sequences of 5 tokens and its target."""
    torch.manual_seed(0)
    return SkipTied(), (torch.randint(0, 32, (3, 5)),), torch.randint(0, 32, (3, 5))


def token_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every token of a (batch, sequence, vocabulary) output."""
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def hf_gpt2() -> torch.nn.Module:
    """A 3-layer Hugging Face GPT-2 from a small config (no download), seed 0, in training mode."""
    import transformers

    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=96, n_positions=32, use_cache=False,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def hf_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a Hugging Face causal LM's logits over every token."""
    logits = out.logits  # type: ignore[attr-defined]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.fc(x) * float(x.sum()),)  # reads a value: AOTAutograd cannot trace it on fake tensors


@functools.cache
def zoo_pipe(name: str, stages: int) -> fxpipe.Pipeline:
    """A zoo model (or ``skip-tied``, a layer per block) compiled into ``stages`` stages (cut between nodes beyond 4),
    once per session: the tests that ask lower, save and cost it, and none may change it."""
    from fxpipe import models

    if name == "skip-tied":
        model, inputs, _ = skip_tied()
        return fxpipe.compile(model, inputs, stages=stages, granularity="1")
    zoo = models.build(name)
    return fxpipe.compile(zoo.model, zoo.example_inputs, stages=stages,
                          granularity="node" if stages > 4 else "auto")


def stream(zoo: Any, batches: int, m: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """``batches`` batches of m microbatches shaped like the zoo example, from a fixed seed."""
    gen = torch.Generator().manual_seed(7)
    x, y = zoo.example_inputs[0], zoo.example_target
    return [((torch.randn((x.shape[0] * m, *x.shape[1:]), generator=gen, dtype=x.dtype),),
             torch.randint(0, int(y.max()) + 1, (y.shape[0] * m, *y.shape[1:]), generator=gen))
            for _ in range(batches)]


# -- checkpoints without ranks ----------------------------------------------------------------------------------------

class OneRank:
    """What checkpoint.save/load read of a PipelineRuntime, for one rank holding ``a.weight`` and a buffer."""

    def __init__(self, value: float, *, name: str = "a.weight", extra: dict[str, Any] | None = None) -> None:
        import types

        self.rank, self.where, self.pp_rank, self.dp_rank = 0, [0], 0, 0
        self.pipe = types.SimpleNamespace(shared_params={}, num_stages=1)
        self.schedule = types.SimpleNamespace(name="1f1b")
        self.name, self.value, self.extra = name, value, extra or {}
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        w = torch.full((2, 3), self.value, dtype=torch.float64)
        return {"rank": 0, "params": {self.name: w}, "buffers": {"bn.running_mean": torch.zeros(3)},
                "optim": {self.name: {"momentum_buffer": 2 * w, "step": 7, **self.extra}},
                "param_groups": [{"params": [self.name], "lr": 0.1, "betas": [0.9, 0.99], "foreach": None}]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def saved_checkpoints(root: Path, steps: range, keep: int = 3) -> Path:
    """``root`` with a checkpoint of :class:`OneRank` saved at each of ``steps`` (the last ``keep`` kept)."""
    from fxpipe.runtime import checkpoint

    for step in steps:
        checkpoint.save(OneRank(float(step)), root, step, keep=keep)
    return root


def load_checkpoints(root: Path) -> tuple[int, list[str], OneRank]:
    """:class:`OneRank` loaded from ``root``'s newest complete checkpoint: the step, the warnings, the stand-in."""
    from fxpipe.runtime import checkpoint

    rt, warned = OneRank(0.0), []
    return checkpoint.load(rt, root, warn=warned.append), warned, rt


# -- ranks of a worker script over gloo ----------------------------------------------------------------------------

DIST_WORKER = ROOT / "tests" / "runtime" / "_dist_worker.py"


def launch_ranks(tmp_path: Path, world: int, cfg: dict[str, Any], worker: Path = DIST_WORKER,
                 timeout: float = HANG_S) -> list[subprocess.CompletedProcess[str]]:
    """``world`` processes of ``worker`` (argv: rank, world, init method, ``tmp_path``, ``cfg`` as JSON), meeting
    over a file in ``tmp_path`` (forked from the preloaded forkserver: :class:`Forked`); each one's exit code, stdout
    and stderr."""
    init = f"file://{tmp_path / 'pg'}"
    (tmp_path / "pg").unlink(missing_ok=True)
    procs = [Forked([str(worker), str(r), str(world), init, str(tmp_path), json.dumps(cfg)]) for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def assert_ranks_ok(results: list[subprocess.CompletedProcess[str]]) -> None:
    """Every rank exited 0; else each failed rank's last lines, the rank that failed on its own first (the others
    mostly report only that their peer's connection closed)."""
    failed = [(r, res) for r, res in enumerate(results) if res.returncode != 0]
    if not failed:
        return
    failed.sort(key=lambda item: any(gone in item[1].stderr for gone in _PEER_GONE))
    report = "\n".join(f"--- rank {r} (exit {res.returncode}):\n" + "\n".join(res.stderr.splitlines()[-25:])
                       for r, res in failed)
    raise AssertionError(f"{len(failed)} of {len(results)} ranks failed:\n{report}")


# -- training on ranks against one process (tests/runtime/test_distributed.py, test_replicas.py, test_checkpoint.py) --

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "layerpipe", "batched-w", "auto"]
ONE_STAGE_PER_RANK = [s for s in SCHEDULES if s != "interleaved-1f1b"]


def train_reference(model: str, m: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training with the same microbatching: the mean loss over microbatches, SGD with momentum."""
    from tests.runtime._dist_worker import build

    net, inputs, target, loss_fn = build(model, m)
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    xs = [x.tensor_split(m) for x in inputs]
    ts = target.tensor_split(m)
    losses = []
    for _ in range(steps):
        total = sum(loss_fn(ref(*(x[i] for x in xs)), ts[i]) for i in range(m)) / m
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(total.detach()))
    return losses, dict(ref.named_parameters(remove_duplicate=False))  # tied weights: one object, two names


def check_saved(tmp_path: Path, world: int, cfg: dict[str, Any],
                expected: tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None) -> None:
    """Every rank of every schedule of ``cfg`` ended, in the files a launch wrote into ``tmp_path``, with one process's
    losses and parameters (``expected``: losses, parameters and buffers to check; default: :func:`train_reference`'s,
    buffers unchecked)."""
    losses, params, buffers = expected or (*train_reference(cfg["model"], cfg["microbatches"], cfg["steps"]), {})
    for name in cfg["schedules"]:
        seen = set()
        for rank in range(world):
            saved = torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=False)
            assert saved["losses"] == pytest.approx(losses, rel=1e-9), name
            for pname, value in saved["state"]["params"].items():
                torch.testing.assert_close(value, params[pname].detach(), msg=lambda msg: f"{name} {pname}: {msg}")
                seen.add(pname)
            for bname, value in saved["state"]["buffers"].items() if buffers else ():
                torch.testing.assert_close(value, buffers[bname], msg=lambda msg: f"{name} {bname}: {msg}")
        # Every parameter was trained on some rank (a tied weight under either of its names).
        assert {id(params[n]) for n in seen} == {id(p) for p in params.values()}, name


# One launch per world size, many cases: starting ranks and compiling the whole model on each of them costs seconds
# per rank, so the training cases of a world size share one launch (each case in turn on the same ranks, its files in
# a directory of its own; each test checks its own case), and their pipelines are compiled once here and loaded by
# the ranks, as fxpipe run's ranks do. The cases that compile on the ranks themselves (a user's script): the failing
# rank of test_distributed.py and test_checkpoint.py; resume, test_faults.py and test_replicas.py's checkpoint case
# load the plans.

MODELS = ["mlp-tiny", "gpt-tiny", "resnet-tiny", "skip-tied"]
# On 4 ranks (2 cores: the launch that sets the suite's length), resnet-tiny and skip-tied run two schedules, not
# every one: 1f1b (fused BW) and zb-h2 (B and W apart, W deferred). What they add, BatchNorm's buffers and a value
# skipping stages to a weight tied across ranks, does not depend on the order; every order runs on mlp and gpt.
TWO_SCHEDULES = ["1f1b", "zb-h2"]
EVERY_ORDER = ("mlp-tiny", "gpt-tiny")  # the models that run every schedule on 4 ranks too


def schedule_case(model: str, ranks: int) -> dict[str, Any]:
    """mlp, gpt (tied weights), resnet (BatchNorm), and skip-tied: every schedule on 2 ranks; on 4, every one with a
    stage per rank for mlp and gpt, TWO_SCHEDULES for the others."""
    schedules = SCHEDULES if ranks == 2 else ONE_STAGE_PER_RANK if model in EVERY_ORDER else TWO_SCHEDULES
    cfg = {"model": model, "schedules": schedules, "microbatches": 4, "steps": 3}
    if model == "skip-tied":
        cfg["granularity"] = "1"  # layers: emb, 4 blocks, head
    return cfg


def interleaved_case(model: str) -> dict[str, Any]:
    return {"model": model, "schedules": ["interleaved-1f1b"], "microbatches": 4, "steps": 3}


def replica_case(model: str) -> dict[str, Any]:
    """tests/runtime/test_replicas.py's: 2 stages on 2 replicas, every synchronous schedule (TWO_SCHEDULES for the
    models not in EVERY_ORDER)."""
    schedules = SCHEDULES if model in EVERY_ORDER else TWO_SCHEDULES
    cfg = {"model": model, "schedules": schedules, "microbatches": 4, "steps": 3, "dp": 2}
    if model == "mlp-tiny":
        cfg["mesh"] = True  # PipelineRuntime(..., mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    if model == "skip-tied":
        cfg["granularity"] = "1"
    return cfg


# tests/runtime/test_replicas.py's refusal: asynchronous training on 2 replicas, refused on both ranks
ASYNC_ON_REPLICAS = {"model": "mlp-tiny", "schedules": ["async-1f1b"], "microbatches": 2, "steps": 1, "dp": 2,
                     "refused": True}


# batched W on a model whose first stage's W mixes the batch's samples (x - x.mean(0)): that stage must run per
# microbatch
BATCH_MIX = {"model": "batch-mix", "schedules": ["batched-w"], "microbatches": 4, "steps": 3}


def tag_blind_cases(world: int) -> dict[str, dict[str, Any]]:
    """tests/runtime/test_distributed.py's tag-blind cases (one tag per pair of ranks, as NCCL matches messages):
    every synchronous schedule on mlp-tiny (interleaved on 4 ranks: gpt-tiny's 8 stages, whose receives are read in
    another order than they are sent); on 2 ranks, a perturbed posting order with and without tags."""
    blind = {"tag_blind": True}
    if world == 2:
        perturbed = {"model": "mlp-tiny", "schedules": ["1f1b"], "microbatches": 4, "steps": 2, "perturb": True}
        return {"tag-blind-mlp-tiny": {**schedule_case("mlp-tiny", 2), **blind},
                "perturbed-tag-blind": {**perturbed, **blind}, "perturbed-tags": perturbed}
    return {"tag-blind-mlp-tiny": {**schedule_case("mlp-tiny", 4), **blind},
            "tag-blind-interleaved-gpt-tiny": {**interleaved_case("gpt-tiny"), **blind}}


def shared_cases(world: int) -> dict[str, dict[str, Any]]:
    """Every case of the launch of ``world`` ranks, by name."""
    cases = {f"schedules-{model}": schedule_case(model, world) for model in MODELS}
    cases.update(tag_blind_cases(world))
    if world == 2:
        cases["replicas-async-refused"] = ASYNC_ON_REPLICAS
        cases["batched-w-batch-mix"] = BATCH_MIX
    if world == 4:
        cases.update({f"interleaved-{model}": interleaved_case(model) for model in ["gpt-tiny", "resnet-tiny"]})
        cases.update({f"replicas-{model}": replica_case(model) for model in MODELS})
    return cases


@functools.cache
def saved_plan(model: str, stages: int, granularity: str) -> str:
    """``model`` compiled into ``stages`` stages on a microbatch of 2 rows (what every rank would compile), saved;
    once per session."""
    from tests.runtime._dist_worker import build

    net, inputs, _, _ = build(model, 1)
    out = session_dir("dist")
    return str(fxpipe.save(fxpipe.compile(net, inputs, stages=stages, granularity=granularity), out / "plan"))


def with_plans(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the saved plan of each stage count its schedules run."""
    from tests.runtime._dist_worker import granularity_of

    positions = world // cfg.get("dp", 1)
    counts = {2 * positions if name == "interleaved-1f1b" else positions for name in cfg["schedules"]}
    return {**cfg, "plans": {str(n): saved_plan(cfg["model"], n, granularity_of(cfg, n, positions)) for n in counts}}


@functools.cache
def shared_launch(world: int) -> Path:
    """The one launch of ``world`` ranks running :func:`shared_cases` (once per session, whichever test module asks
    first); case ``name``'s files are in ``DIR/name``. A failed launch fails every test of its cases, each with the
    failed ranks' report."""
    out = session_dir(f"dist{world}")
    cases = {name: with_plans(world, cfg) for name, cfg in shared_cases(world).items()}
    results = launch_ranks(out, world, {"cases": cases, "pg_timeout": 60})
    (out / "results.json").write_text(json.dumps([[r.returncode, r.stderr] for r in results]))
    return out


def shared_case(world: int, name: str) -> Path:
    """Case ``name`` of the launch of ``world`` ranks: its directory, once every rank of the launch exited 0."""
    out = shared_launch(world)
    codes = json.loads((out / "results.json").read_text())
    assert_ranks_ok([subprocess.CompletedProcess([], code, "", err) for code, err in codes])
    return out / name


def tree(root: Path, digest: Callable[[Path], str] | None = None) -> dict[str, str]:
    """Every entry under ``root`` without following links: a file's digest (its sha256 unless ``digest`` says
    otherwise), a link's target, a folder's mark. Two trees compare equal when nothing under them changed."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = path.relative_to(root).as_posix()
            found[key] = ("-> " + os.readlink(path) if path.is_symlink() else "dir" if path.is_dir()
                          else digest(path) if digest is not None else hashlib.sha256(path.read_bytes()).hexdigest())
    return found


# -- Python processes forked from one that has already imported torch ------------------------------------------------

# What every rank of a worker script imports first: the forkserver imports it once, and each process forked from it
# starts there instead of paying Python's and torch's start-up (seconds of CPU per process on this machine) again.
_PRELOAD = ["torch", "torch.distributed", "torch._functorch.aot_autograd", "fxpipe", "fxpipe.runtime.executor",
            "fxpipe.models", "tests._helpers"]


def _forked_main(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The child: the environment, working directory and output files it would have had as ``python ARGV``, then
    the script, ``-c`` code or ``-m`` module run as ``__main__``; its exit status is the script's."""
    import runpy
    import traceback

    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read by a new Python as torch loads: the server had loaded it
        import torch

        torch.set_num_threads(int(threads))
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (as Python reports an uncaught exception: its traceback, exit 1)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Forked:
    """``python ARGV`` as a process forked from the preloaded forkserver: what the tests use of ``subprocess.Popen``
    (``pid``, ``poll``, ``wait``, ``kill``, ``communicate`` and ``returncode``, a signal's as its negative number).
    Its stdout and stderr go to files, read when it has exited."""

    def __init__(self, argv: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self._dir = tempfile.mkdtemp(prefix="fxpipe-test-forked-")
        self._out, self._err = os.path.join(self._dir, "out"), os.path.join(self._dir, "err")
        self.args = argv
        environ = dict(os.environ if env is None else env)
        self._proc = ctx.Process(target=_forked_main, args=(list(argv), str(cwd), environ, self._out, self._err),
                                 daemon=False)
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        self._proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        texts = tuple(Path(p).read_text(errors="replace") for p in (self._out, self._err))
        shutil.rmtree(self._dir, ignore_errors=True)
        return texts  # type: ignore[return-value]


def run_forked(argv: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None,
               timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True)``, forked from the forkserver."""
    proc = Forked(argv, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, out, err)  # type: ignore[arg-type]


def count_boxing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the graphs the executor core boxes from now on (``fxpipe.runtime.core.boxed``: a copy of the graph,
    recompiled), one entry per boxing."""
    import fxpipe.runtime.core as core

    made: list[int] = []
    boxing = core.boxed

    def counted(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        made.append(id(gm))
        return boxing(gm)

    monkeypatch.setattr(core, "boxed", counted)
    return made


@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    """A gloo process group of one rank in this process (a HashStore: nothing leaves it), for a module whose
    ``PipelineRuntime`` runs every stage on rank 0 (a one-rank schedule): the distributed runtime without a launch."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def forked_ranks(nproc: int, argv: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None,
                 timeout: float = HANG_S) -> list[subprocess.CompletedProcess[str]]:
    """``torchrun --standalone --nproc-per-node NPROC ARGV`` without torchrun's agent: ``nproc`` processes forked
    from the forkserver (:class:`Forked`), each with the environment torchrun gives a rank (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT; OMP_NUM_THREADS=1), for a script that starts
    its process group from ``env://``; each rank's exit code, stdout and stderr. (docs/*.md's torchrun commands run
    under torchrun itself in tests/test_docs.py.)"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in (os.environ if env is None else env).items()
            if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_", "GROUP_", "ROLE_", "TORCHELASTIC_"))}
    base.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc))
    procs = [Forked(argv, cwd=cwd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nproc)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess([sys.executable, *argv], p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results  # type: ignore[return-value]


def import_file(path: str | os.PathLike[str], name: str) -> Any:
    """The Python file at ``path`` imported as a module named ``name`` (a user's model, loss or data file, as the
    test's one-process reference reads it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
