"""Optimizers, lr schedules, global gradient-norm clipping and mixed precision (fxpipe.runtime.optim) against torch.

The runtime checks train a 3-stage pipeline on one rank (every stage on rank 0 of a world-1 gloo group: a real
pipeline, in this process) against one process with ``torch.optim.AdamW``, ``LambdaLR`` and
``torch.nn.utils.clip_grad_norm_``; the 2x2 launch is tests/cli/test_run_optim.py.

bf16 tolerance: the pipeline's graphs are traced under autocast, so they run the very bf16 ops one process runs
under autocast (each microbatch's forward in its own autocast region, its backward outside). The two differ only
in fp32 sums taken in another order (gradients over microbatches and stages, the norm): relative 2^-24 per term.
Such a difference can move a later bf16 rounding by one bf16 ulp, 2^-8 relative (bf16 keeps 8 significant bits),
of the values it touches and no more, so every loss and norm agrees to rtol 2^-8 (observed: below 1e-5).
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import pytest
import torch

import fxpipe
from fxpipe import models
from fxpipe.cli.rank_common import synthetic_batch
from fxpipe.errors import OptionError
from fxpipe.runtime.optim import LossScaler, LRSchedule, OptimizerSpec, parse_betas, squared_norm
from fxpipe.schedules.generators import one_rank

M = 4  # microbatches
BF16_RTOL = 2.0**-8


# -- the factories: pure -------------------------------------------------------------------------------------------

def _lrs(schedule: LRSchedule, steps: int, lr: float = 0.1) -> list[float]:
    """The lr each of ``steps`` steps uses, through torch's LambdaLR as the runtime steps it."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = schedule(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind, expected", [
    ("constant", [0.0, 0.05, 0.1, 0.1, 0.1, 0.1]),
    ("linear", [0.0, 0.05, 0.1, 0.075, 0.05, 0.025]),
    ("cosine", [0.0, 0.05, 0.1, 0.1 * (1 + math.cos(math.pi / 4)) / 2, 0.05,
                0.1 * (1 + math.cos(3 * math.pi / 4)) / 2]),
])
def test_each_schedule_warms_up_from_zero_then_decays_to_zero_at_the_last_step(kind: str,
                                                                               expected: list[float]) -> None:
    assert _lrs(LRSchedule(kind, warmup_steps=2, total_steps=6), 6) == pytest.approx(expected, abs=1e-12)
    assert LRSchedule(kind, warmup_steps=2, total_steps=6).factor(6) == (1.0 if kind == "constant" else 0.0)


def test_no_warmup_starts_at_the_full_rate() -> None:
    assert _lrs(LRSchedule("linear", total_steps=4), 4) == pytest.approx([0.1, 0.075, 0.05, 0.025])
    assert _lrs(LRSchedule("constant"), 3) == [0.1, 0.1, 0.1]


def test_the_optimizer_spec_makes_torch_optimizers() -> None:
    ps = [torch.nn.Parameter(torch.ones(2))]
    adamw = OptimizerSpec("adamw", lr=0.5, weight_decay=0.1, betas=parse_betas("0.8,0.95"))(ps)
    assert isinstance(adamw, torch.optim.AdamW)
    assert (adamw.defaults["lr"], adamw.defaults["weight_decay"], adamw.defaults["betas"]) == (0.5, 0.1, (0.8, 0.95))
    sgd = OptimizerSpec("sgd", lr=0.2, momentum=0.9)(ps)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9


@pytest.mark.parametrize("spec", [OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
                                  OptimizerSpec("adamw", lr=0.1, weight_decay=0.1, betas=(0.8, 0.95))],
                         ids=["momentum-sgd", "adamw"])
