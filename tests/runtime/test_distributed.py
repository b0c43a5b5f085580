"""The runtime over torch.distributed (gloo, separate processes): every schedule trains exactly like one process."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.runtime._dist_worker import build

WORKER = Path(__file__).with_name("_dist_worker.py")
ROOT = Path(__file__).parents[2]
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "layerpipe", "auto"]
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


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("model", ["mlp-tiny", "gpt-tiny", "resnet-tiny", "skip-tied"])
def test_every_schedule_trains_like_one_process(model: str, ranks: int, tmp_path: Path) -> None:
    """mlp, gpt (tied weights), resnet (BatchNorm), and skip-tied: the embedding's output skips
    stages to the head, which is tied to it across ranks."""
    cfg = {"model": model, "schedules": SCHEDULES if ranks == 2 else ONE_STAGE_PER_RANK, "microbatches": 4,
           "steps": 3}
    if model == "skip-tied":
        cfg["granularity"] = "1"  # layers: emb, 4 blocks, head
    _check(tmp_path, ranks, cfg)


@pytest.mark.parametrize("model", ["gpt-tiny", "resnet-tiny"])
def test_interleaved_on_four_ranks(model: str, tmp_path: Path) -> None:
    """8 stages cut between nodes: some stages only transpose, view or flatten their input, and
    their gradients must still reach the stages before them (split_backward once dropped them)."""
    _check(tmp_path, 4, {"model": model, "schedules": ["interleaved-1f1b"], "microbatches": 4, "steps": 3})


def test_a_failing_rank_stops_the_others_with_a_clear_error(tmp_path: Path) -> None:
    results = _launch(tmp_path, 2, {"model": "mlp-tiny", "schedules": ["1f1b"], "microbatches": 4, "steps": 3,
                                    "fail_rank": 1})
    assert results[1].returncode != 0 and "boom on rank 1" in results[1].stderr
    assert results[0].returncode != 0
    assert "rank 0 waited for" in results[0].stderr and "from rank 1" in results[0].stderr


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    straight, resumed, ckpt = tmp_path / "a", tmp_path / "b", tmp_path / "ckpt"
    straight.mkdir(), resumed.mkdir()
    base = {"model": "gpt-tiny", "schedules": ["zb-h1"], "microbatches": 4}
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
