"""Worker for the multi-process runtime tests: one rank trains the zoo model on its stages, then saves its parameters."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def train(rank: int, world: int, init: str, out: str, model: str, stages: int, schedules: list[str], m: int,
          steps: int, fail_rank: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=20))
    try:
        import fxpipe
        from fxpipe import models
        from fxpipe.runtime.executor import PipelineRuntime
        from fxpipe.schedules.generators import generate

        for name in schedules:
            zoo = models.build(model, dtype=torch.float64, batch_size=m * 2)
            pipe = fxpipe.compile(zoo.model, tuple(x.tensor_split(m)[0] for x in zoo.example_inputs), stages=stages)
            costs = pipe.schedule_costs()
            if name == "auto":
                from fxpipe.schedules.auto import auto

                sched = auto(stages, costs, microbatches=[m]).schedule
            else:
                sched = generate(name, stages, m, costs)
            rt = PipelineRuntime(pipe, sched, zoo.loss_fn,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                 timeout=timedelta(seconds=10))
            losses = []
            for step in range(steps):
                if rank == fail_rank and step == 1:
                    raise ValueError(f"boom on rank {rank}")
                losses.append(float(rt.step(zoo.example_inputs, zoo.example_target)))
            torch.save({"losses": losses, "state": rt.state_dict()}, Path(out) / f"{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    train(int(args[0]), int(args[1]), args[2], args[3], args[4], int(args[5]), args[6].split(","), int(args[7]),
          int(args[8]), int(args[9]))
