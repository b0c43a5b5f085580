"""Asynchronous training in one process (the reference executor): each weight policy against plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fxpipe
from fxpipe import models
from fxpipe.errors import OptionError
from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.runtime.weights import WeightVersions
from fxpipe.schedules.generators import async_1f1b, generate
from fxpipe.schedules.ir import Kind
from fxpipe.schedules.versions import copies, timings, versions_kept

N = 10  # microbatches in the stream


def _stream(zoo: models.ZooModel, n: int, seed: int = 0) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x, y = zoo.example_inputs[0], zoo.example_target
    out = []
    for _ in range(n):
        xi = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        yi = torch.randint(0, int(y.max()) + 1, y.shape, generator=gen) if not y.is_floating_point() else \
            torch.randn(y.shape, generator=gen, dtype=y.dtype)
        out.append(((xi,), yi))
    return out


def _delayed_sgd(model: nn.Module, stage_params: list[list[str]], schedule, stream, loss_fn, lr: float):  # type: ignore[no-untyped-def]
    """Plain PyTorch: microbatch m's gradient is taken with stage s's weights after f(s, m) updates (its F's
    version: PipeDream's weight stashing), and applied to the stage's weights after m updates."""
    t = timings(schedule)
    history = [[{n: dict(model.named_parameters())[n].detach().clone() for n in names}] for names in stage_params]
    losses = []
    for m, (inputs, target) in enumerate(stream):
        params = {n: v.requires_grad_(True) for s in range(len(stage_params))
                  for n, v in {k: w.clone() for k, w in history[s][t[(s, m)].f].items()}.items()}
        loss = loss_fn(functional_call(model, params, inputs), target)
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        losses.append(loss.detach())
        for s, names in enumerate(stage_params):
            assert t[(s, m)].w == m  # 1F1B applies each stage's updates in microbatch order
            history[s].append({n: history[s][m][n] - lr * grads[n] for n in names})
    return losses, {n: w for h in history for n, w in h[-1].items()}


@pytest.mark.parametrize(("stages", "name"), [(2, "async-1f1b"), (3, "async-1f1b"), (4, "async-1f1b"),
                                              (3, "layerpipe-async")])
def test_stash_equals_delayed_sgd_in_float64(stages: int, name: str) -> None:
    """PipeDream's stash, and LayerPipe's delayed-gradient schedule (W apart from B) under it: plain delayed SGD."""
    zoo = models.build("mlp-tiny", dtype=torch.float64)
    eager = copy.deepcopy(zoo.model)
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=stages)
    schedule = generate(name, stages, N)
    stream = _stream(zoo, N)
    ex = ReferenceExecutor(pipe, zoo.loss_fn)
    losses = ex.run_async(schedule, stream, lambda ps: torch.optim.SGD(ps, lr=0.05), weights="stash")

    names = [[n for n, _ in st.module.named_parameters()] for st in pipe.stages]
    want_losses, want = _delayed_sgd(eager, names, schedule, stream, zoo.loss_fn, 0.05)
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses))
    got = {n: p for st in pipe.stages for n, p in st.module.named_parameters()}
    for n, w in want.items():
        torch.testing.assert_close(got[n].detach(), w, msg=lambda msg: f"{n}: {msg}")
    # stage 0 of 1F1B sees stale weights: without stashing it would not be delayed SGD
    assert max(t.b - t.f for t in timings(schedule).values()) == stages - 1
    # a snapshot is copied into one no microbatch reads any more: new ones only for the versions in flight at once
    # (and as many as the simulator charges for)
    kept, made = versions_kept(schedule, "stash"), copies(schedule, "stash")
    assert all(new <= kept[s] + 1 and new + reused == made[(s, Kind.F)] and reused > 0
               for s, (new, reused) in ex.versions.snapshots.items()), (ex.versions.snapshots, kept, made)


def _quadratic() -> tuple[nn.Module, list[tuple[tuple[torch.Tensor], torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4))).double()
    teacher = nn.Linear(8, 8).double()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=gen, dtype=torch.float64) for _ in range(24)]
    return model, [((x,), teacher(x).detach()) for x in xs]


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def test_predict_tracks_synchronous_sgd_closer_than_stale() -> None:
    """Momentum SGD on a quadratic loss (a linear net, squared error), 4 stages: the distance of each policy's
    weights from plain sequential SGD's after the stream; prediction must be closer than the naive pipeline."""
    model, stream = _quadratic()
    sync = copy.deepcopy(model)
    opt = torch.optim.SGD(sync.parameters(), lr=0.02, momentum=0.9)
    for (x,), y in stream:
        opt.zero_grad()
        _mse(sync(x), y).backward()
        opt.step()
    want = dict(sync.named_parameters())

    distance = {}
    for policy in ("stale", "stash", "predict", "predict-consistent"):
        pipe = fxpipe.compile(copy.deepcopy(model), stream[0][0], stages=4)
        ReferenceExecutor(pipe, _mse).run_async(async_1f1b(4, len(stream)), stream,
                                                lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9), weights=policy)
        got = {n: p for st in pipe.stages for n, p in st.module.named_parameters()}
        distance[policy] = sum(float((got[n] - w).detach().pow(2).sum()) for n, w in want.items()) ** 0.5
    assert distance["predict"] < distance["stale"] and distance["predict-consistent"] < distance["stale"], distance
    assert all(d > 0 for d in distance.values())  # asynchronous training is not sequential SGD


