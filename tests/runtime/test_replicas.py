"""Pipeline x data parallel (gloo, 4 processes: 2 pipeline ranks x 2 replicas): every synchronous schedule trains
exactly like one process on the whole batch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests._helpers import (
    ASYNC_ON_REPLICAS,
    EVERY_ORDER,
    SCHEDULES,
    TWO_SCHEDULES,
    assert_ranks_ok,
    check_saved,
    launch_ranks,
    replica_case,
    shared_case,
    with_plans,
)
from tests.runtime._dist_worker import build

SYNCHRONOUS = SCHEDULES  # all of them: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, layerpipe, auto


def reference(model: str, m: int, dp: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor],
                                                                 dict[str, torch.Tensor]]:
    """One process on the whole batch (dp x m microbatches): the mean loss, SGD with momentum. Buffers follow the
    replicas' rule: each replica updates the step's starting statistics with its own m microbatches, in order,
    and every replica ends the step with their mean."""
    net, inputs, target, loss_fn = build(model, m * dp)
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    n = m * dp
    xs = [x.tensor_split(n) for x in inputs]
    ts = target.tensor_split(n)
    bufs = dict(ref.named_buffers())
    losses = []
    for _ in range(steps):
        start = {k: b.clone() for k, b in bufs.items()}
        ends = []
        with torch.no_grad():  # each replica's statistics, from the weights before the step
            for d in range(dp):
                for k, b in bufs.items():
                    b.copy_(start[k])
                for i in range(d * m, (d + 1) * m):
                    ref(*(x[i] for x in xs))  # train mode: only the running statistics change
                ends.append({k: b.clone() for k, b in bufs.items()})
        total = sum(loss_fn(ref(*(x[i] for x in xs)), ts[i]) for i in range(n)) / n
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(total.detach()))
        with torch.no_grad():
            for k, b in bufs.items():
                b.copy_(sum(e[k] for e in ends) / dp if b.is_floating_point() else ends[0][k])
    return losses, dict(ref.named_parameters(remove_duplicate=False)), {k: b.detach().clone() for k, b in bufs.items()}


@pytest.mark.parametrize("model", ["mlp-tiny", "gpt-tiny", "resnet-tiny", "skip-tied"])
def test_two_stages_on_two_replicas_train_like_one_process(model: str) -> None:
    """mlp (on the user's own DeviceMesh); gpt (the tied embedding/head is summed over each replica's pipeline ranks,
    then over the replicas); resnet (BatchNorm: running statistics per replica, their mean at each step's end);
    skip-tied. Every synchronous schedule on mlp and gpt, 1f1b and zb-h2 on the others (TWO_SCHEDULES); a case of the
    shared 4-rank launch (tests/runtime/test_distributed.py)."""
    cfg = replica_case(model)
    assert cfg["schedules"] == (SYNCHRONOUS if model in EVERY_ORDER else TWO_SCHEDULES) and cfg["dp"] == 2
    check_saved(shared_case(4, f"replicas-{model}"), 4, cfg,
                 reference(cfg["model"], cfg["microbatches"], cfg["dp"], cfg["steps"]))


def test_a_checkpoint_is_written_once_per_stage_and_resumes_onto_another_replica_count(tmp_path: Path) -> None:
    """gpt-tiny (tied weights): 2 stages x 1 replica train 2 steps of 8 microbatches and save; 2 x 2 resume (4
    microbatches each, the same batch), train step 3 and save; 2 x 1 resume and train step 4. The losses and
    weights are one process's on the whole batch; the 2 x 2 checkpoint holds each tensor once (its replicas'
    files only their step)."""
    ck = tmp_path / "ck"
    runs = [(2, {"dp": 1, "microbatches": 8, "steps": 2, "checkpoint_after": 2}),
            (4, {"dp": 2, "microbatches": 4, "steps": 3, "checkpoint_after": 3, "resume": str(ck)}),
            (2, {"dp": 1, "microbatches": 8, "steps": 4, "resume": str(ck)})]
    losses, params, _ = reference("gpt-tiny", 4, 2, 4)
    for i, (world, cfg) in enumerate(runs):
        out = tmp_path / f"run{i}"
        out.mkdir()
        assert_ranks_ok(launch_ranks(out, world, with_plans(world, {"model": "gpt-tiny", "schedules": ["zb-h1"],
                                                               "checkpoint": str(ck), **cfg})))
        first = 0 if "resume" not in cfg else runs[i - 1][1]["steps"]
        for rank in range(world):
            saved = torch.load(out / f"zb-h1-rank{rank}.pt", weights_only=True)
            assert saved["losses"] == pytest.approx(losses[first:cfg["steps"]], rel=1e-9), (i, rank)
            if cfg["steps"] == 4:  # the last run: the weights after 4 steps
                for name, value in saved["state"]["params"].items():
                    torch.testing.assert_close(value, params[name].detach(), msg=lambda msg: f"{name}: {msg}")
    two, four = ck / "step_000002", ck / "step_000003"
    sizes = {f.name: f.stat().st_size for f in four.glob("*.distcp")}
    assert sorted(sizes) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    # Replica 1 (ranks 1 and 3) writes only its step; replica 0 what the one-replica run wrote for each stage.
    assert sizes["__1_0.distcp"] < 4096 and sizes["__3_0.distcp"] < 4096, sizes  # the step, DCP framing
    one = {f.name: f.stat().st_size for f in two.glob("*.distcp")}
    assert abs(sizes["__0_0.distcp"] + sizes["__2_0.distcp"] - sum(one.values())) < 4096, (sizes, one)


def test_the_layout_is_refused_when_the_world_does_not_divide() -> None:
    from fxpipe.errors import OptionError
    from fxpipe.runtime import replicas

    with pytest.raises(OptionError, match="the schedule runs on 2 ranks and the world has 3: start a multiple of 2"):
        replicas.layout(None, 2, 0, 3, "cpu")
    assert replicas.layout(None, 2, 1, 2, "cpu") == replicas.Layout(None, 1, 1, 0, (0, 1))


def test_asynchronous_training_on_replicas_is_refused_on_every_rank() -> None:
    """A case of the shared 2-rank launch (tests/runtime/test_distributed.py)."""
    assert ASYNC_ON_REPLICAS == {"model": "mlp-tiny", "schedules": ["async-1f1b"], "microbatches": 2, "steps": 1,
                                 "dp": 2, "refused": True}
    out = shared_case(2, "replicas-async-refused")
    for rank in range(2):
        assert (out / f"async-1f1b-refused-rank{rank}.txt").read_text() == (
            "OptionError: async-1f1b is asynchronous, and asynchronous training runs one replica per stage (here 2); "
            "start 1 rank, or pick a synchronous schedule")
