"""Optimizers, learning-rate schedules, the global gradient norm and fp16 loss scaling of the pipeline runtime.

``PipelineRuntime`` makes one optimizer per stage of its rank (:class:`OptimizerSpec`, or any factory of
parameters) and gives each a ``LambdaLR`` of one :class:`LRSchedule`, stepped once per step, so every
stage follows the same learning-rate curve (linear warmup from 0, then constant, cosine or linear decay
to 0 at ``total_steps``; the formulas of Hugging Face's ``get_*_schedule_with_warmup``).

Clipping and fp16 need one number of the whole model before any optimizer steps: the gradient norm.
Each rank takes ``torch.nn.utils.get_total_norm`` of the gradients it is the one to count (a parameter
once, however many of its stages, tied ranks or replicas hold it), the ranks add its squares in one
all-reduce, and the square root is the norm ``torch.nn.utils.clip_grad_norm_`` gives in one process;
``torch.nn.utils.clip_grads_with_norm_`` then clips to it. A non-finite sum is the fp16 overflow check:
:class:`LossScaler` (``torch.amp.GradScaler``'s rule) then skips the step on every rank and halves its scale.

Precision ``bf16``/``fp16`` means autocast in the stage graphs: they are traced under ``torch.autocast``
(:func:`autocast_of`), so each cast is an op of F and the casts' gradients are ops of B and W; the
parameters, their gradients and the optimizer state stay fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.errors import OptionError

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer by name and hyperparameters; called on a stage's parameters it makes that stage's optimizer.
    ``momentum`` is SGD's, ``betas`` AdamW's; ``weight_decay`` either's (AdamW's is decoupled)."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise OptionError(f"unknown optimizer {self.name!r}; use one of {', '.join(OPTIMIZERS)}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise OptionError(f"the learning rate must be a finite number >= 0 (lr: {self.lr})")
        if not 0 <= self.momentum < 1:
            raise OptionError(f"momentum must be in [0, 1) (momentum: {self.momentum})")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise OptionError(f"weight decay must be a finite number >= 0 (weight decay: {self.weight_decay})")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise OptionError(f"betas are two numbers in [0, 1), e.g. 0.9,0.999 (betas: {self.betas})")
        if self.name == "adamw" and self.momentum:
            raise OptionError(f"momentum is SGD's; AdamW's are its betas (momentum: {self.momentum}): "
                              "pass --betas B1,B2 instead")

    # Tensors, not only Parameters: torch's optimizers take any leaf tensors, and a strategy rank's are DTensors.
    def __call__(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        fused = fusable(params)
        if self.name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay, fused=fused)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, fused=fused)


def fusable(params: Iterable[torch.Tensor]) -> bool | None:
    """True where torch's fused optimizer kernels take ``params`` (plain dense floating-point tensors on the CPU or a
    GPU): one pass over parameter, gradient and state per step, the traffic ``fxpipe.planning.cost.OPTIMIZER_TRAFFIC``
    charges, where torch's default steps make several (benchmarks/RESULTS.md, "Optimizer step"); None (torch's
    default) otherwise, e.g. for DTensors."""
    params = list(params)
    ok = bool(params) and all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda")
                              and p.is_floating_point() and p.layout is torch.strided for p in params)
    return True if ok else None


def parse_betas(text: str) -> tuple[float, float]:
    """``"0.9,0.95"`` -> (0.9, 0.95), or one line saying what is wrong."""
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise OptionError(f"--betas takes two numbers, B1,B2, e.g. 0.9,0.999 (betas: {text!r})") from None
    OptimizerSpec("adamw", betas=(b1, b2))  # checks the range
    return b1, b2


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of step k (from 0) as a factor of the optimizer's: ``warmup_steps`` rising linearly from 0,
    then ``kind``: constant, or cosine / linear decay to 0 at ``total_steps`` (needed for those).

    >>> [round(LRSchedule("cosine", warmup_steps=2, total_steps=6).factor(k), 3) for k in range(7)]
    [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
    """

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise OptionError(f"unknown learning-rate schedule {self.kind!r}; use one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise OptionError(f"warmup steps must be 0 or more (warmup steps: {self.warmup_steps})")
        if self.kind != "constant" and (self.total_steps is None or self.total_steps < 1):
            raise OptionError(f"a {self.kind} schedule decays to 0 at its last step, and it has no step count "
                              f"(total steps: {self.total_steps}); pass LRSchedule({self.kind!r}, total_steps=N)")

    def factor(self, k: int) -> float:
        if k < self.warmup_steps:
            return k / self.warmup_steps
        if self.kind == "constant" or self.total_steps is None:
            return 1.0
        progress = (k - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))

    def __call__(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        factor = self.factor
        # a function, not this object: LambdaLR saves no state of it
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: factor(k))


Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def optimizer_factory(optimizer: str | Factory | None) -> Factory:
    """``PipelineRuntime(optimizer=)``: a name (``"sgd"``, ``"adamw"``, default hyperparameters), an
    :class:`OptimizerSpec`, any factory of parameters (a ``torch.optim`` class), or None (SGD, lr 0.01)."""
    if optimizer is None:
        return OptimizerSpec()
    if isinstance(optimizer, str):
        return OptimizerSpec(optimizer)
    return optimizer


