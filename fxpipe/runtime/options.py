"""RuntimeOptions: how ``PipelineRuntime`` trains, every knob and its default declared once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from fxpipe.plan import _default

if TYPE_CHECKING:  # names for the annotations only: this module imports neither torch nor the optimizers
    import torch

    from fxpipe.runtime.optim import LRSchedule

    OptimizerChoice = str | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    LRScheduleChoice = str | LRSchedule | Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass(frozen=True)
class RuntimeOptions:
    """How a :class:`fxpipe.runtime.PipelineRuntime` trains; the same on every rank (the ranks check that they agree).

    What differs per rank or is a live object (the device, the mesh, the host settings, example inputs) is passed
    to the runtime itself. Change a field with ``dataclasses.replace``.

    Attributes:
        optimizer: One optimizer per stage: ``"sgd"`` or ``"adamw"`` (at ``lr``), an
            :class:`fxpipe.runtime.optim.OptimizerSpec`, or any factory of a stage's parameters (a ``torch.optim``
            class), which carries its own learning rate.
        lr: The learning rate of a named optimizer; ``DEFAULTS.lr`` when the options are made.
        lr_schedule: Stepped once per step: None (``lr`` every step), ``"constant"``, an
            :class:`fxpipe.runtime.optim.LRSchedule`, or a factory of an optimizer's ``LRScheduler``.
        clip_grad_norm: Clip the gradients to this global norm (``math.inf``: only measure it); None: no clipping.
            Synchronous schedules only.
        precision: ``fp32``, or ``bf16``/``fp16`` autocast in the stage graphs with fp32 weights (fp16 with a loss
            scale; synchronous schedules only).
        microbatches: Microbatches per step when the schedule is given by name; None: the plan's, else
            ``DEFAULTS.microbatches``.
        timeout: How long a rank waits for a peer before naming it and stopping; None: torch's default.
        prefetch: None posts all of a step's receives at its start into buffers reused every step (fastest); K posts
            each action's receives K actions ahead into new buffers, so receive memory follows the schedule's
            in-flight count.
        weights: Asynchronous schedules: which weight version each phase reads (``fxpipe.schedules.versions``).
        track_memory: Count, per stage, the bytes kept between a microbatch's actions (``peak_held_bytes``); costs
            a few percent of a small stage's step, so off unless asked for.
        codegen: ``eager``, or ``inductor`` to compile this rank's stage graphs (synchronous schedules).
        cuda_graphs: Replay the eager stage graphs as CUDA graphs; None: on for a CUDA rank running a synchronous
            schedule's eager graphs.
        recompute: ``none``, ``stage`` (every stage whose inputs are smaller than what its F saves keeps only them
            and B runs F again), ``auto`` (the stages the plan's memory cap needs), or stage indices.
        tag_blind: One tag for all of a pair of ranks' messages, matched first in first out as NCCL does; None: under
            NCCL only.
        w_lane: Run each W on a second lane of the rank, beside its F and B.
        keep_checkpoints: The newest checkpoints ``save_checkpoint`` keeps; None: ``checkpoint.DEFAULT_KEEP``.
        async_checkpoint: ``save_checkpoint`` writes through ``dcp.async_save`` while training goes on; each save
            completes before the next starts, and ``wait_checkpoint`` completes the last (call it before the run
            ends).
        skip_nonfinite: A step whose global gradient norm is NaN or infinite updates no weight (every rank alike;
            ``last_step_skipped`` says so) instead of training on; costs the norm's all-reduce each step.
            Synchronous schedules.
    """

    optimizer: OptimizerChoice = "sgd"
    lr: float = _default("lr")  # read from DEFAULTS when an options object is made
    lr_schedule: LRScheduleChoice | None = None
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    microbatches: int | None = None
    timeout: timedelta | None = None
    prefetch: int | None = None
    weights: str = "stash"
    track_memory: bool = False
    codegen: str = "eager"
    cuda_graphs: bool | None = None
    recompute: str | Sequence[int] = "none"
    tag_blind: bool | None = None
    w_lane: bool = False
    keep_checkpoints: int | None = None
    async_checkpoint: bool = False
    skip_nonfinite: bool = False
