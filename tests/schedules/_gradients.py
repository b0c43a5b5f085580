"""The reference executor against eager PyTorch over every schedule generator: shared by the schedule and runtime
tests."""

from __future__ import annotations

import copy
from typing import Any

import torch

from fxpipe.runtime.reference import ReferenceExecutor
from fxpipe.schedules.generators import GENERATORS, generate


def every_generator_gives_eagers_gradients(mine: torch.nn.Module, pipe: Any, zoo: Any, stages: int) -> None:
    """Every generator at 1, ``stages`` and ``2 * stages + 1`` microbatches, run by the reference executor on
    ``pipe`` (compiled from ``mine``), gives eager's gradients of the mean loss over the microbatches."""
    executor = ReferenceExecutor(pipe, zoo.loss_fn)
    gen = torch.Generator().manual_seed(3)
    x = zoo.example_inputs[0]
    for m in sorted({1, stages, 2 * stages + 1}):
        mbs = [((torch.randn(x.shape, generator=gen, dtype=x.dtype) if x.is_floating_point()
                 else torch.randint(0, int(x.max()) + 1, x.shape, generator=gen),),
                torch.randint(0, int(zoo.example_target.max()) + 1, zoo.example_target.shape, generator=gen))
               for _ in range(m)]
        ref = copy.deepcopy(zoo.model)
        (sum(zoo.loss_fn(ref(*xs), t) for xs, t in mbs) / m).backward()
        expected = {n: p.grad for n, p in ref.named_parameters()}
        for name in sorted(GENERATORS):
            if name == "interleaved-1f1b" and (stages % 2 or m % (stages // 2)):
                continue  # needs two stages per rank and whole rounds of microbatches
            mine.zero_grad(set_to_none=True)
            executor.run_schedule(generate(name, stages, m), mbs)
            for pname, p in mine.named_parameters():
                torch.testing.assert_close(p.grad, expected[pname], msg=lambda msg: f"{name} m={m} {pname}: {msg}")