def scheduler_factory(schedule: str | LRSchedule | SchedulerFactory | None) -> SchedulerFactory | None:
    """``PipelineRuntime(lr_schedule=)``: None (the optimizer's lr every step), ``"constant"``, an
    :class:`LRSchedule`, or any factory of an optimizer's ``LRScheduler``."""
    if schedule is None:
        return None
    if isinstance(schedule, str):
        return LRSchedule(schedule)
    return schedule


def autocast_of(precision: str, device_type: str) -> tuple[str, torch.dtype] | None:
    """``(device type, dtype)`` of ``torch.autocast`` for a precision; None for fp32."""
    if precision not in PRECISIONS:
        raise OptionError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    return (device_type, _DTYPES[precision]) if precision in _DTYPES else None


def autocast_loss(loss_fn: Callable[[Any, Any], torch.Tensor],
                  autocast: tuple[str, torch.dtype] | None) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` run under autocast, as a model's loss is in a one-process autocast region (its backward is
    not: autograd differentiates it outside, as ``loss.backward()`` after the region would)."""
    if autocast is None:
        return loss_fn

    def loss(outputs: Any, target: Any) -> torch.Tensor:
        with torch.autocast(autocast[0], dtype=autocast[1]):
            return loss_fn(outputs, target)

    return loss


def squared_norm(grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """The square of ``torch.nn.utils.get_total_norm`` of ``grads`` (None skipped), in float64 on the CPU: inf or nan
    when one is not finite; what a rank adds to the all-reduce of the global norm.

    ``get_total_norm`` is given each gradient's norm taken in float64 (the norm of the norms is the norm), so that
    finite fp32 gradients never overflow it (their fp32 norm can: ``[3e38] * 4``), and adding the ranks' squares
    loses nothing; it groups them by device, one copy to the CPU per device, not one per tensor."""
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads if g is not None]
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    return torch.nn.utils.get_total_norm(norms).cpu().square()


def clip_grads(params: Iterable[torch.Tensor], max_norm: float, norm: float) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` of ``params``' gradients to ``max_norm``, given the global ``norm``
    (every rank's, from one all-reduce): each is multiplied by :func:`clip_coefficient`, as one process's
    ``clip_grad_norm_`` does (a factor of 1 changes nothing)."""
    torch.nn.utils.clip_grads_with_norm_(list(params), max_norm, torch.tensor(norm, dtype=torch.float64))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What ``torch.nn.utils.clip_grads_with_norm_`` multiplies the gradients by: ``max_norm / (norm + 1e-6)``, at
    most 1."""
    return min(1.0, max_norm / (norm + 1e-6))


class LossScaler:
    """fp16's dynamic loss scale, ``torch.amp.GradScaler``'s rule for a whole pipeline: the loss is multiplied
    by :attr:`scale`; a step whose gradients are not all finite (on any rank: the caller's one reduction) is
    skipped and the scale halved; after ``growth_interval`` finite steps in a row it doubles."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float]:
        return {"loss_scale": self.scale, "growth_tracker": float(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["loss_scale"])
        self.growth_tracker = int(state["growth_tracker"])
