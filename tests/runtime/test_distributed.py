"""The runtime over torch.distributed (gloo, separate processes): every schedule trains exactly like one process."""

from __future__ import annotations

import atexit
import copy
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.runtime._cache import once
from tests.runtime._dist_worker import build, granularity_of

WORKER = Path(__file__).with_name("_dist_worker.py")
ROOT = Path(__file__).parents[2]
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "layerpipe", "batched-w", "auto"]
ONE_STAGE_PER_RANK = [s for s in SCHEDULES if s != "interleaved-1f1b"]


def _launch(tmp_path: Path, world: int, cfg: dict[str, Any]) -> list[subprocess.CompletedProcess[str]]:
    init = f"file://{tmp_path / 'pg'}"
    (tmp_path / "pg").unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), init, str(tmp_path), json.dumps(cfg)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
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


def _reference(model: str, m: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training with the same microbatching: the mean loss over microbatches, SGD with momentum."""
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


def _check(tmp_path: Path, world: int, cfg: dict[str, Any],
           expected: tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None) -> None:
    """Every rank of every schedule ended with one process's losses and parameters (``expected``: losses,
    parameters and buffers to check; default: :func:`_reference`'s, buffers unchecked)."""
    assert_ranks_ok(_launch(tmp_path, world, cfg))
    _check_saved(tmp_path, world, cfg, expected)


def _check_saved(tmp_path: Path, world: int, cfg: dict[str, Any],
                 expected: tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None) -> None:
    """:func:`_check` on the files a launch already wrote into ``tmp_path``."""
    losses, params, buffers = expected or (*_reference(cfg["model"], cfg["microbatches"], cfg["steps"]), {})
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


# -- one launch per world size, many cases ------------------------------------------------------------------------
# Starting ranks and compiling the whole model on each of them costs seconds per rank, so the training cases of a
# world size share one launch (each case in turn on the same ranks, its files in a directory of its own; each test
# checks its own case), and their pipelines are compiled once here and loaded by the ranks, as fxpipe run's ranks do.
# The cases that compile on the ranks themselves (a user's script): the failing rank below,
# tests/runtime/test_checkpoint.py and test_faults.py; resume and test_replicas.py's checkpoint case load the plans.

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


# batched W on a model whose first stage's W mixes the batch's samples (x - x.mean(0)): that stage must run per microbatch
BATCH_MIX = {"model": "batch-mix", "schedules": ["batched-w"], "microbatches": 4, "steps": 3}


def shared_cases(world: int) -> dict[str, dict[str, Any]]:
    """Every case of the launch of ``world`` ranks, by name."""
    cases = {f"schedules-{model}": schedule_case(model, world) for model in MODELS}
    if world == 2:
        cases["replicas-async-refused"] = ASYNC_ON_REPLICAS
        cases["batched-w-batch-mix"] = BATCH_MIX
    if world == 4:
        cases.update({f"interleaved-{model}": interleaved_case(model) for model in ["gpt-tiny", "resnet-tiny"]})
        cases.update({f"replicas-{model}": replica_case(model) for model in MODELS})
    return cases


def _plan(model: str, stages: int, granularity: str) -> str:
    """``model`` compiled into ``stages`` stages on a microbatch of 2 rows (what every rank would compile), saved;
    once per session."""
    def make() -> str:
        import fxpipe

        net, inputs, _, _ = build(model, 1)
        out = Path(tempfile.mkdtemp(prefix="fxpipe-test-dist-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        return str(fxpipe.save(fxpipe.compile(net, inputs, stages=stages, granularity=granularity), out / "plan"))

    return once(("dist-plan", model, stages, granularity), make)


def with_plans(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the saved plan of each stage count its schedules run."""
    positions = world // cfg.get("dp", 1)
    counts = {2 * positions if name == "interleaved-1f1b" else positions for name in cfg["schedules"]}
    return {**cfg, "plans": {str(n): _plan(cfg["model"], n, granularity_of(cfg, n, positions)) for n in counts}}


def shared_launch(world: int) -> Path:
    """The one launch of ``world`` ranks running :func:`shared_cases` (once per session, whichever test module asks
    first: tests/runtime/_cache.py); case ``name``'s files are in ``DIR/name``. A failed launch fails every test of its
    cases, each with the failed ranks' report."""
    def make() -> Path:
        out = Path(tempfile.mkdtemp(prefix=f"fxpipe-test-dist{world}-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        cases = {name: with_plans(world, cfg) for name, cfg in shared_cases(world).items()}
        results = _launch(out, world, {"cases": cases, "pg_timeout": 60})
        (out / "results.json").write_text(json.dumps([[r.returncode, r.stderr] for r in results]))
        return out

    return once(("dist-launch", world), make)


def shared_case(world: int, name: str) -> Path:
    """Case ``name`` of the launch of ``world`` ranks: its directory, once every rank of the launch exited 0."""
    out = shared_launch(world)
    codes = json.loads((out / "results.json").read_text())
    assert_ranks_ok([subprocess.CompletedProcess([], code, "", err) for code, err in codes])
    return out / name


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_every_schedule_trains_like_one_process(model: str, ranks: int) -> None:
    """mlp, gpt (tied weights), resnet (BatchNorm), and skip-tied: the embedding's output skips
    stages to the head, which is tied to it across ranks."""
    _check_saved(shared_case(ranks, f"schedules-{model}"), ranks, schedule_case(model, ranks))


# How each stage of the 2-stage plans runs batched-w's Ws (4 microbatches: two batches of 2): 2 microbatches at once,
# or per microbatch and why.
BATCHED_W = {
    "mlp-tiny": ["batched over 2 microbatches"] * 2,
    "skip-tied": ["batched over 2 microbatches"] * 2,
    # a traced attention's views hold the microbatch's size: the stage cannot be traced for 2 at once
    "gpt-tiny": ["per microbatch: the stage does not run on 2 microbatches at once"] * 2,
    # BatchNorm's W reads each microbatch's own mean and variance, which no concatenation combines
    "resnet-tiny": ["per microbatch: an input its W keeps the shape of differs between microbatches"] * 2,
    # stage 0's W backpropagates through x - x.mean(0): the first batched call's check catches it
    "batch-mix": ["per microbatch: its W over 2 microbatches is not the sum of the per-microbatch W's",
                  "batched over 2 microbatches"],
}


@pytest.mark.parametrize("model", sorted(BATCHED_W))
def test_batched_w_runs_one_w_per_stage_where_that_is_the_sum(model: str) -> None:
    """batched-w on 2 ranks trains like one process (``_check_saved``), and each stage's W ran as expected: one call
    per batch of 2 microbatches where the stage traces at 2 microbatches and its W is a sum over them, else per
    microbatch, with the reason."""
    case = "batched-w-batch-mix" if model == "batch-mix" else f"schedules-{model}"
    out = shared_case(2, case)
    cfg = BATCH_MIX if model == "batch-mix" else schedule_case(model, 2)
    _check_saved(out, 2, {**cfg, "schedules": ["batched-w"]})
    how: dict[int, str] = {}
    for rank in range(2):
        how.update(torch.load(out / f"batched-w-rank{rank}.pt", weights_only=False)["batched_w"])
    assert sorted(how) == [0, 1]
    for s, expected in enumerate(BATCHED_W[model]):
        assert how[s].startswith(expected), (s, how[s])


@pytest.mark.parametrize("model", ["gpt-tiny", "resnet-tiny"])
def test_interleaved_on_four_ranks(model: str) -> None:
    """8 stages cut between nodes: some stages only transpose, view or flatten their input, and
    their gradients must still reach the stages before them (split_backward once dropped them)."""
    _check_saved(shared_case(4, f"interleaved-{model}"), 4, interleaved_case(model))


def test_a_failing_rank_stops_the_others_with_a_clear_error(tmp_path: Path) -> None:
    results = _launch(tmp_path, 2, {"model": "mlp-tiny", "schedules": ["1f1b"], "microbatches": 4, "steps": 3,
                                    "fail_rank": 1})
    assert results[1].returncode != 0 and "boom on rank 1" in results[1].stderr
    assert results[0].returncode != 0
    assert "rank 0 waited for" in results[0].stderr and "from rank 1" in results[0].stderr


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    straight, resumed, ckpt = tmp_path / "a", tmp_path / "b", tmp_path / "ckpt"
    straight.mkdir(), resumed.mkdir()
    base = with_plans(2, {"model": "gpt-tiny", "schedules": ["zb-h1"], "microbatches": 4})
    assert all(r.returncode == 0 for r in _launch(straight, 2, {**base, "steps": 3}))
    assert all(r.returncode == 0 for r in _launch(resumed, 2, {**base, "steps": 2, "checkpoint": str(ckpt),
                                                                 "checkpoint_after": 2}))
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002"]  # no partial save left
    assert sorted(p.name for p in (ckpt / "step_000002").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "fxpipe-checkpoint.json"]
    assert all(r.returncode == 0 for r in _launch(resumed, 2, {**base, "steps": 3, "resume": str(ckpt)}))
    for rank in range(2):
        a = torch.load(straight / f"zb-h1-rank{rank}.pt", weights_only=False)["state"]["params"]
        b = torch.load(resumed / f"zb-h1-rank{rank}.pt", weights_only=False)["state"]["params"]
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
