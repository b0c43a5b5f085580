"""The runtime over torch.distributed (gloo, separate processes): every schedule trains exactly like one process."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxpipe import models

WORKER = Path(__file__).with_name("_dist_worker.py")
ROOT = Path(__file__).parents[2]


def _launch(tmp_path: Path, world: int, model: str, stages: int, schedules: list[str], m: int, steps: int,
            fail_rank: int = -1) -> list[subprocess.CompletedProcess[str]]:
    init = f"file://{tmp_path / 'pg'}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), init, str(tmp_path), model, str(stages),
                               ",".join(schedules), str(m), str(steps), str(fail_rank)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def _reference(model: str, m: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    zoo = models.build(model, dtype=torch.float64, batch_size=m * 2)
    ref = copy.deepcopy(zoo.model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    xs = [x.tensor_split(m) for x in zoo.example_inputs]
    ts = zoo.example_target.tensor_split(m)
    losses = []
    for _ in range(steps):
        total = sum(zoo.loss_fn(ref(*(x[i] for x in xs)), ts[i]) for i in range(m)) / m
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(total.detach()))
    return losses, dict(ref.named_parameters(remove_duplicate=False))  # tied weights: one object, two names


@pytest.mark.parametrize("model", ["mlp-tiny", "gpt-tiny"])
def test_two_ranks_every_schedule_trains_like_one_process(model: str, tmp_path: Path) -> None:
    schedules = ["gpipe", "1f1b", "zb-h1", "zb-h2", "layerpipe", "auto"]
    m, steps = 4, 3
    results = _launch(tmp_path, 2, model, 2, schedules, m, steps)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    losses, params = _reference(model, m, steps)
    for name in schedules:
        seen = set()
        for rank in range(2):
            saved = torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=False)
            assert saved["losses"] == pytest.approx(losses, rel=1e-9), name
            for pname, value in saved["state"]["params"].items():
                torch.testing.assert_close(value, params[pname], msg=lambda msg: f"{name} {pname}: {msg}")
                seen.add(pname)
        # Every parameter was trained on some rank (a tied weight under either of its names).
        assert {id(params[n]) for n in seen} == {id(p) for p in params.values()}


def test_interleaved_two_stages_per_rank(tmp_path: Path) -> None:
    m, steps = 4, 2
    results = _launch(tmp_path, 2, "gpt-tiny", 4, ["interleaved-1f1b"], m, steps)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    losses, params = _reference("gpt-tiny", m, steps)
    for rank in range(2):
        saved = torch.load(tmp_path / f"interleaved-1f1b-rank{rank}.pt", weights_only=False)
        assert saved["losses"] == pytest.approx(losses, rel=1e-9)
        for pname, value in saved["state"]["params"].items():
            torch.testing.assert_close(value, params[pname], msg=lambda msg: f"{pname}: {msg}")


def test_a_failing_rank_stops_the_others_with_a_clear_error(tmp_path: Path) -> None:
    results = _launch(tmp_path, 2, "mlp-tiny", 2, ["1f1b"], 4, 3, fail_rank=1)
    assert results[1].returncode != 0 and "boom on rank 1" in results[1].stderr
    assert results[0].returncode != 0
    assert "rank 0 waited for" in results[0].stderr and "from rank 1" in results[0].stderr