def test_the_fused_step_takes_torchs_default_steps(spec: OptimizerSpec) -> None:
    """The spec picks torch's fused kernel for plain CPU parameters (one pass per step: what the cost model charges),
    and over 5 steps it moves the parameters and state as torch's default implementation does."""
    from fxpipe.runtime.optim import fusable

    torch.manual_seed(0)
    start = [torch.randn(33, 7, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    fused_ps = [torch.nn.Parameter(t.clone()) for t in start]
    plain_ps = [torch.nn.Parameter(t.clone()) for t in start]
    fused = spec(fused_ps)
    plain = (torch.optim.AdamW(plain_ps, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
             if spec.name == "adamw" else
             torch.optim.SGD(plain_ps, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay))
    assert fused.param_groups[0]["fused"] is True and not plain.param_groups[0]["fused"]
    for _ in range(5):
        grads = [torch.randn_like(t) for t in start]
        for ps, opt in ((fused_ps, fused), (plain_ps, plain)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(fused_ps, plain_ps):
        torch.testing.assert_close(a, b)
        for key, value in plain.state[b].items():
            torch.testing.assert_close(fused.state[a][key].to(value.dtype), value)
    assert fusable([torch.nn.Parameter(torch.ones(2))]) is True
    assert fusable([torch.nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)]) is None
    assert fusable([]) is None


def test_a_dtensor_parameter_keeps_torchs_default_step(world1: None) -> None:
    """The fused kernels take plain tensors: the spec leaves a DTensor parameter (a per-layer strategy's) to torch's
    default implementation, which steps it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fxpipe.runtime.optim import fusable

    mesh = init_device_mesh("cpu", (1,))
    p = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    assert fusable([p]) is None
    opt = OptimizerSpec("sgd", lr=0.5)([p])
    assert not opt.param_groups[0]["fused"]
    p.grad = distribute_tensor(torch.full((4,), 2.0), mesh, [Replicate()])
    opt.step()
    torch.testing.assert_close(p.full_tensor(), torch.zeros(4))


@pytest.mark.parametrize("make, match", [
    (lambda: OptimizerSpec("lamb"), "unknown optimizer 'lamb'; use one of sgd, adamw"),
    (lambda: OptimizerSpec("adamw", momentum=0.9), "momentum is SGD's"),
    (lambda: parse_betas("0.9"), "--betas takes two numbers"),
    (lambda: parse_betas("0.9,1.5"), r"betas are two numbers in \[0, 1\)"),
    (lambda: LRSchedule("cosine"), "a cosine schedule decays to 0 at its last step, and it has no step count"),
    (lambda: LRSchedule("step"), "unknown learning-rate schedule 'step'"),
])
def test_a_bad_setting_is_one_line(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OptionError, match=match):
        make()


def test_the_loss_scale_follows_grad_scaler() -> None:
    """The same overflow pattern through LossScaler and torch.amp.GradScaler gives the same scales."""
    ours = LossScaler(init_scale=8.0, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for overflow in [False, True, False, False, False, True, True, False, False]:
        p.grad = torch.tensor([math.inf if overflow else 1.0])
        theirs.scale(torch.ones(()))  # its scale is made lazily, by the first scale()
        theirs.unscale_(opt)
        theirs.step(opt)
        theirs.update()
        ours.update(found_inf=overflow)
        assert ours.scale == theirs.get_scale()


def test_the_squared_norm_is_float64_and_not_finite_on_overflow() -> None:
    big = torch.full((4,), 3e38)  # its square overflows float32, not float64
    assert float(squared_norm([big, None])) == pytest.approx(4 * 9e76, rel=1e-6)  # 3e38 in float32: 7 digits
    assert not math.isfinite(float(squared_norm([torch.tensor([1.0, math.inf])])))


# -- a pipeline of 3 stages on one rank, in this process -------------------------------------------------------------

@functools.cache
def _compiled(name: str) -> tuple[object, fxpipe.Pipeline]:
    """The zoo model and its 3-stage pipeline, compiled once for the module (each runtime trains a copy)."""
    zoo = models.build(name)
    return zoo, fxpipe.compile(copy.deepcopy(zoo.model), zoo.example_inputs, stages=3)


def _runtime(name: str, **options):  # type: ignore[no-untyped-def]
    from fxpipe.runtime import PipelineRuntime, RuntimeOptions

    zoo, pipe = _compiled(name)
    return zoo, PipelineRuntime(copy.deepcopy(pipe), one_rank(3, M), zoo.loss_fn, options=RuntimeOptions(**options))


def _reference(zoo, steps: int, *, schedule: LRSchedule, clip: float, precision: str = "fp32",
               scaler: torch.amp.GradScaler | None = None):  # type: ignore[no-untyped-def]
    """One process: AdamW + LambdaLR + clip_grad_norm_, each microbatch's forward in its own autocast region."""
    ref = copy.deepcopy(zoo.model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sched = schedule(opt)
    inputs, target = synthetic_batch(zoo, M)
    xs, ts = inputs[0].tensor_split(M), target.tensor_split(M)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    rows = []
    for _ in range(steps):
        total = 0.0
        for x, t in zip(xs, ts):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = zoo.loss_fn(ref(x), t) / M
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += float(loss.detach())
        lr = opt.param_groups[0]["lr"]
        if scaler is not None:
            scaler.unscale_(opt)
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        sched.step()
        rows.append((total, lr, norm))
    return rows, ref


def _train(zoo, rt, steps: int) -> list[tuple[float, float, float]]:  # type: ignore[no-untyped-def]
    inputs, target = synthetic_batch(zoo, M)
    rows = []
    for _ in range(steps):
        loss = float(rt.step(inputs, target))
        rows.append((loss, rt.lr, rt.last_grad_norm))
    return rows


SCHEDULE = LRSchedule("cosine", warmup_steps=1, total_steps=4)


def test_adamw_cosine_and_clipping_train_like_one_process(world1: None) -> None:
    """fp32: each step's loss, lr and global norm equal torch's (rtol 1e-5), and so do the trained weights; gpt-tiny's
    tied embedding counts once in the norm. Without clipping each stage steps as soon as its last W ran."""
    zoo, rt = _runtime("gpt-tiny", optimizer=OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1), lr_schedule=SCHEDULE,
                       clip_grad_norm=0.5)
    assert rt._early == {}  # every optimizer waits for the norm
    got = _train(zoo, rt, 3)
    want, ref = _reference(zoo, 3, schedule=SCHEDULE, clip=0.5)
    assert [lr for _, lr, _ in got] == [lr for _, lr, _ in want] == pytest.approx([0.0, 1e-2, 7.5e-3])
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-5, atol=0)
    assert min(n for _, _, n in want) > 0.5  # clipping acted on every step
    params = {n: p for s in rt.mine for n, p in rt.stages[s].module.named_parameters(remove_duplicate=False)}
    assert params
    for name, p in ref.named_parameters(remove_duplicate=False):
        if name not in params:  # a tied weight under the name the pipeline does not use
            continue
        # atol: AdamW moves a parameter whose gradient is at fp32 rounding level (a bias with ~0 gradient) by
        # about lr x its sign, and that sign is rounding noise; 1e-5 is 1e-3 of the lr
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-5, msg=lambda msg: f"{name}: {msg}")
    _, plain = _runtime("mlp-tiny")
    assert plain._early and plain.last_grad_norm is None  # no clipping: the early steps stay


def test_bf16_trains_like_one_process_under_autocast(world1: None) -> None:
    """bf16 autocast in the stage graphs: the losses and norms of one process's autocast training within 2^-8
    (the module docstring derives it); the weights, gradients and AdamW's state stay fp32."""
    zoo, rt = _runtime("gpt-tiny", optimizer=OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1), lr_schedule=SCHEDULE,
                       clip_grad_norm=0.5, precision="bf16")
    got = _train(zoo, rt, 3)
    want, _ = _reference(zoo, 3, schedule=SCHEDULE, clip=0.5, precision="bf16")
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=BF16_RTOL, atol=0)
    fp32, _ = _reference(zoo, 1, schedule=SCHEDULE, clip=0.5)
    assert got[0][2] != pytest.approx(fp32[0][2], rel=1e-5)  # it did compute in bf16
    for s in rt.mine:
        for p in rt.stages[s].module.parameters():
            assert p.dtype == p.grad.dtype == torch.float32
            state = rt.optimizers[s].state[p] if s in rt.optimizers else {}  # a tied weight: its first stage's
            assert all(v.dtype == torch.float32 for v in state.values() if v.dim() > 0)
    casts = [sum(n.target is torch.ops.aten._to_copy.default and n.kwargs.get("dtype") == torch.bfloat16
                 for n in rt.graphs[s].forward.graph.nodes) for s in rt.mine]
    assert sum(casts) > 0, casts  # autocast's casts are ops of the F graphs