def test_predicted_weights_follow_the_optimizers_smoothed_step() -> None:
    lin = nn.Linear(3, 2).double()
    for opt_cls, kwargs in ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 0.01})):
        opt = opt_cls(lin.parameters(), **kwargs)
        for _ in range(2):
            opt.zero_grad()
            lin(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
            opt.step()
        versions = WeightVersions(async_1f1b(2, 4), "predict", {0: lin}, {0: opt})
        got = versions._predict(0, 3)
        for n, p in lin.named_parameters():
            state = opt.state[p]
            if opt_cls is torch.optim.SGD:
                step = 0.1 * state["momentum_buffer"]
            else:
                k = float(state["step"])
                step = (0.01 * (state["exp_avg"] / (1 - 0.9 ** k))
                        / ((state["exp_avg_sq"] / (1 - 0.999 ** k)).sqrt() + 1e-8))
            torch.testing.assert_close(got[n], p.detach() - 3 * step)


@pytest.mark.parametrize(("make", "message"), [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "has no momentum"),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1), "weight prediction knows momentum SGD, Adam and AdamW"),
])
def test_predict_refuses_optimizers_without_a_smoothed_gradient(make, message: str) -> None:  # type: ignore[no-untyped-def]
    model, stream = _quadratic()
    pipe = fxpipe.compile(model, stream[0][0], stages=2)
    with pytest.raises(OptionError, match=message):
        ReferenceExecutor(pipe, _mse).run_async(async_1f1b(2, 4), stream[:4], make, weights="predict")


def test_tied_weights_are_refused_asynchronously() -> None:
    zoo = models.build("gpt-tiny")
    pipe = fxpipe.compile(zoo.model, zoo.example_inputs, stages=2)
    with pytest.raises(OptionError, match="lm_head.weight is shared by stages"):
        ReferenceExecutor(pipe, zoo.loss_fn).run_async(async_1f1b(2, 2), [(zoo.example_inputs, zoo.example_target)] * 2,
                                                       lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_layerpipe_async_trains_under_every_policy() -> None:
    """LayerPipe's delayed-gradient schedule in the reference executor: W apart from B, each read the version the
    schedule implies; every policy lowers the quadratic loss, and the prediction of a split W is made at W."""
    model, stream = _quadratic()
    schedule = generate("layerpipe-async", 4, len(stream))
    for policy in ("stale", "stash", "predict", "predict-consistent"):
        pipe = fxpipe.compile(copy.deepcopy(model), stream[0][0], stages=4)
        ex = ReferenceExecutor(pipe, _mse)
        losses = ex.run_async(schedule, stream, lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9), weights=policy)
        assert float(sum(losses[-4:])) < float(sum(losses[:4])), policy
        phases = {phase for _, _, phase, _, _ in ex.versions.log}
        assert phases == {"F", "B", "W"}
        if policy == "predict":
            assert any(ahead == s // 2 and s >= 2 for s, _, phase, _, ahead in ex.versions.log if phase == "W")
