"""What the two rank programs (``fxpipe.cli.rank``'s pipelines, ``fxpipe.cli.rank_strategy``'s per-layer strategies)
share: the built-in model's synthetic batch, whether a run resumes, and the checks that stop training at a
non-finite value before it is checkpointed."""

from __future__ import annotations

import argparse
from typing import Any


def synthetic_batch(zoo: object, m: int, seed: int = 1234) -> tuple[tuple[object, ...], object]:
    """``--data synthetic``: m microbatches shaped like the model's example batch, from a fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def draw(t: torch.Tensor) -> torch.Tensor:
        shape = (t.shape[0] * m, *t.shape[1:])
        if t.is_floating_point():
            return torch.randn(shape, generator=gen, dtype=t.dtype)
        return torch.randint(0, int(t.max()) + 1, shape, generator=gen, dtype=t.dtype)

    inputs = tuple(draw(x) for x in zoo.example_inputs)  # type: ignore[attr-defined]
    return inputs, draw(zoo.example_target)  # type: ignore[attr-defined]


def check_finite_loss(loss: float, grad_norm: float | None, step: int) -> None:
    """Stop the run at a NaN or infinite loss or global gradient norm (the same on every rank: each is reduced over
    all of them), in one line; fp16's loss scaler skips an overflowed step itself, with a finite loss."""
    import math

    from fxpipe.errors import NonFiniteError

    for what, value in (("loss", loss), ("global gradient norm", grad_norm)):
        if value is not None and not math.isfinite(value):
            raise NonFiniteError(f"step {step}'s {what} is {value}: training stopped there, and no checkpoint holds "
                                 "that step or a later one; lower --lr, pass --clip-grad-norm, or check the data")


def check_finite_weights(optimizers: Any, step: int, rank: int, world: int) -> None:
    """Before a checkpoint: every rank's weights are finite, or every rank stops with one line naming the ranks
    whose weights are not (one all-gather of a flag)."""
    import torch
    import torch.distributed as dist

    from fxpipe.errors import NonFiniteError

    finite = all(bool(torch.isfinite(p).all()) for opt in optimizers for g in opt.param_groups for p in g["params"])
    flags: list[Any] = [None] * world
    if dist.is_initialized() and world > 1:
        dist.all_gather_object(flags, finite)
    else:
        flags = [finite]
    bad = [r for r, ok in enumerate(flags) if not ok]
    if bad:
        raise NonFiniteError(f"step {step}'s update left non-finite weights on rank{'s' if len(bad) > 1 else ''} "
                             f"{', '.join(map(str, bad))}: training stopped before that step was checkpointed (the "
                             "newest checkpoint is the last finite one); lower --lr or pass --clip-grad-norm")


def resumes(args: argparse.Namespace, world: int) -> bool:
    """Whether this run loads a checkpoint: ``--resume always``, or ``auto`` when any rank sees a complete one
    (every rank learns what each saw, so all of them load or none does)."""
    if not args.checkpoint_dir or args.resume == "never":
        return False
    if args.resume == "always":
        return True
    import torch.distributed as dist

    from fxpipe.errors import CheckpointError
    from fxpipe.runtime import checkpoint

    try:
        seen = checkpoint.scan(args.checkpoint_dir).found is not None
    except CheckpointError:
        seen = True  # a tampered file: loading says so in one line
    every: list[Any] = [None] * world
    dist.all_gather_object(every, seen)
    return any(every)