def test_fp16_skips_overflowing_steps_like_grad_scaler(world1: None) -> None:
    """fp16 from a loss scale of 2^20: the first and the last step overflow fp16 somewhere, and are skipped on
    every stage while the scale halves, exactly where torch.amp.GradScaler skips in one process; the losses and
    norms agree within fp16's 2^-11 (the same argument as bf16's)."""
    zoo, rt = _runtime("mlp-tiny", optimizer=OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1), lr_schedule=SCHEDULE,
                       clip_grad_norm=0.5, precision="fp16")
    rt.scaler.scale = 2.0**20
    inputs, target = synthetic_batch(zoo, M)
    got, scales = [], []
    for _ in range(4):
        got.append((float(rt.step(inputs, target)), rt.lr, rt.last_grad_norm))
        scales.append(rt.scaler.scale)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    want, _ = _reference(zoo, 4, schedule=SCHEDULE, clip=0.5, precision="fp16", scaler=scaler)
    assert [math.isfinite(n) for _, _, n in got] == [math.isfinite(n) for _, _, n in want] == [False, True, True, False]
    assert scales == [2.0**19, 2.0**19, 2.0**19, 2.0**18] and scaler.get_scale() == 2.0**18
    finite = [0, 1, 2]  # losses (step 3's too: computed before its overflow); norms where finite
    torch.testing.assert_close(torch.tensor([r[0] for r in got]), torch.tensor([r[0] for r in want]), rtol=2.0**-11,
                               atol=0)
    torch.testing.assert_close(torch.tensor([got[k][2] for k in finite[1:]]),
                               torch.tensor([want[k][2] for k in finite[1:]]), rtol=2.0**-11, atol=0)
    assert got[1][0] == got[0][0] != got[2][0]  # the skipped first step left the weights, the second moved them


def test_a_resumed_run_continues_the_schedule_exactly(world1: None, tmp_path: Path) -> None:
    """A checkpoint carries the lr schedule's step (and fp16's scale): steps 3-4 after loading step 2 equal steps 3-4
    of an unbroken run, bit for bit."""
    options = dict(optimizer=OptimizerSpec("adamw", lr=1e-2), lr_schedule=SCHEDULE, clip_grad_norm=0.5,
                   precision="fp16")
    zoo, rt = _runtime("mlp-tiny", **options)
    whole = _train(zoo, rt, 4)
    zoo, first = _runtime("mlp-tiny", **options)
    _train(zoo, first, 2)
    first.save_checkpoint(tmp_path, 2)
    zoo, resumed = _runtime("mlp-tiny", **options)
    assert resumed.load_checkpoint(tmp_path) == 2
    assert resumed.scaler.scale == first.scaler.scale
    assert _train(zoo, resumed, 2) == whole[2:]


def test_a_loaded_state_keeps_the_optimizers_own_kernel(world1: None) -> None:
    """A checkpoint carries hyperparameters, not how torch runs the step: a state saved by torch's default
    implementation (an older fxpipe's) loads into the fused one with its lr, and the kernel stays fused."""
    spec = OptimizerSpec("sgd", lr=0.1, momentum=0.9)
    zoo, rt = _runtime("mlp-tiny", optimizer=spec)
    _train(zoo, rt, 1)
    state = rt.state_dict()
    assert state["param_groups"] and all(g["fused"] is True for g in state["param_groups"])
    for g in state["param_groups"]:
        g.update(fused=None, foreach=True, lr=0.05)
    zoo, fresh = _runtime("mlp-tiny", optimizer=spec)
    fresh.load_state_dict(state)
    groups = [g for opt in fresh.optimizers.values() for g in opt.param_groups]
    assert groups and all(g["fused"] is True and g["foreach"] is None and g["lr"] == 0.05 for g in groups)
    assert all(opt.state for opt in fresh.optimizers.values())  # the momentum buffers came too


@pytest.mark.parametrize("transposed", ["gradient", "parameter"])
def test_a_gradient_laid_out_unlike_its_parameter_is_handed_over_in_the_parameters_layout(transposed: str) -> None:
    """torch's fused kernels step parameter, gradient and state in memory order: a gradient laid out unlike its
    parameter is stepped into the wrong elements (shown here; AOTAutograd's W graphs return each gradient in its
    parameter's layout, so this guards the other ways a gradient can arrive), and ``core.grad_like`` hands it over
    in the parameter's layout, a fresh one that already is without a copy."""
    from fxpipe.runtime.core import grad_like

    torch.manual_seed(0)
    start = torch.randn(6, 4, dtype=torch.float64)
    grads = [torch.randn(6, 4, dtype=torch.float64) for _ in range(3)]

    def layout(t: torch.Tensor, flip: bool) -> torch.Tensor:
        return t.t().contiguous().t() if flip else t.clone()

    def train(fused: bool | None, handover: bool) -> torch.Tensor:
        p = torch.nn.Parameter(layout(start, transposed == "parameter"))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=fused)
        for g in grads:
            g = layout(g, transposed == "gradient")
            p.grad = grad_like(p, g, fresh=True) if handover else g
            opt.step()
        return p.detach()

    want = train(None, handover=False)  # torch's default step reads any layout
    assert not torch.allclose(train(True, handover=False), want)
    torch.testing.assert_close(train(True, handover=True), want)
    p, g = torch.zeros(3, 2), torch.ones(3, 2)
    assert grad_like(p, g, fresh=True) is not g and grad_like(p, g, fresh=True).data_ptr() == g.data_ptr()
    assert grad_like(p, g, fresh=False).data_ptr() != g.data_ptr()
